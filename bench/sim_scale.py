"""How fast the fleet simulator runs: wall seconds for W workers × N requests (target 1,000 × 1,000,000 < 60 s).

    .venv/bin/python -m bench.sim_scale --workers 1000 --requests 1000000 [--profile]

The workload is ``system-prompt`` with 5 tenants per worker (2,048-token system prompts,
Zipf popularity) arriving at 3 requests/s per worker, so the fleet is loaded like a production
one (busy ~40%, most requests hitting their tenant's prompt). Workload generation and the
simulation are timed separately, in wall and CPU seconds (the machine is shared: CPU time is the
stable measure). ``--profile`` prints the top functions (cProfile, ~2× slower); ``--breakdown``
prints the CPU time of the router's and the replicas' entry points (a timer around each call,
~0.5 µs per call added, and a nested timer's cost counts in its caller's time too);
``--replay N`` times the run's last ``N`` decisions again after it, ``Balancer.decide`` alone and
uninstrumented, against the fleet as the run left it, and its candidate set and policy choice each
alone (``hotloop``: with ``PREFIXLB_PURE_PYTHON=1`` both run their Python loops, the baseline of
the compiled ones).
"""
from __future__ import annotations

import argparse
import cProfile
import contextlib
import gc
import importlib
import io
import pstats
import time
from collections import deque
from typing import Iterator

from bench.sim.fleet import FleetConfig, simulate
from bench.sim.router import SimRouterConfig
from bench.stats import summarize
from bench.workloads import load_workload
from router.routing.balancer import Balancer, _DepthLookup
from router.routing.policies import get_policy
from router.routing.policy import RouteRequest


# (label, module, attribute path): what --breakdown times, nested calls indented under their callers.
BREAKDOWN = (
    ("router: Balancer.decide", "router.routing.balancer", "Balancer.decide"),
    ("  index.match_top", "router.routing.index", "PrefixIndex.match_top"),
    ("  candidate set (ids + per-candidate load)", "router.routing.balancer", "Balancer.candidate_set"),
    ("    candidate ids (ring successors, least loaded)", "router.routing.balancer", "Balancer.candidate_ids"),
    ("      ring.successors", "router.routing.ring", "WorkerRing.successors"),
    ("      board.least_loaded", "router.routing.load", "LoadBoard.least_loaded"),
    ("  policy (choose)", "router.routing.policies.cache_aware", "CacheAware.choose"),
    ("router: Balancer.dispatch", "router.routing.balancer", "Balancer.dispatch"),
    ("router: Balancer.first_byte", "router.routing.balancer", "Balancer.first_byte"),
    ("router: Balancer.finish", "router.routing.balancer", "Balancer.finish"),
    ("router: Balancer.apply_kv_event", "router.routing.balancer", "Balancer.apply_kv_event"),
    ("router: Balancer.apply_report", "router.routing.balancer", "Balancer.apply_report"),
    ("sim: SimRouter.prompt_key", "bench.sim.router", "SimRouter.prompt_key"),
    ("sim: replica add", "bench.sim.worker", "SimWorker.add"),
    ("sim: replica on_event (step / decode run)", "bench.sim.aggregate", "AggregateWorker.on_event"),
    ("sim: unit hashes", "bench.sim.prompt_hashes", "UnitHasher.__call__"),
)


@contextlib.contextmanager
def cpu_breakdown(targets=BREAKDOWN) -> Iterator[dict[str, list[float]]]:
    """Wrap each target with a CPU-time accumulator; yields ``{label: [seconds, calls]}``."""
    acc: dict[str, list[float]] = {}
    restore = []
    clock = time.process_time
    for label, module, path in targets:
        owner = importlib.import_module(module)
        *parents, name = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        original = owner.__dict__[name]
        slot = acc.setdefault(label, [0.0, 0])

        def timed(*args, _f=original, _slot=slot, **kwargs):
            t = clock()
            try:
                return _f(*args, **kwargs)
            finally:
                _slot[0] += clock() - t
                _slot[1] += 1
        setattr(owner, name, timed)
        restore.append((owner, name, original))
    try:
        yield acc
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)


@contextlib.contextmanager
def recorded_decisions(last: int) -> Iterator[deque]:
    """Record the arguments of the last ``last`` ``Balancer.decide`` calls (none if ``last`` is 0)."""
    calls: deque = deque(maxlen=last)
    if last <= 0:
        yield calls
        return
    original = Balancer.__dict__["decide"]

    def recording(self, prompt, now, *args, **kwargs):
        calls.append((self, prompt, now, args, kwargs))
        return original(self, prompt, now, *args, **kwargs)
    Balancer.decide = recording  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        Balancer.decide = original  # type: ignore[method-assign]


def replay_us(calls: deque, rounds: int = 5) -> float:
    """CPU µs per decision of ``calls`` decided again at the last one's time (best of ``rounds``).

    ``decide`` changes no routing state (only the request counter that ``round_robin`` reads).
    """
    now = calls[-1][2]
    best = float("inf")
    for _ in range(rounds):
        gc.disable()
        t = time.process_time()
        for balancer, prompt, _, args, kwargs in calls:
            balancer.decide(prompt, now, *args, **kwargs)
        best = min(best, time.process_time() - t)
        gc.enable()
    return best / len(calls) * 1e6


def replay_parts_us(calls: deque, rounds: int = 5) -> dict[str, float]:
    """CPU µs per call of a decision's two parts, on ``calls`` at the last one's time (best of
    ``rounds``): ``candidate set`` (``Balancer.candidate_set``: ids, then each worker's record)
    and ``choose`` (the policy's choice among them), each timed alone on inputs prepared first."""
    now = calls[-1][2]
    prepared = []
    for balancer, prompt, _, args, kwargs in calls:
        cfg = balancer.config
        matches, complete = balancer.index.match_top(prompt.hashes, now, cfg.match_candidates)
        if not complete:
            matches = _DepthLookup(matches, balancer.index, prompt.hashes, now)
        policy = get_policy(cfg.policy)
        request = RouteRequest(prompt_tokens=balancer.estimate_tokens(prompt), affinity=kwargs.get("affinity"))
        candidates = policy.candidates(balancer, request, prompt, matches, now, frozenset(), cfg)
        prepared.append((balancer, prompt, matches, request, candidates, policy, cfg))
    best = {"candidate set": float("inf"), "choose": float("inf")}
    for _ in range(rounds):
        gc.disable()
        t = time.process_time()
        for balancer, prompt, matches, request, _, _, cfg in prepared:
            balancer.candidate_set(prompt, matches, request.prompt_tokens, now, frozenset(), cfg)
        best["candidate set"] = min(best["candidate set"], time.process_time() - t)
        t = time.process_time()
        for _, _, _, request, candidates, policy, cfg in prepared:
            policy.choose(request, candidates, cfg)
        best["choose"] = min(best["choose"], time.process_time() - t)
        gc.enable()
    return {part: seconds / len(prepared) * 1e6 for part, seconds in best.items()}


def main(argv: list[str] | None = None) -> int:
    """Run one scale measurement and print it."""
    p = argparse.ArgumentParser(prog="python -m bench.sim_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--unit", type=int, default=512, help="simulator block in tokens")
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--reference", action="store_true",
                   help="step with the reference worker (every running request every step), not the aggregate one")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="CPU time per router / replica entry point")
    p.add_argument("--replay", type=int, default=0, metavar="N",
                   help="after the run, time its last N decisions again (decide alone, uninstrumented)")
    args = p.parse_args(argv)
    w = args.workers
    t0 = time.perf_counter()
    workload = load_workload("system-prompt", 0, args.requests, {
        "rate": str(3.0 * w), "tenants": str(5 * w), "system_tokens": "2048", "output_tokens": "32-128"})
    t1 = time.perf_counter()
    cfg = FleetConfig(workers=w, unit=args.unit, router=SimRouterConfig(policy=args.policy),
                      aggregate=not args.reference)
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    with (cpu_breakdown() if args.breakdown else contextlib.nullcontext({}) as breakdown,
          recorded_decisions(args.replay) as decisions):
        cpu = time.process_time()
        result = simulate(workload, cfg)
        cpu = time.process_time() - cpu
    if prof:
        prof.disable()
    t2 = time.perf_counter()
    s = summarize(result.records)
    print(f"workers={w} requests={args.requests} unit={args.unit} policy={args.policy} "
          f"worker={'reference' if args.reference else 'aggregate'}")
    print(f"workload generation {t1 - t0:.1f} s; simulation {t2 - t1:.1f} s wall, {cpu:.1f} s CPU "
          f"({(t2 - t1) / args.requests * 1e6:.0f} us/request wall); virtual span "
          f"{workload.requests[-1].arrival_s:.0f} s; busy {result.meta['mean_utilisation']:.0%}; "
          f"hit rate {s['hit_rate']:.3f}; TTFT p50 {s['ttft_ms']['p50']:.0f} ms p99 {s['ttft_ms']['p99']:.0f} ms")
    if breakdown:
        print(f"{'CPU time by entry point':52s} {'calls':>9s} {'s':>7s} {'share':>6s} {'us/call':>8s}")
        for label, (seconds, calls) in breakdown.items():
            if calls:
                print(f"{label:52s} {calls:9d} {seconds:7.2f} {seconds / cpu:6.1%} {seconds / calls * 1e6:8.1f}")
    if decisions:
        print(f"Balancer.decide replayed: {replay_us(decisions):.1f} us CPU per decision "
              f"(the last {len(decisions)}, best of 5)")
        parts = replay_parts_us(decisions)
        print("  of which, each timed alone: " + ", ".join(f"{part} {us:.1f} us" for part, us in parts.items()))
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
