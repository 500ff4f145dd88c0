"""Finishing rules and streamed text: EOS, stop token ids, stop strings (held back), max_tokens."""
from __future__ import annotations

from tests.engine_support import ScriptedRunner
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.engine.tokenizer import BYTE_EOS_ID


def run(script: list[int], **params):
    engine = LLMEngine(EngineConfig(model=None, num_kv_blocks=32, block_size=4),
                       runner=ScriptedRunner({"r": script}))
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, **params))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def b(text: str) -> list[int]:
    return list(text.encode())


def test_eos_ends_with_stop_and_its_text_is_not_shown():
    outs = run(b("hi") + [BYTE_EOS_ID] + b("zz"), max_tokens=10)
    assert [o.new_text for o in outs] == ["h", "i", ""]
    assert (outs[-1].finish_reason, outs[-1].token_ids) == ("stop", b("hi") + [BYTE_EOS_ID])


def test_ignore_eos_keeps_generating_until_max_tokens():
    outs = run(b("h") + [BYTE_EOS_ID] + b("ab"), max_tokens=3, ignore_eos=True)
    assert "".join(o.new_text for o in outs) == "ha"
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 3


def test_a_stop_token_id_ends_generation_and_is_reported_as_the_stop_reason():
    outs = run(b("ab;cd"), max_tokens=10, stop_token_ids=[ord(";")])
    assert "".join(o.new_text for o in outs) == "ab"
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", ord(";"))


def test_a_stop_string_cuts_the_text_before_the_match_and_nothing_of_it_is_streamed():
    outs = run(b("one END two"), max_tokens=20, stop=["END"])
    texts = [o.new_text for o in outs]
    assert "".join(texts) == "one "
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", "END")
    assert len(outs) == 7  # stopped at the token completing "END"


def test_text_that_might_start_a_stop_string_is_held_back_until_decided():
    outs = run(b("aEbEN"), max_tokens=5, stop=["ENDX"])
    # Up to 3 characters (len("ENDX") - 1) are held back while running; all comes out at the end.
    assert [o.new_text for o in outs] == ["", "", "", "a", "EbEN"]
    assert outs[-1].finish_reason == "length"


def test_multibyte_characters_are_streamed_whole():
    outs = run(b("é!"), max_tokens=3)
    assert [o.new_text for o in outs] == ["", "é", "!"]


def test_the_earliest_of_several_stop_strings_wins():
    outs = run(b("xx<b><a>"), max_tokens=20, stop=["<a>", "<b>"])
    assert "".join(o.new_text for o in outs) == "xx" and outs[-1].stop_reason == "<b>"


def test_first_output_carries_ttft_and_later_ones_inter_token_latency():
    outs = run(b("abc"), max_tokens=3)
    assert outs[0].ttft_s is not None and outs[0].ttft_s >= 0 and outs[0].itl_s == []
    assert all(o.ttft_s is None and len(o.itl_s) == 1 and o.itl_s[0] >= 0 for o in outs[1:])
