"""Fixtures of the integration tests that build on the tiny model."""
from __future__ import annotations

import pytest

from worker.engine.model.presets import build_preset
from worker.engine.model.save import save_pretrained


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The tiny preset saved in Hugging Face format (transformers, peft and the engine load it)."""
    d = tmp_path_factory.mktemp("tiny-hf")
    save_pretrained(build_preset("tiny"), d)
    return d
