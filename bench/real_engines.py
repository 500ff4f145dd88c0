"""Routers side by side in front of the same two real vLLM servers (issue 11, docs/benchmarks.md).

Two vLLM 0.32 CPU servers (``.venv-vllm``; eager mode, one core each) serve the tiny preset with
prefix caching, ``--enable-prompt-tokens-details`` and ZMQ KV events. Each router in turn is
started in front of them and driven by the same multi-turn workload, with prompts of its own
(a per-router tag first, so no router profits from another's cache):

- ``groups`` system prompts, each shared by ``convs`` conversations of ``turns`` turns; a turn
  extends its conversation's previous prompt (the answer and a new question);
- ``concurrency`` conversations in flight, streaming chat completions, ``max_tokens`` 16.

Reported per router, from what vLLM itself says: hit rate = Σ ``cached_tokens`` / Σ
``prompt_tokens``, and its share of the ideal: the same workload sent straight to one server,
whose cache then holds every prefix the run saw (row ``ideal:one-server``; its TTFT is not a
bound, one server takes all the load); TTFT p50 / p90 over the router; errors. ``--rounds``
repeats the whole list (the machine is noisy: compare rounds). Run::

    .venv/bin/python -m bench.real_engines --out bench-real-engines.json

Needs ``make vllm`` and, for the peers, ``bench/peers/install.sh``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import openai

from bench.peers.launch import PeerError, start_peer, stop_peer
from bench.process_group import stop_group
from bench.vllm_server import ROOT, start_vllm
from protocol.loopback import free_port, wait_http_ok

MODEL = "tiny"


def _router(kind: str, servers, checkpoint: Path, log_dir: Path):
    if kind == IDEAL:  # no router: one server holds every prefix the run ever saw
        return None, servers[0].url
    port = free_port()
    if kind.startswith("prefixlb"):
        args = [sys.executable, "-m", "prefixlb", "router", "--port", str(port), "--health-interval", "0.5"]
        for s in servers:
            spec = s.url
            if kind == "prefixlb-precise":
                spec = f"vllm={s.url},kv-events={s.kv_endpoint},kv-replay={s.replay_endpoint}"
            args += ["--worker", spec]
        if kind == "prefixlb-precise":
            args += ["--tokenizer", f"{MODEL}={checkpoint}"]
        log = open(log_dir / f"{kind}.log", "wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    else:
        name, policy = kind.rsplit(":", 1)
        proc = start_peer(name, port, policy, [s.url for s in servers], free_port(), log_dir / f"{name}-{policy}.log")
    url = f"http://127.0.0.1:{port}"
    if not wait_http_ok(url + "/v1/models", 120, alive=lambda: proc.poll() is None):
        stop_group(proc, 5)
        raise RuntimeError(f"{kind} did not start")
    if kind.startswith("prefixlb"):  # until both servers are routable
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            import urllib.request
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if json.loads(r.read())["routable_workers"] == len(servers):
                    break
            time.sleep(0.2)
    return proc, url


def _conversation(client: openai.OpenAI, system: str, tag: str, turns: int, max_tokens: int) -> list[dict]:
    history = [{"role": "system", "content": system}]
    out = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"[{tag}] Turn {turn}: please continue the story. " * 3})
        started = time.perf_counter()
        ttft = None
        text, usage = [], None
        try:
            for chunk in client.chat.completions.create(model=MODEL, messages=history, max_tokens=max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
        except Exception as exc:  # noqa: BLE001 - counted, the run goes on
            out.append({"error": repr(exc)[:200]})
            return out
        cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
        out.append({"ttft": ttft if ttft is not None else time.perf_counter() - started,
                    "prompt_tokens": usage.prompt_tokens if usage else 0, "cached": cached or 0})
        history.append({"role": "assistant", "content": "".join(text)})
    return out


def run_one(kind: str, servers, checkpoint: Path, log_dir: Path, groups: int, convs: int, turns: int,
            concurrency: int, max_tokens: int) -> dict:
    proc, url = _router(kind, servers, checkpoint, log_dir)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        run = uuid.uuid4().hex[:8]
        jobs = []
        for g in range(groups):
            system = f"[{run} group {g}] You are a storyteller for group {g}; keep every answer short. " * 8
            for c in range(convs):
                jobs.append((system, f"{run}-{g}-{c}"))
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = [r for rs in pool.map(lambda j: _conversation(client, j[0], j[1], turns, max_tokens), jobs)
                       for r in rs]
        wall = time.perf_counter() - started
    finally:
        if proc is not None:
            stop_group(proc, 10) if kind.startswith("prefixlb") else stop_peer(proc)
    ok = [r for r in results if "error" not in r]
    ttfts = sorted(r["ttft"] for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached"] for r in ok)
    return {"router": kind, "requests": len(results), "errors": len(results) - len(ok),
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None, "wall_s": wall}


IDEAL = "ideal:one-server"
ROUTERS = (IDEAL, "prefixlb-approx", "prefixlb-precise", "sglang-router:cache_aware", "vllm-router:cache_aware",
           "vllm-router:round_robin")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_engines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", nargs="*", default=list(ROUTERS))
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--convs", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="prefixlb-real-engines-"))
    checkpoint = work / "tiny-hf"
    subprocess.run([sys.executable, "-m", "prefixlb", "model", "save", MODEL, str(checkpoint)], check=True, cwd=ROOT,
                   capture_output=True)
    servers = [start_vllm(checkpoint, f"vllm-{i}", work, MODEL, cpu=i,
                          extra_args=["--max-num-seqs", "32", "--compilation-config", '{"mode": 0}'])
               for i in range(2)]
    rows = []
    try:
        deadline = time.monotonic() + 600
        for s in servers:
            s.wait_ready(deadline)
        for kind in [k for _ in range(args.rounds) for k in args.routers]:
            try:
                row = run_one(kind, servers, checkpoint, work, args.groups, args.convs, args.turns,
                              args.concurrency, args.max_tokens)
            except (PeerError, RuntimeError) as exc:
                row = {"router": kind, "skipped": str(exc)[:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for s in servers:
            s.stop()
    ideal = statistics.mean([r["hit_rate"] for r in rows if r["router"] == IDEAL and "hit_rate" in r] or [0.0])
    print("\n| router | requests | errors | hit rate | of ideal | TTFT p50 (s) | p90 (s) | wall (s) |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['router']} | skipped: {r['skipped']} | | | | | | |")
            continue
        r["of_ideal"] = r["hit_rate"] / ideal if ideal else None
        print(f"| {r['router']} | {r['requests']} | {r['errors']} | {r['hit_rate']:.3f} | "
              f"{r['of_ideal']:.3f} | {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['wall_s']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
