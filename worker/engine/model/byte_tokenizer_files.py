"""The byte-level vocabulary as Hugging Face tokenizer files every engine reads.

``prefixlb model save`` writes these beside the weights so that vLLM, SGLang, transformers and
prefixlb's own worker all turn the same text into the same token ids as the presets'
:class:`~worker.engine.tokenizer.ByteTokenizer`:

- ``tokenizer.json``: a BPE model with *no merges* whose vocabulary is the 256 bytes, each
  spelled in GPT-2's printable byte alphabet (so id ``b`` is byte ``b``), under a ``ByteLevel``
  pre-tokenizer and decoder; BOS (256) and EOS (257) are special added tokens, and a template
  post-processor puts BOS first when special tokens are requested (completions prompts).
- ``tokenizer_config.json``: the BOS/EOS names and the chat template, a Jinja rendering of the
  worker's default chat format (:mod:`worker.engine.chat_template`) that begins with
  ``{{ bos_token }}`` as Hugging Face templates do (engines render it, then tokenize without
  adding special tokens).

A prompt that literally contains ``<|bos|>`` or ``<|eos|>`` is the one place the two tokenizers
differ: ``tokenizers`` matches added tokens in any text, the byte tokenizer never does.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker.engine.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, byte_level_alphabet

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"

# The default chat format of worker/engine/chat_template.py, written for the Jinja environment of
# transformers' apply_chat_template (trim_blocks, lstrip_blocks; tojson(sort_keys=...) is
# json.dumps with ensure_ascii=False). Newlines sit only *before* block tags, where trim_blocks
# leaves them alone.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>\n{{ tools | tojson(sort_keys=True) }}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part is string %}{{ part }}"
    "{% elif part['type'] | default('text') == 'text' and part['text'] is string %}{{ part['text'] }}"
    "{% else %}{{ part | tojson(sort_keys=True) }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% if message['tool_calls'] %}{{ message['tool_calls'] | tojson(sort_keys=True) }}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_tokenizer_json() -> str:
    """``tokenizer.json`` text of the byte-level vocabulary (ids agree with ByteTokenizer)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {ch: b for b, ch in byte_level_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: with no merges the split changes nothing, and skipping it keeps encoding cheap.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS_TOKEN, special=True, normalized=False),
                            AddedToken(EOS_TOKEN, special=True, normalized=False)])
    assert (tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)) == (BYTE_BOS_ID, BYTE_EOS_ID)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BYTE_BOS_ID)])
    return tok.to_str(pretty=True)


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens, BOS added to plain prompts, the chat template."""
    added = {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, name in ((BYTE_BOS_ID, BOS_TOKEN), (BYTE_EOS_ID, EOS_TOKEN))}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }


def save_byte_tokenizer(directory: str | Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n",
                                                     encoding="utf-8")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n",
                                                       encoding="utf-8")
