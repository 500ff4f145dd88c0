"""The engine's CPU KV tier measured: transfer vs recompute of an N-token prefix, and the crossover.

For each prefix length N, on one engine whose GPU pool holds N + 16 tokens and whose tier twice that:

1. prompt A (N tokens) cold: its time to first token is the recompute time of its prefix;
2. prompt B (N + 15 tokens) takes the whole pool: every block of A goes down to the tier
   (``write_back``);
3. A again: all its blocks but the one holding its last token come back from the tier; the
   engine's measured load bandwidth gives the transfer time of those N - 16 tokens, its TTFT the
   whole warm request (the loads, the last block's prefill, the step's fixed costs).

The table has N, the prefix's KV bytes, recompute (cold TTFT), transfer (the loads alone), warm
TTFT, their ratio and what the tier's decision was. Any device the engine runs on (``--device
cuda`` on a GPU, with pinned host memory and a copy stream)::

    python -m bench.kv_tier --model small --tokens 1024,2048,4096 --out runs/kv-tier
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

BLOCK = 16


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + 31 * i) % 250 + 1 for i in range(n)]


def measure(model: str, tokens: int, device: str, threads: int | None) -> dict:
    """One prefix length: cold TTFT, tier transfer time, warm TTFT, and the decision."""
    if tokens % BLOCK:
        raise ValueError(f"prefix lengths must be multiples of {BLOCK}")
    blocks = tokens // BLOCK + 1
    engine = LLMEngine(EngineConfig(model=model, device=device, block_size=BLOCK, num_kv_blocks=blocks,
                                    max_num_batched_tokens=tokens + 2 * BLOCK, max_model_len=tokens + 2 * BLOCK,
                                    cpu_kv_blocks=2 * blocks, num_threads=threads))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    a, b = _prompt(tokens, 1), _prompt(tokens + BLOCK - 1, 2)  # B: every block of the pool
    engine.generate([_prompt(BLOCK, 3)], params)  # warm-up: first-call costs out of the measurements
    cold = engine.generate([a], params)[0]
    engine.generate([b], params)
    tier = engine.kv_tier
    assert tier is not None
    before = tier.stats().counters
    warm = engine.generate([a], params)[0]
    after = tier.stats()
    loaded_blocks = after.counters.loaded_blocks - before.loaded_blocks
    transfer_s = loaded_blocks * after.block_bytes / after.load_bytes_per_s if loaded_blocks else None
    return {"tokens": tokens, "kv_bytes": tokens // BLOCK * after.block_bytes,
            "recompute_s": cold.ttft_s, "transfer_s": transfer_s, "warm_ttft_s": warm.ttft_s,
            "loaded_tokens": warm.num_loaded_tokens, "decision": "load" if loaded_blocks else "recompute",
            "load_bytes_per_s": after.load_bytes_per_s, "prefill_tokens_per_s": engine.speed.prefill_tokens_per_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_tier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="preset or checkpoint directory")
    parser.add_argument("--tokens", default="1024,2048,4096", help="prefix lengths, comma-separated")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="directory for kv_tier.json")
    args = parser.parse_args(argv)
    rows = [measure(args.model, int(n), args.device, args.threads) for n in args.tokens.split(",")]
    print("| prefix tokens | KV | recompute (cold TTFT) | transfer | warm TTFT | recompute / transfer | decision |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['recompute_s'] / r['transfer_s']:.0f}x" if r["transfer_s"] else "-"
        transfer = f"{r['transfer_s'] * 1e3:.2f} ms" if r["transfer_s"] else "-"
        print(f"| {r['tokens']:,} | {r['kv_bytes'] / 2**20:.1f} MiB | {r['recompute_s'] * 1e3:.0f} ms | {transfer} "
              f"| {r['warm_ttft_s'] * 1e3:.0f} ms | {ratio} | {r['decision']} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kv_tier.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
