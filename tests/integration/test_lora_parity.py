"""Multi-LoRA parity: the engine with adapters agrees with transformers + PEFT on the same files.

The tiny preset is saved in Hugging Face format; peft builds two real adapters on it with
``init_lora_weights=False`` (A and B both random: PEFT's default B = 0 would be a no-op):

- ``A``: rank 8, alpha 16, all seven projections (so the fused q/k/v and gate/up slices matter);
- ``B``: rank 4, alpha 8, rsLoRA, only q/v/down (a smaller rank padded in the slot stacks, and
  projections one adapter of the batch adapts and the other does not).

References are PeftModel over transformers' LlamaForCausalLM, teacher-forced on prompt + the
engine's tokens; positions are compared as in the base-model parity test (tests/parity_support.py).
Every batch is the mix [base, A, B, A] in one step, cold and with prefix hits, and each request
is also run alone: tokens identical, logprobs within fp32 noise.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.lora_support import ALL_TARGETS, make_peft_adapter
from tests.parity_support import ParityLog, assert_matches_reference
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

VOCAB = 258
PARITY = ParityLog()
TEXT = "The router keeps a map of which worker holds which prefix. " * 3
MIX = ("base", "A", "B", "A")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "A": make_peft_adapter(tiny_checkpoint, root / "A", rank=8, alpha=16, targets=ALL_TARGETS, seed=1),
        "B": make_peft_adapter(tiny_checkpoint, root / "B", rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"),
                               seed=2, use_rslora=True),
    }


@pytest.fixture(scope="module")
def references(tiny_checkpoint, adapter_dirs):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    def base():
        return LlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()

    refs = {"base": base()}
    with warnings.catch_warnings():  # peft calls a transformers API deprecated for v6
        warnings.simplefilter("ignore", FutureWarning)
        for name, path in adapter_dirs.items():
            refs[name] = PeftModel.from_pretrained(base(), str(path)).eval()
    return refs


def make_engine(tiny_checkpoint, adapter_dirs, **kw):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint), enable_lora=True, max_loras=2, **kw),
                       served_model_names=["tiny"])
    loras = {name: engine.add_lora(name, str(path)) for name, path in adapter_dirs.items()}
    loras["base"] = None
    return engine, loras


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=VOCAB)


def run(engine, requests: dict[str, tuple[list[int], object]], n: int, one_step: bool = False):
    for rid, (prompt, lora) in requests.items():
        engine.add_request(rid, prompt, params(n), lora=lora)
    outs: dict[str, list] = {rid: [] for rid in requests}
    first = True
    while engine.has_unfinished_requests():
        step = engine.step()
        if first and one_step:  # the whole mix prefilled in the one first step
            assert {o.request_id for o in step} == set(requests)
        first = False
        for out in step:
            outs[out.request_id].append(out)
    return outs


def mix_requests(engine, loras, suffix: str):
    texts = [TEXT + suffix, TEXT + suffix, TEXT + "B asks " + suffix, TEXT + "the second A " + suffix]
    return {f"{kind}-{i}": (engine.tokenizer.encode(t), loras[kind]) for i, (kind, t) in enumerate(zip(MIX, texts))}


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_same_as_alone(mixed_outs, alone_outs):
    assert tokens_of(mixed_outs) == tokens_of(alone_outs)
    mixed = [lp for o in mixed_outs for lp in o.logprobs]
    alone = [lp for o in alone_outs for lp in o.logprobs]
    for m, a in zip(mixed, alone):
        assert dict(m.top).keys() == dict(a.top).keys()
        assert max(abs(v - dict(a.top)[t]) for t, v in m.top) < 1e-4


def test_a_mixed_batch_matches_peft_cold_and_with_prefix_hits_and_each_request_alone(
        tiny_checkpoint, adapter_dirs, references):
    engine, loras = make_engine(tiny_checkpoint, adapter_dirs)
    cold_requests = mix_requests(engine, loras, "Question one?")
    cold = run(engine, cold_requests, 16, one_step=True)
    warm_requests = mix_requests(engine, loras, "A different question entirely.")
    warm = run(engine, warm_requests, 16, one_step=True)

    for requests, outs in ((cold_requests, cold), (warm_requests, warm)):
        for rid, (prompt, _) in requests.items():
            kind = rid.split("-")[0]
            assert_matches_reference(references[kind], prompt, outs[rid], PARITY, VOCAB)
    # Cold: nothing cached, and base and the first A share a prompt but never a block.
    assert [cold[rid][-1].num_cached_tokens for rid in cold_requests] == [0, 0, 0, 0]
    # Warm: every request reuses the blocks of its own adapter's cold request only: the second A
    # request's prompt starts like the first A's (TEXT), so it hits A's blocks, not base's.
    shared = (len(engine.tokenizer.encode(TEXT)) - 1) // 16 * 16
    assert [warm[rid][-1].num_cached_tokens for rid in warm_requests] == [shared] * 4
    # The adapters change the model (else this test would prove nothing).
    assert tokens_of(cold["base-0"]) != tokens_of(cold["A-1"]) != tokens_of(cold["B-2"])

    for rid, (prompt, lora) in cold_requests.items():
        alone_engine, alone_loras = make_engine(tiny_checkpoint, adapter_dirs)
        alone = run(alone_engine, {rid: (prompt, alone_loras[rid.split("-")[0]])}, 16)
        assert_same_as_alone(cold[rid], alone[rid])


def test_adapters_joining_a_running_batch_mix_decode_and_prefill_rows_and_still_match(
        tiny_checkpoint, adapter_dirs, references):
    # A and B decode (BGMV rows) while base and a second A request prefill (SGMV segments).
    engine, loras = make_engine(tiny_checkpoint, adapter_dirs)
    requests = mix_requests(engine, loras, "Staggered?")
    early = {rid: requests[rid] for rid in ("A-1", "B-2")}
    late = {rid: requests[rid] for rid in ("base-0", "A-3")}
    for rid, (prompt, lora) in early.items():
        engine.add_request(rid, prompt, params(20), lora=lora)
    outs: dict[str, list] = {rid: [] for rid in requests}
    for _ in range(4):
        for out in engine.step():
            outs[out.request_id].append(out)
    for rid, (prompt, lora) in late.items():
        engine.add_request(rid, prompt, params(12), lora=lora)
    batches = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch: batches.append(batch) or execute(batch)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)

    for rid, (prompt, _) in requests.items():
        assert_matches_reference(references[rid.split("-")[0]], prompt, outs[rid], PARITY, VOCAB)
    assert outs["A-3"][-1].num_cached_tokens > 0  # it reuses the first A request's prefix
    first = batches[0]
    assert sorted((s.request_id, s.is_prefill) for s in first.seqs) == [
        ("A-1", False), ("A-3", True), ("B-2", False), ("base-0", True)]
    assert {s.lora_slot for s in first.seqs} == {0, 1, 2}


def test_a_name_reloaded_with_other_weights_computes_with_them_and_reuses_no_stale_block(
        tiny_checkpoint, adapter_dirs, references):
    engine, loras = make_engine(tiny_checkpoint, adapter_dirs)
    prompt = engine.tokenizer.encode(TEXT + "Reload?")
    first = run(engine, {"a1": (prompt, loras["A"])}, 12)["a1"]
    reloaded = engine.add_lora("A", str(adapter_dirs["B"]), replace=True)  # A's name, B's weights
    second = run(engine, {"a2": (prompt, reloaded)}, 12)["a2"]

    assert second[-1].num_cached_tokens == 0
    assert_matches_reference(references["B"], prompt, second, PARITY, VOCAB)
    assert tokens_of(second) != tokens_of(first)


def test_near_ties_are_rare():
    if PARITY.positions < 150:
        pytest.skip("counts near-ties over the whole module; run the module, not this test alone")
    assert len(PARITY.near_ties) <= 3, PARITY.near_ties
