"""The tokenizer files `prefixlb model save` writes give every engine the byte tokenizer's ids.

The presets run on ByteTokenizer (one UTF-8 byte = one id, BOS 256, EOS 257) and the default
chat format; a saved checkpoint must mean the same to Hugging Face ``tokenizers``, to
transformers and to prefixlb's worker loading it, or vLLM and the worker would compute
different prompts for the same request.
"""
from __future__ import annotations

import json

import pytest

from worker.engine.chat_template import with_tool_call_objects
from worker.engine.model.byte_tokenizer_files import BOS_TOKEN, EOS_TOKEN, save_byte_tokenizer
from worker.engine.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, ByteTokenizer, HFTokenizer, byte_level_alphabet

TEXTS = ["", "Grüße, 世界! 👋🏽 ok", "  two  spaces\tand\ttabs\n\nnewlines ", "<|user|>\nnot special",
         bytes(range(32, 127)).decode(), "\x00\x01\x7f control"]

CHATS = [
    ([{"role": "user", "content": "hi"}], None),
    ([{"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
      {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                             "function": {"name": "f", "arguments": "{}"}}]}],
     [{"type": "function", "function": {"name": "f", "description": "ö"}}]),
    ([{"role": "user", "content": "first"}, {"role": "assistant", "content": "second"},
      {"role": "user", "content": "third"}], None),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("byte-tok")
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
    save_byte_tokenizer(directory)
    return directory


def test_every_byte_and_both_special_tokens_keep_their_ids(saved):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(saved / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 258
    assert (tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)) == (BYTE_BOS_ID, BYTE_EOS_ID)
    alphabet = byte_level_alphabet()  # byte -> the printable character ByteLevel spells it as
    assert tok.get_vocab(with_added_tokens=True) == {**{alphabet[b]: b for b in range(256)},
                                                    BOS_TOKEN: BYTE_BOS_ID, EOS_TOKEN: BYTE_EOS_ID}
    text = "".join(chr(c) for c in range(0x800))  # 1- and 2-byte UTF-8: bytes 0x00-0x7F, 0x80-0xDF
    assert tok.encode(text, add_special_tokens=False).ids == list(text.encode("utf-8"))


@pytest.mark.parametrize("text", TEXTS)
def test_text_tokenizes_as_the_byte_tokenizer_does_with_bos_only_when_special_tokens_are_asked(saved, text):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(saved / "tokenizer.json"))
    byte = ByteTokenizer()
    assert tok.encode(text, add_special_tokens=True).ids == byte.encode(text)
    assert tok.encode(text, add_special_tokens=False).ids == byte.encode(text, add_bos=False)
    assert tok.decode(byte.encode(text) + [BYTE_EOS_ID], skip_special_tokens=True) == text


def test_the_worker_loads_the_files_with_the_byte_tokenizers_ids_bytes_and_chat_format(saved):
    hf, byte = HFTokenizer(saved), ByteTokenizer()
    assert (hf.bos_token_id, hf.eos_token_id, hf.vocab_size) == (256, 257, 258)
    assert [hf.token_bytes(i) for i in range(258)] == [byte.token_bytes(i) for i in range(258)]
    for text in TEXTS:
        assert hf.encode(text) == byte.encode(text)
    for messages, tools in CHATS:
        assert hf.apply_chat_template(messages, tools) == byte.apply_chat_template(messages, tools)
        assert hf.encode(hf.apply_chat_template(messages, tools)) == byte.encode(byte.apply_chat_template(messages, tools))


@pytest.mark.parametrize("messages, tools", CHATS)
def test_transformers_renders_the_saved_chat_template_as_bos_then_the_default_format(saved, messages, tools):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(saved)
    conversation = with_tool_call_objects(messages)  # as vLLM hands it over: tool-call arguments as objects
    text = reference.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == BOS_TOKEN + ByteTokenizer().apply_chat_template(messages, tools)
    ids = reference.apply_chat_template(conversation, tools=tools, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    assert ids == ByteTokenizer().encode(ByteTokenizer().apply_chat_template(messages, tools))
