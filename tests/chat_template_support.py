"""Tokenizer directories for chat-template tests: a byte-level ``tokenizer.json`` with a model
family's special tokens and a chat template, which transformers and the worker both load."""
from __future__ import annotations

import json
from pathlib import Path

from tests.support import ROOT

TEMPLATES = ROOT / "tests" / "data" / "chat_templates"

# Special tokens of each family (names as the real tokenizers spell them) and its BOS / EOS.
FAMILIES = {
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2_5": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                 "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "<s>", "</s>"),
}


def write_tokenizer(directory: Path, family: str, template: str | None = None, add_bos: bool | None = None,
                    named: dict[str, str] | None = None) -> Path:
    """``tokenizer.json`` + ``tokenizer_config.json`` of ``family`` in ``directory``: the 256 bytes
    (ids 0-255, GPT-2's byte alphabet) then the family's special tokens; ``template`` (default:
    the family's file in tests/data/chat_templates) or ``named`` templates."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from worker.engine.tokenizer import byte_level_alphabet

    specials, bos, eos = FAMILIES[family]
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in byte_level_alphabet().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "clean_up_tokenization_spaces": False, "model_max_length": 131072}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    if named is not None:
        config["chat_template"] = [{"name": k, "template": v} for k, v in named.items()]
    else:
        config["chat_template"] = template if template is not None else (TEMPLATES / f"{family}.jinja").read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
