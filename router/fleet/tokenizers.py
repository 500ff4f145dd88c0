"""Backend tokenizers from checkpoint directories (``--tokenizer MODEL=DIR``), read once at start.

A vLLM model routed on its KV events needs the request's exact token ids
(``router/routing/chat_tokens.py``): the checkpoint's ``tokenizer.json``, its
``tokenizer_config.json`` (special tokens, chat template) and, where the checkpoint keeps its
template apart, ``chat_template.jinja``. Nothing is downloaded: the directory must hold them.
"""
from __future__ import annotations

import json
from pathlib import Path


class TokenizerLoadError(ValueError):
    """A ``--tokenizer`` directory that cannot be used (missing files, no engines extra)."""


def load_backend_tokenizers(entries: dict[str, str]):  # -> BackendTokenizers (imported lazily)
    """``MODEL -> DIR`` as a ``BackendTokenizers``; raises :class:`TokenizerLoadError`."""
    try:
        from router.routing.chat_tokens import BackendTokenizer, BackendTokenizers, ChatTokensError
    except ImportError as exc:
        raise TokenizerLoadError(f"--tokenizer needs the engines extra (pip install 'prefixlb[engines]'): "
                                 f"{exc}") from None
    loaded = {}
    for model, directory in entries.items():
        base = Path(directory)
        try:
            tokenizer_json = (base / "tokenizer.json").read_text(encoding="utf-8")
            config = json.loads((base / "tokenizer_config.json").read_text(encoding="utf-8"))
            template_file = base / "chat_template.jinja"
            template = template_file.read_text(encoding="utf-8") if template_file.exists() else None
        except (OSError, ValueError) as exc:
            raise TokenizerLoadError(f"--tokenizer {model}={directory}: {exc}") from None
        if not isinstance(config, dict):
            raise TokenizerLoadError(f"--tokenizer {model}={directory}: tokenizer_config.json is not an object")
        try:
            loaded[model] = BackendTokenizer.from_files(tokenizer_json, config, template)
        except (ChatTokensError, ImportError) as exc:
            raise TokenizerLoadError(f"--tokenizer {model}={directory}: {exc}") from None
    return BackendTokenizers(loaded)
