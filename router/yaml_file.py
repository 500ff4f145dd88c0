"""read_yaml: a YAML configuration file's content, with errors that name the file.

Shared by the files the router reads besides its settings (the price book, virtual models):
each raises its own error class, so the message reaches the operator the same way.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: str | Path, error: type[ValueError], what: str = "") -> Any:
    """The decoded content of ``path``; ``error`` when it cannot be read or is not YAML."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"cannot read {what + ' ' if what else ''}{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from None
