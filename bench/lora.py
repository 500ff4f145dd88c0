"""What serving many LoRA adapters in one batch costs the engine, against the same batch on the base model.

    python -m bench.lora                       # small model, batch 16, 4 adapters of rank 16 on all projections
    python -m bench.lora --batch 32 --adapters 8 --max-loras 8 --rank 16 --threads 2 --json runs/lora.json

One engine (LoRA on, ``--max-loras`` slots) serves rounds of ``--batch`` requests of
``--prompt-tokens`` random tokens and ``--output-tokens`` greedy tokens (EOS ignored), all
admitted at once: the first step prefills the whole batch, every later step is a pure decode step
of the whole batch (until the requests finish together). Two kinds of round alternate on the same
prompts (fresh ones each round, so nothing is ever a cache hit):

- *base*: every request on the base model;
- *mixed*: request ``i`` on adapter ``i mod --adapters`` (so each step holds ``--adapters``
  distinct adapters when they fit the slots), never merged: the base matmuls run once for the
  batch and each token adds its adapter's delta (the torch BGMV/SGMV references on CPU).

A warm-up round of each kind comes first (first-call allocations, and the mixed kind's slot
loads). Reported per kind, medians over rounds, in wall and process CPU time (the steadier figure
on a shared machine): the prefill step, the mean decode step, output tokens/s; and the ratios
mixed / base. Adapters are random PEFT directories written for the model's shapes (A and B both
non-zero: a zero B would cost the same and prove nothing about correctness elsewhere).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from worker.engine.config import EngineConfig, ModelConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.lora.adapter import TARGET_PARENTS, target_features
from worker.engine.sampling_params import SamplingParams

ALL_TARGETS = tuple(TARGET_PARENTS)


def peft_key(layer: int, module: str, ab: str) -> str:
    """PEFT's tensor name of one LoRA matrix."""
    return f"base_model.model.model.layers.{layer}.{TARGET_PARENTS[module]}.{module}.lora_{ab}.weight"


def random_adapter_tensors(model: ModelConfig, rank: int, targets: Iterable[str], seed: int,
                           layers: Iterable[int] | None = None) -> dict:
    """Random non-zero A [r, in] and B [out, r] for ``targets`` of ``model``, in PEFT's names."""
    import torch

    features = target_features(model)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in (range(model.num_hidden_layers) if layers is None else layers):
        for module in targets:
            in_f, out_f = features[module]
            out[peft_key(layer, module, "A")] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
            out[peft_key(layer, module, "B")] = torch.randn(out_f, rank, generator=gen) / rank**0.5
    return out


def save_peft_adapter(path: Path, tensors: dict, rank: int, alpha: float, targets: Iterable[str],
                      base_model: str, config: dict[str, Any] | None = None) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT saves them."""
    from safetensors.torch import save_file

    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
           "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
           "rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False, "lora_dropout": 0.0,
           "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, **(config or {})}
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path


def _round(engine: LLMEngine, prompts: list[list[int]], loras: list, n_out: int) -> dict[str, float]:
    """One batch: (prefill step, mean decode step) in wall and CPU seconds, tokens/s."""
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, params, lora=lora)
    steps: list[tuple[float, float]] = []
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        steps.append((time.perf_counter() - w, time.process_time() - c))
    wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    decode = steps[1:]
    return {"prefill_wall_s": steps[0][0], "prefill_cpu_s": steps[0][1],
            "decode_step_wall_s": statistics.fmean(s[0] for s in decode),
            "decode_step_cpu_s": statistics.fmean(s[1] for s in decode),
            "tokens_per_s_wall": len(prompts) * n_out / wall, "tokens_per_s_cpu": len(prompts) * n_out / cpu,
            "steps": len(steps)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark of the module docstring; a JSON-friendly result."""
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads, enable_lora=True,
                                    max_loras=args.max_loras, max_lora_rank=args.rank,
                                    max_num_seqs=max(32, args.batch),
                                    max_num_batched_tokens=max(2048, args.batch * args.prompt_tokens)))
    assert engine.model_config is not None
    targets = ALL_TARGETS if args.targets == "all" else tuple(args.targets.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(args.adapters):
            tensors = random_adapter_tensors(engine.model_config, args.rank, targets, seed=i)
            path = save_peft_adapter(Path(tmp) / f"ad{i}", tensors, args.rank, 2.0 * args.rank, targets, args.model)
            adapters.append(engine.add_lora(f"ad{i}", str(path)))
    rng = random.Random(1)
    kinds = {"base": [None] * args.batch, "mixed": [adapters[i % len(adapters)] for i in range(args.batch)]}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for r in range(args.rounds + 1):
        order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
        for kind in order:
            prompts = [[rng.randrange(32, 127) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
            res = _round(engine, prompts, kinds[kind], args.output_tokens)
            if r > 0:  # round 0 warms up
                results[kind].append(res)
    medians = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in results.items()}
    ratios = {m: medians["mixed"][m] / medians["base"][m] for m in medians["base"] if m != "steps"}
    lora = engine.stats().lora
    assert lora is not None
    return {"model": args.model, "batch": args.batch, "adapters": args.adapters, "max_loras": args.max_loras,
            "rank": args.rank, "targets": list(targets), "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens, "rounds": args.rounds, "threads": args.threads,
            "adapter_params": adapters[0].num_params, "slot_load_s": lora.slot_load_s,
            "disk_load_s": lora.disk_load_s, "median": medians, "mixed_over_base": ratios}


def report(result: dict[str, Any]) -> str:
    """The result as the table docs/benchmarks.md shows."""
    m, r = result["median"], result["mixed_over_base"]
    lines = [f"{result['model']}: batch {result['batch']}, {result['adapters']} adapters of rank {result['rank']} "
             f"on {','.join(result['targets'])} ({result['adapter_params']:,} params each), "
             f"{result['prompt_tokens']} + {result['output_tokens']} tokens, median of {result['rounds']} rounds",
             "| | base | mixed adapters | mixed / base |", "|---|---|---|---|"]
    for key, label, scale, unit in (("prefill_wall_s", "prefill step, wall", 1e3, "ms"),
                                    ("prefill_cpu_s", "prefill step, CPU", 1e3, "ms"),
                                    ("decode_step_wall_s", "decode step, wall", 1e3, "ms"),
                                    ("decode_step_cpu_s", "decode step, CPU", 1e3, "ms"),
                                    ("tokens_per_s_wall", "output tokens/s, wall", 1, ""),
                                    ("tokens_per_s_cpu", "output tokens/s, CPU", 1, "")):
        lines.append(f"| {label} | {m['base'][key] * scale:.1f}{unit} | {m['mixed'][key] * scale:.1f}{unit} "
                     f"| {r[key]:.3f} |")
    extra_ms = (m["mixed"]["decode_step_wall_s"] - m["base"]["decode_step_wall_s"]) * 1e3
    lines.append(f"decode: +{extra_ms:.2f} ms per step (wall) for {result['batch']} tokens of "
                 f"{min(result['adapters'], result['batch'])} distinct adapters; slot load "
                 f"{result['slot_load_s'] * 1e3:.2f} ms, disk load {result['disk_load_s'] * 1e3:.1f} ms per adapter")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="all", help="all, or a comma-separated list like q_proj,v_proj")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.adapters > args.max_loras:
        print("note: more adapters than slots: steps hold at most --max-loras of them", file=sys.stderr)
    result = run(args)
    print(report(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
