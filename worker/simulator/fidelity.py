"""How faithfully does the simulated worker keep the latency model's time at a given time scale?

    python -m worker.simulator.fidelity [--scales 1,10,100,1000] [--requests 48] [--http]

For each scale it runs a fixed mixed workload (prompts of 256-4,096 tokens, 64 output tokens
each, all submitted at once) through the simulated engine and reports
``wall × scale / modelled``: 1.00 means the engine kept exactly the modelled time; above 1, host
overhead (Python per step) made the simulated GPU slower than the model says. With ``--http``
it also measures what one HTTP request costs on top of the engine, against a worker process
at an effectively infinite time scale (modelled time ~0): the floor under any simulated TTFT.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request

from protocol.loopback import free_port, wait_http_ok
from worker.engine.sampling_params import SamplingParams
from worker.simulator.runner import build_simulated_engine


def clock_fidelity(scale: float, requests: int, seed: int = 0) -> dict[str, float]:
    """Run the workload at ``scale``; return wall, modelled, the ratio and per-step overhead."""
    engine, runner = build_simulated_engine("H100-80G", "llama-3-8b", time_scale=scale, num_kv_blocks=20_000)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        n = rng.randint(256, 4096)
        engine.add_request(f"r{i}", [rng.randrange(256) for _ in range(n)], params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - start
    modelled = runner.clock.modelled_s
    return {"scale": scale, "steps": runner.steps, "modelled_s": modelled, "wall_s": wall,
            "ratio": wall * scale / modelled,
            "overhead_ms_per_step": max(0.0, wall - modelled / scale) / runner.steps * 1e3}


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


def http_overhead(port: int | None = None, n: int = 200) -> dict[str, float]:
    """Median latency of a 1-token request and per-token cost of a 256-token stream, over HTTP
    (a worker on ``port``, a free one by default)."""
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "prefixlb", "worker", "--simulate", "--time-scale", "1e6",
                             "--port", str(port), "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_http_ok(url + "/health", 30, alive=lambda: proc.poll() is None):
            raise RuntimeError(f"the simulated worker at {url} did not answer /health within 30 s")
        one, stream = [], []
        for i in range(n):
            t = time.perf_counter()
            _post(url + "/v1/completions", {"model": "llama-3-8b", "prompt": f"request {i}", "max_tokens": 1})
            one.append(time.perf_counter() - t)
        for i in range(max(5, n // 20)):
            t = time.perf_counter()
            _post(url + "/v1/completions", {"model": "llama-3-8b", "prompt": f"stream {i}", "max_tokens": 256,
                                            "ignore_eos": True, "stream": True})
            stream.append((time.perf_counter() - t) / 256)
        return {"one_token_request_ms_p50": statistics.median(one) * 1e3,
                "streamed_token_ms_p50": statistics.median(stream) * 1e3}
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    """Print one line per scale (and the HTTP floor with ``--http``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="1,10,100,1000")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--http", action="store_true")
    args = ap.parse_args(argv)
    print("scale  steps  modelled_s  wall_s  wall*scale/modelled  host_overhead_ms/step")
    for scale in (float(s) for s in args.scales.split(",")):
        r = clock_fidelity(scale, args.requests)
        print(f"{r['scale']:>5g}  {r['steps']:>5d}  {r['modelled_s']:>10.3f}  {r['wall_s']:>6.3f}  "
              f"{r['ratio']:>19.3f}  {r['overhead_ms_per_step']:>21.3f}")
    if args.http:
        print(json.dumps(http_overhead()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
