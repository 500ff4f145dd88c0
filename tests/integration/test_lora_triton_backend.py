"""The engine with LoRA adapters on the Triton LoRA kernels (under Triton's CPU interpreter) gives
the same greedy tokens as on the torch reference, and really goes through the kernels (attention
stays on torch here: tests/integration/test_engine_triton_backend.py covers its kernels).

Two adapters (different ranks and targets) and the base model prefill together (SGMV segments),
then decode together (BGMV rows); a third request for the first adapter then extends a cached
prefix. The Triton run is a fresh interpreter with TRITON_INTERPRET=1 (see
tests/integration/test_engine_triton_backend.py for why), counting the LoRA kernel calls.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.lora_support import ALL_TARGETS, write_adapter

ROOT = Path(__file__).resolve().parents[2]
PROMPT_A = list(b"The paged KV cache keeps each sequence in fixed-size blocks; a prefix hit skips")
PROMPT_B = list(b"Greedy decoding is deterministic.")
PROMPT_C = PROMPT_A + list(b" most of the prefill work.")


def greedy_run(backend: str, adapter_dirs: dict[str, str]) -> dict:
    """The scenario on the tiny preset with the adapters at ``adapter_dirs``."""
    from worker.engine.config import EngineConfig
    from worker.engine.llm_engine import LLMEngine
    from worker.engine.sampling_params import SamplingParams

    calls = {"bgmv": 0, "sgmv": 0}
    if backend == "triton":
        from kernels import triton_lora

        for name in calls:
            launcher = getattr(triton_lora, name)

            def counted(*args, _launcher=launcher, _name=name, **kwargs):
                calls[_name] += 1
                return _launcher(*args, **kwargs)

            setattr(triton_lora, name, counted)
    engine = LLMEngine(EngineConfig(model="tiny", enable_lora=True, max_loras=2))
    if backend == "triton":  # LoRA only: attention's kernels have their own engine test
        from kernels.backend import get_lora_backend

        engine.runner.lora_backend = get_lora_backend("triton", "cpu")
    x, y = (engine.add_lora(name, path) for name, path in adapter_dirs.items())
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for rid, prompt, lora in (("x", PROMPT_A, x), ("y", PROMPT_B, y), ("base", PROMPT_B, None)):
        engine.add_request(rid, prompt, params, lora=lora)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.add_request("x2", PROMPT_C, params, lora=x)
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached = out.num_cached_tokens
    return {"backend": engine.runner.lora_backend.name, "tokens": tokens, "cached": cached, "calls": calls}


def test_lora_on_the_triton_backend_under_the_interpreter_matches_torch(tmp_path):
    dirs = {"x": str(write_adapter(tmp_path / "x", rank=8, alpha=16, targets=ALL_TARGETS, seed=1)),
            "y": str(write_adapter(tmp_path / "y", rank=4, alpha=4, targets=("q_proj", "down_proj"), seed=2))}
    code = ("import json, sys; from tests.integration.test_lora_triton_backend import greedy_run;"
            f" print(json.dumps(greedy_run('triton', {dirs!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=280,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    triton_run = json.loads(result.stdout.strip().splitlines()[-1])

    torch_run = greedy_run("torch", dirs)

    assert (triton_run["backend"], torch_run["backend"]) == ("triton", "torch")
    assert triton_run["tokens"] == torch_run["tokens"]
    assert triton_run["cached"] == torch_run["cached"] == 64
    assert torch_run["tokens"]["x"] != torch_run["tokens"]["base"] or torch_run["tokens"]["y"] != torch_run["tokens"]["base"]
    # 4 layers x (qkv, o, gate_up, down) projections per step: both kernels ran in many of them.
    assert triton_run["calls"]["bgmv"] > 0 and triton_run["calls"]["sgmv"] > 0
