"""Tokenizers: byte-level default, tokenizer.json checkpoints, incremental detokenizing, chat templates."""
from __future__ import annotations

import json

import pytest

from worker.engine.chat_template import ChatTemplate
from worker.engine.errors import InvalidRequestError, ModelLoadError
from worker.engine.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, ByteTokenizer, HFTokenizer, load_tokenizer

TEXT = "Grüße, 世界! 👋🏽 ok"


def stream(tok, ids):
    detok = tok.incremental_detokenizer()
    pieces = [detok.add(i) for i in ids]
    return pieces, "".join(pieces) + detok.flush()


def test_byte_tokenizer_is_one_token_per_utf8_byte_after_bos():
    tok = ByteTokenizer()
    assert tok.encode("hé") == [BYTE_BOS_ID, 104, 195, 169]
    assert tok.encode("hé", add_bos=False) == [104, 195, 169]
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (258, 256, 257)
    assert tok.decode(tok.encode(TEXT) + [BYTE_EOS_ID]) == TEXT


def test_incremental_byte_detokenizing_never_splits_a_character():
    tok = ByteTokenizer()
    pieces, text = stream(tok, tok.encode("é👋", add_bos=False))
    assert pieces == ["", "é", "", "", "", "👋"]
    assert text == "é👋"


def test_invalid_utf8_becomes_replacement_characters_at_the_end_of_the_stream():
    tok = ByteTokenizer()
    pieces, text = stream(tok, [0xF0, 0x9F])  # a truncated 4-byte character
    assert pieces == ["", ""] and text == "\ufffd"
    assert tok.decode([0xFF, 65]) == "\ufffdA"


def test_default_chat_template_renders_tools_then_every_message_then_the_generation_prompt():
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    text = tok.apply_chat_template(messages, tools=[{"name": "f"}])
    assert text == ('<|tools|>\n[{"name": "f"}]<|end|>\n<|system|>\nbe brief<|end|>\n'
                    '<|user|>\nhi there<|end|>\n<|assistant|>\n[{"id": "1"}]<|end|>\n<|assistant|>\n')
    shorter = tok.apply_chat_template(messages[:2], tools=[{"name": "f"}], add_generation_prompt=False)
    assert text.startswith(shorter)


def test_chat_template_rejects_messages_without_a_role():
    with pytest.raises(InvalidRequestError):
        ChatTemplate().render([{"content": "x"}])


def test_a_jinja_template_gets_messages_and_generation_flag():
    tpl = ChatTemplate("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                       "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert tpl.render([{"role": "user", "content": "x"}]) == "[user]x[assistant]"
    bad = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(InvalidRequestError, match="no system role"):
        bad.render([{"role": "user", "content": "x"}])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A real tokenizer.json: byte-level BPE trained here on a few sentences (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, hello prefix cache", TEXT, "the quick brown fox"] * 20, trainer)
    d = tmp_path_factory.mktemp("hf")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"}))
    return d


def test_a_tokenizer_json_checkpoint_round_trips_text_and_knows_its_special_tokens(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode()) + 1  # merges were learned


def test_incremental_hf_detokenizing_equals_full_decoding(hf_dir):
    tok = load_tokenizer(hf_dir)
    ids = tok.encode("hello " + TEXT, add_bos=False)
    pieces, text = stream(tok, ids)
    assert text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_the_checkpoint_chat_template_is_used_without_a_doubled_bos(hf_dir):
    tok = load_tokenizer(hf_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert text == "<user>hi"


def test_a_checkpoint_without_tokenizer_json_is_refused_and_only_the_built_in_models_get_the_byte_tokenizer(
        tmp_path):
    with pytest.raises(ModelLoadError, match="has no tokenizer.json: give the checkpoint's tokenizer with --tokenizer"):
        load_tokenizer(tmp_path)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_incremental_hf_detokenizing_holds_back_a_split_character_and_flushes_a_truncated_one(tmp_path):
    from worker.engine.model.byte_tokenizer_files import save_byte_tokenizer

    save_byte_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    pieces, text = stream(tok, tok.encode("é👋", add_bos=False))
    assert pieces == ["", "é", "", "", "", "👋"] and text == "é👋"
    pieces, text = stream(tok, [BYTE_BOS_ID, 0xF0, 0x9F])  # special tokens skipped, a truncated character
    assert pieces == ["", "", ""] and text == "\ufffd"


def test_tool_call_arguments_reach_the_template_as_objects_as_vllm_hands_them():
    from worker.engine.chat_template import with_tool_call_objects

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call, {**call, "function": {
        "name": "g", "arguments": "not json"}}]}]
    assert [c["function"]["arguments"] for c in with_tool_call_objects(messages)[0]["tool_calls"]] == [{"x": 1}, {}]
    assert call["function"]["arguments"] == '{"x": 1}'  # the request's own messages are left alone
    tpl = ChatTemplate("{% for m in messages %}{{ m.tool_calls[0].function.arguments | tojson }}{% endfor %}")
    assert tpl.render(messages) == '{"x": 1}'
