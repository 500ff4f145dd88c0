"""The engine end to end with the Triton attention backend (under Triton's CPU interpreter) gives
the same greedy tokens and the same prefix-cache hits as with the torch reference backend.

The scenario covers all three attention ops as the engine uses them: two prompts of different
lengths prefilled together (extend without a prefix, two sequences), decoded together (paged
decode over ragged contexts), then a third prompt that extends the first one's prompt (a prefix-
cache hit: extend over cached blocks). The Triton run happens in a fresh interpreter with
TRITON_INTERPRET=1 (the switch must precede the kernels' definition; see
tests/unit/test_kernels_triton.py), which also counts the Triton kernel calls to prove the engine
went through them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT_A = list(b"The paged KV cache keeps each sequence in fixed-size blocks; a prefix hit skips")
PROMPT_B = list(b"Greedy decoding is deterministic.")
PROMPT_C = PROMPT_A + list(b" most of the prefill work.")
MAX_TOKENS = 6


def greedy_run(attention_backend: str) -> dict:
    """Run the scenario on the tiny preset; tokens and cached-token counts per prompt."""
    from kernels import triton_decode, triton_extend, triton_kv_write  # noqa: F401 (counted below)
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    calls = {"write_kv": 0, "decode": 0, "extend": 0}
    if attention_backend == "triton":
        _count_calls(calls)
    engine = LLMEngine(EngineConfig(model="tiny", attention_backend=attention_backend, block_size=16))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = engine.generate([PROMPT_A, PROMPT_B], params)
    [third] = engine.generate([PROMPT_C], params)
    outputs = [*first, third]
    return {
        "backend": engine.runner.backend.name,
        "tokens": [out.token_ids for out in outputs],
        "cached": [out.num_cached_tokens for out in outputs],
        "calls": calls,
    }


def _count_calls(calls: dict) -> None:
    """Wrap the Triton launchers before the engine picks them up, counting each call."""
    from kernels import triton_decode, triton_extend, triton_kv_write

    for module, name, key in (
        (triton_kv_write, "write_kv", "write_kv"),
        (triton_decode, "paged_decode_attention", "decode"),
        (triton_extend, "prefix_extend_attention", "extend"),
    ):
        launcher = getattr(module, name)

        def counted(*args, _launcher=launcher, _key=key, **kwargs):
            calls[_key] += 1
            return _launcher(*args, **kwargs)

        setattr(module, name, counted)


def test_triton_backend_under_the_interpreter_matches_torch_greedy_tokens_and_cache_hits():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = (
        "import json; from tests.integration.test_engine_triton_backend import greedy_run;"
        " print(json.dumps(greedy_run('triton')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    triton_run = json.loads(result.stdout.strip().splitlines()[-1])

    torch_run = greedy_run("torch")

    assert (torch_run["backend"], triton_run["backend"]) == ("torch", "triton")
    assert triton_run["tokens"] == torch_run["tokens"]
    assert [len(t) for t in triton_run["tokens"]] == [MAX_TOKENS] * 3
    # Prompt C re-reads prompt A's full blocks: A is 79 token ids (bytes, no BOS added to given
    # ids) -> 4 full blocks of 16 = 64 cached tokens; C's other 41 tokens are extended on them.
    assert len(PROMPT_A) == 79
    assert triton_run["cached"] == torch_run["cached"] == [0, 0, 64]
    assert all(n > 0 for n in triton_run["calls"].values()), triton_run["calls"]
