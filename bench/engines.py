"""prefixlb's engine against vLLM on the very same checkpoint, in the same run (issue 11, item 5).

    python -m bench.engines [--rounds 5] [--model small] [--json FILE] [--profile DIR]

The ``small`` preset is saved with ``prefixlb model save small DIR`` and served by three
servers at once: vLLM 0.32 (``.venv-vllm``, its CPU backend: one compute thread, its own
kernels) and prefixlb's worker twice, with torch's default threads and with ``--threads 1``.
vLLM binds its compute thread to a core; the ``--threads 1`` worker is pinned to the same core
(``--core``, default 1), so that on a shared machine both compete for the very same CPU (an
unpinned process loses more time to other work than a pinned one, which the scheduler's load
balancing keeps off "its" core). Each round sends every server, one after the other in a
rotating order (only one is busy at a time), 16 concurrent requests of 128 prompt tokens (BOS + 127 bytes, a first block no other
request shares, so nothing is a cache hit) and 64 output tokens, greedy, EOS ignored. Per
server and round: output tokens / wall time, and output tokens / CPU seconds of the server's
whole process group (the steadier number on a shared machine: waiting for a core does not
count). Printed: medians, and each prefixlb variant's ratio to vLLM (median over rounds of the
per-round ratio).

``--profile DIR`` runs one more round per prefixlb variant under ``py-spy record`` (install
py-spy into .venv first) and writes the flame-graph input (``*.folded``) and a top-20 of
self time per variant.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.process_group import group_cpu_by_process, stop_group
from bench.stats import rotated
from bench.vllm_server import ROOT, VLLM_PYTHON, start_vllm, wait_healthy
from protocol.loopback import free_port

MODEL = "small"
CONCURRENCY = 16
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64


@dataclass
class Target:
    """A server under test: its URL and process group."""

    name: str
    url: str
    popen: subprocess.Popen
    log: Path
    results: list[dict] = field(default_factory=list)


def prompts(round_no: int, target: str) -> list[str]:
    """16 prompts of 127 bytes (+ BOS = 128 tokens) whose first block no other request shares."""
    out = []
    for i in range(CONCURRENCY):
        head = f"[{target} r{round_no} #{i}] "
        out.append((head + "The quick brown fox jumps over the lazy dog. " * 4)[:PROMPT_TOKENS - 1])
    return out


async def _one(session: aiohttp.ClientSession, url: str, prompt: str) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {data}")
        usage = data["usage"]
        if usage["prompt_tokens"] != PROMPT_TOKENS:
            raise RuntimeError(f"{url}: {usage['prompt_tokens']} prompt tokens, expected {PROMPT_TOKENS}")
        return int(usage["completion_tokens"])


async def run_round(target: Target, round_no: int) -> dict:
    """16 concurrent requests; output tokens per wall second and per CPU second of the server."""
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        cpu0, t0 = group_cpu_by_process(target.popen.pid), time.perf_counter()
        counts = await asyncio.gather(*(_one(session, target.url, p) for p in prompts(round_no, target.name)))
        wall, cpu1 = time.perf_counter() - t0, group_cpu_by_process(target.popen.pid)
    per_process = {name: cpu1[name] - cpu0.get(name, 0.0) for name in cpu1}
    cpu = sum(per_process.values())
    tokens = sum(counts)
    if tokens != CONCURRENCY * OUTPUT_TOKENS:
        raise RuntimeError(f"{target.name}: {tokens} output tokens, expected {CONCURRENCY * OUTPUT_TOKENS}")
    return {"round": round_no, "wall_s": wall, "cpu_s": cpu, "cpu_s_by_process": per_process,
            "tok_per_s": tokens / wall, "tok_per_cpu_s": tokens / cpu if cpu > 0 else 0.0}


def start_worker(checkpoint: Path, name: str, log_dir: Path, threads: int | None, core: int | None = None) -> Target:
    """prefixlb's worker on ``checkpoint`` (pinned to ``core`` when given)."""
    port = free_port()
    args = [sys.executable, "-m", "prefixlb", "worker", "--model", str(checkpoint), "--served-model-name",
            MODEL, "--port", str(port)] + (["--threads", str(threads)] if threads else [])
    log = log_dir / f"{name}.log"
    pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
    with open(log, "wb") as fh:
        popen = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                 preexec_fn=pin)
    return Target(name, f"http://127.0.0.1:{port}", popen, log)


PY_SPY_RATE = 200


def profile_round(target: Target, round_no: int, out_dir: Path) -> dict:
    """One round under py-spy: the top-20 self-time functions, and how much of the round's wall
    time py-spy saw the engine thread busy (py-spy counts a thread idle only while it sleeps:
    waiting for a core counts as busy)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    folded = out_dir / f"{target.name}.folded"
    spy = subprocess.Popen([py_spy, "record", "--format", "raw", "--output", str(folded), "--rate", str(PY_SPY_RATE),
                            "--pid", str(target.popen.pid), "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaching; the round below is what it samples
    result = asyncio.run(run_round(target, round_no))
    spy.send_signal(2)
    spy.wait(60)
    self_time: Counter = Counter()
    total = engine = 0
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        self_time[stack.split(";")[-1]] += int(count)
        total += int(count)
        if "AsyncLLMEngine._run " in stack:
            engine += int(count)
    return {"wall_s": result["wall_s"], "cpu_s": result["cpu_s"],
            "engine_thread_busy_s": engine / PY_SPY_RATE,
            "top": [(frame, n / total) for frame, n in self_time.most_common(20)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=MODEL, help="preset to save and serve (default: small)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy the prefixlb workers into DIR")
    parser.add_argument("--core", type=int, default=1, help="the core vLLM and the --threads 1 worker run on")
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        print(f"bench.engines: {VLLM_PYTHON} missing: run `make vllm`", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="prefixlb-engines-"))
    checkpoint = work / args.model
    subprocess.run([sys.executable, "-m", "prefixlb", "model", "save", args.model, str(checkpoint)],
                   cwd=ROOT, check=True, capture_output=True)
    targets: list[Target] = []
    try:
        vllm = start_vllm(checkpoint, "vllm", work, MODEL, cpu=args.core, kv_events=False)
        targets.append(Target("vllm", vllm.url, vllm.popen, vllm.log))
        targets.append(start_worker(checkpoint, "prefixlb", work, threads=None))
        targets.append(start_worker(checkpoint, "prefixlb-t1", work, threads=1, core=args.core))
        deadline = time.monotonic() + 900
        for t in targets:
            wait_healthy(t.url, t.popen, deadline, t.name, t.log)
        for t in targets:  # warm-up: first-request compilation and allocation out of the measurement
            asyncio.run(run_round(t, -1))
        for r in range(args.rounds):
            order = rotated(targets, r)
            for t in order:
                t.results.append(asyncio.run(run_round(t, r)))
                print(f"round {r} {t.name:12s} {t.results[-1]['tok_per_s']:7.1f} tok/s "
                      f"{t.results[-1]['tok_per_cpu_s']:7.1f} tok/cpu-s", flush=True)
        summary = summarize(targets)
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            summary["profile"] = {t.name: profile_round(t, 1000, args.profile) for t in targets[1:]}
        print_summary(summary)
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        return 0
    finally:
        for t in targets:
            stop_group(t.popen)
        shutil.rmtree(work, ignore_errors=True)


def summarize(targets: list[Target]) -> dict:
    """Medians per server, and each prefixlb variant's per-round ratio to vLLM (median)."""
    base = targets[0]
    out: dict = {"config": {"concurrency": CONCURRENCY, "prompt_tokens": PROMPT_TOKENS,
                            "output_tokens": OUTPUT_TOKENS, "rounds": len(base.results)}, "servers": {}}
    for t in targets:
        entry = {k: statistics.median(r[k] for r in t.results) for k in ("tok_per_s", "tok_per_cpu_s")}
        if t is not base:
            entry["ratio_to_vllm"] = statistics.median(
                r["tok_per_s"] / b["tok_per_s"] for r, b in zip(t.results, base.results))
            entry["cpu_ratio_to_vllm"] = statistics.median(
                r["tok_per_cpu_s"] / b["tok_per_cpu_s"] for r, b in zip(t.results, base.results))
        names = {n for r in t.results for n in r["cpu_s_by_process"]}
        entry["cpu_share_by_process"] = {n: statistics.median(r["cpu_s_by_process"].get(n, 0.0) / r["cpu_s"]
                                                              for r in t.results if r["cpu_s"] > 0) for n in names}
        entry["rounds"] = t.results
        out["servers"][t.name] = entry
    return out


def print_summary(summary: dict) -> None:
    print(f"\n{'server':14s} {'tok/s':>8s} {'tok/cpu-s':>10s} {'x vLLM (wall)':>14s} {'x vLLM (cpu)':>13s}")
    for name, e in summary["servers"].items():
        print(f"{name:14s} {e['tok_per_s']:8.1f} {e['tok_per_cpu_s']:10.1f} "
              f"{e.get('ratio_to_vllm', 1.0):14.2f} {e.get('cpu_ratio_to_vllm', 1.0):13.2f}")
    for name, e in summary["servers"].items():
        shares = ", ".join(f"{n} {v * 100:.0f}%" for n, v in sorted(e["cpu_share_by_process"].items(),
                                                                 key=lambda kv: -kv[1]))
        print(f"CPU time of {name} by process: {shares}")
    for name, prof in summary.get("profile", {}).items():
        print(f"\npy-spy, {name}: round {prof['wall_s']:.1f} s wall, {prof['cpu_s']:.1f} s CPU, engine thread "
              f"busy {prof['engine_thread_busy_s']:.1f} s; share of the busy samples (self time):")
        for frame, share in prof["top"]:
            print(f"  {share * 100:5.1f}%  {frame}")


if __name__ == "__main__":
    raise SystemExit(main())
