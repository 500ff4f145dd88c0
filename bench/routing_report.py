"""The routing report of docs/benchmarks.md, reproducible by one command: ``prefixlb bench report``.

1. **Fleet simulator** (virtual time, the router's own Balancer): the Mooncake trace on 4, 8 and
   16 workers (same KV per worker, arrivals sped up in proportion so each worker sees the same
   load), and the generated workloads on 8 workers; prefixlb's policies (cache_aware at several
   affinities, least_load, consistent_hash, round_robin) and the upper bound (one worker with the
   fleet's capacity and compute); and the multi-LoRA workload through adapter-aware and
   prefix-only ``cache_aware`` and ``round_robin`` (``bench/lora_routing.py``).
2. **HTTP replay** of the trace: real processes over loopback, simulated workers running
   ``time_scale`` times faster than real time, the bench's load generator; a fresh fleet (empty
   caches) per router: prefixlb (each policy, with Redis for KV events and load reports),
   sglang-router (cache_aware) and vllm-router (cache_aware, consistent_hash), and the upper
   bound (one merged simulated worker, no router).
3. **Validation**: the simulator against the HTTP replay for each prefixlb row.
4. **Goals** checked row by row (see :data:`GOALS`).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench.cluster import ClusterError, cluster
from bench.loadgen import LoadConfig, run_load
from bench.lora_routing import lora_section
from bench.peers.launch import PeerError
from bench.report import table, write_run
from bench.stats import send_lag
from bench.sim.fleet import FleetConfig, simulate
from bench.sim.router import SimRouterConfig, http_view
from bench.workloads import TextSource, Workload, load_workload
from router.routing.policies import get_policy, policy_names
from router.routing.policy import DEFAULT_AFFINITY
from worker.simulator.latency import LatencyModel
from worker.simulator.profiles import SIM_MAX_NUM_BATCHED_TOKENS, SIM_MAX_NUM_SEQS, get_gpu, get_model
from worker.server.config import ServerConfig

DEFAULT_TRACE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"
# The affinities a policy that reads one runs at: plain predicted TTFT, the default, follow the cache.
AFFINITIES = (0.5, DEFAULT_AFFINITY, 1.0)
GOALS = ("hit rate >= 0.95 x upper bound", "p99 TTFT <= 0.5 x sglang-router's (HTTP)",
         "p99 TTFT < least_load's", "p50 TTFT <= every peer's (HTTP)", "imbalance <= 1.15", "zero errors")

# Generated workloads on 8 workers, loaded so that round-robin keeps the GPUs busy 60-80% of
# the time (checked in the report's utilisation column).
GENERATED = {
    "system-prompt": ["tenants=64", "system_tokens=6144", "question_tokens=64-512", "output_tokens=32-256",
                      "rate=24"],
    "doc-qa": ["documents=48", "questions=12", "document_tokens=12288", "question_tokens=32-256",
               "output_tokens=32-256", "rate=12"],
    "multi-turn": ["sessions=400", "system_tokens=2048", "user_tokens=128-1024", "assistant_tokens=128-512",
                   "think_s=20", "rate=2.5"],
}


@dataclass(slots=True)
class ReportPlan:
    """What the report runs."""

    trace: str = DEFAULT_TRACE
    workers: int = 8
    kv_blocks: int = 16000
    speedup: float = 1.0
    time_scale: float = 5.0
    affinities: tuple[float, ...] = AFFINITIES
    num_requests: int | None = None
    generated_requests: int = 4000
    lora_requests: int = 10_000  # the multi-LoRA tables (0: skipped)
    lora_rates: tuple[float, ...] = (100.0, 200.0)
    http: bool = True
    peers: bool = True
    sim: bool = True
    redis: str | None = "redis://127.0.0.1:6379/0"
    out: Path = Path("runs/report")
    fleet_sizes: tuple[int, ...] = (4, 8, 16)
    seed: int = 0
    http_policies: tuple[str, ...] = field(default=())
    http_from: Path | None = None  # reuse the HTTP runs of an earlier report instead of replaying
    workload: str | None = None  # a workload spec (e.g. ``conversation``) instead of the trace
    workload_opts: tuple[str, ...] = ()
    http_upper_bound: bool = False  # replay the upper bound over HTTP too (one merged worker process)
    cpu_kv_ratio: float = 0.0  # simulated fleets (upper bound included) get CPU KV tiers this many x their KV


def prefixlb_rows(affinities: tuple[float, ...]) -> list[tuple[str, str, float | None]]:
    """(label, policy, affinity) of prefixlb's rows: every registered policy, in listing order,
    at each of ``affinities`` if it reads one."""
    rows: list[tuple[str, str, float | None]] = []
    for name in policy_names():
        if get_policy(name).uses_affinity:
            rows += [(f"prefixlb {name} a={a:g}", name, a) for a in affinities]
        else:
            rows.append((f"prefixlb {name}", name, None))
    return rows


def _fleet(plan: ReportPlan, workers: int, unit: int, speedup: float, policy: str = "cache_aware",
           affinity: float | None = None, upper_bound: bool = False, speed_report: str = "measured",
           time_scale: float = 1.0) -> FleetConfig:
    """A simulated fleet that sees what the HTTP router sees at ``time_scale`` (1: a real deployment)."""
    return FleetConfig(workers=workers, kv_blocks=plan.kv_blocks, unit=unit, speedup=speedup,
                       upper_bound=upper_bound, cpu_kv_ratio=plan.cpu_kv_ratio,
                       router=SimRouterConfig(policy=policy, affinity=DEFAULT_AFFINITY if affinity is None else affinity,
                                              speed_report=speed_report, **http_view(time_scale)))


def sim_scenario(plan: ReportPlan, name: str, workload: Workload, workers: int, unit: int,
                 speedup: float, time_scale: float = 1.0, control: bool = True) -> list[tuple[str, dict, dict]]:
    """Every prefixlb policy and the upper bound on one simulated setting."""
    out = []
    configs = [("upper bound", _fleet(plan, workers, unit, speedup, upper_bound=True, time_scale=time_scale))]
    configs += [(label, _fleet(plan, workers, unit, speedup, policy, a, time_scale=time_scale))
                for label, policy, a in prefixlb_rows(plan.affinities)]
    # Control: every replica reports the profile's nominal speed. Since speeds are measured in the
    # router's units this row should match the default one; a gap means the measured speeds mislead.
    if control:
        configs += [(f"control: cache_aware a={DEFAULT_AFFINITY:g}, nominal speed",
                     _fleet(plan, workers, unit, speedup, "cache_aware", DEFAULT_AFFINITY, speed_report="nominal",
                            time_scale=time_scale))]
    for label, cfg in configs:
        result = simulate(workload, cfg)
        result.meta["label"] = label
        run_dir = plan.out / "sim" / name / label.replace(" ", "_").replace("=", "")
        summary = write_run(run_dir, result.records, result.meta, fleet=list(result.meta["utilisation"]))
        out.append((label, summary, result.meta))
    return out


def _default_sim_tp() -> int:
    """The tensor-parallel degree a ``prefixlb worker --simulate`` picks with its default profiles."""
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    return LatencyModel(get_gpu(defaults["gpu"]), get_model(defaults["sim_model"])).tp


def http_run(plan: ReportPlan, label: str, workload: Workload, kind: str, policy: str,
             affinity: float | None = None) -> tuple[str, dict, dict]:
    """One HTTP replay on a fresh fleet; ``kind`` is ``prefixlb``, a peer's name, or ``upper``."""
    run_dir = plan.out / "http" / label.replace(" ", "_").replace("=", "")
    prefix = f"prefixlb-report-{uuid.uuid4().hex[:8]}:"
    started = time.time()
    with cluster(run_dir / "logs") as c:
        if kind == "upper":
            n = plan.workers
            # One worker with the fleet's compute: n times the tensor-parallel degree each worker
            # picks by default (the workers' default GPU and model profiles).
            tp = _default_sim_tp() * n
            extra = ["--sim-tp", str(tp), "--max-num-seqs", str(SIM_MAX_NUM_SEQS * n),
                     "--max-num-batched-tokens", str(SIM_MAX_NUM_BATCHED_TOKENS * n)]
            workers = c.workers(1, plan.time_scale, kv_blocks=plan.kv_blocks * n, extra=extra)
            target = workers[0].url
        else:
            use_redis = plan.redis if kind == "prefixlb" else None
            workers = c.workers(plan.workers, plan.time_scale, kv_blocks=plan.kv_blocks, redis=use_redis,
                                redis_prefix=prefix)
            if kind == "prefixlb":
                target = c.router(workers, policy, affinity, redis=use_redis, redis_prefix=prefix).url
            else:
                target = c.peer(kind, policy, workers).url
        load = LoadConfig(target=target, time_scale=plan.time_scale, speedup=plan.speedup, progress=False,
                          request_timeout_s=1800.0, seed=plan.seed)
        records = asyncio.run(run_load(workload, load, TextSource(plan.seed)))
        behind = max((workers_behind_s(w.url) for w in workers), default=0.0)
    _drop_redis_keys(plan.redis, prefix)
    meta = {"label": label, "kind": "http", "router": kind, "policy": policy, "affinity": affinity,
            "time_scale": plan.time_scale, "speedup": plan.speedup, "workers": plan.workers,
            "kv_blocks_per_worker": plan.kv_blocks, "workload": workload.name,
            "wall_s": round(time.time() - started, 1),
            "faithfulness": faithfulness(records, behind)}
    fleet = ["sim-0"] if kind == "upper" else [f"sim-{i}" for i in range(plan.workers)]
    summary = write_run(run_dir, records, meta, fleet=fleet)
    return label, summary, meta


# A replay is flagged when the load generator sent a request this late (p99, workload time) or
# a simulated worker fell this far behind its latency model (max, modelled time): beyond them
# the measured latencies are the box's, not the router's.
MAX_SEND_LAG_S = 0.1
# How close the simulator must come to the HTTP replay (hit rate in points, TTFT p50 relative).
MAX_SIM_HIT_POINTS, MAX_SIM_P50_ERROR = 2.0, 0.10
MAX_WORKER_BEHIND_S = 0.25


def workers_behind_s(url: str) -> float:
    """How far the simulated worker at ``url`` fell behind its latency model at worst (s);
    0 when it does not say (not a simulated worker)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("prefixlb_worker_sim_behind_max_seconds "):
            return float(line.split()[1])
    return 0.0


def faithfulness(records: list, worker_behind_s: float) -> dict:
    """Whether a replay measured the router rather than the box (see ``MAX_SEND_LAG_S``)."""
    lag = send_lag(records)
    lag_p99 = (lag["p99"] / 1000.0) if lag else 0.0
    reasons = []
    if lag_p99 > MAX_SEND_LAG_S:
        reasons.append(f"load generator {lag_p99:.2f} s behind schedule (p99)")
    if worker_behind_s > MAX_WORKER_BEHIND_S:
        reasons.append(f"a simulated worker {worker_behind_s:.2f} s behind its model")
    return {"send_lag_p99_s": round(lag_p99, 4), "worker_behind_max_s": round(worker_behind_s, 4),
            "faithful": not reasons, "reasons": reasons}


def _drop_redis_keys(url: str | None, prefix: str) -> None:
    if not url:
        return
    try:
        import redis

        client = redis.Redis.from_url(url)
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
    except Exception:  # noqa: BLE001 - cleanup is best effort; keys expire or are bounded anyway
        pass


def goal_checks(rows: list[tuple[str, dict, dict]], http: bool) -> list[str]:
    """One markdown line per prefixlb cache_aware row: which goals it meets."""
    by = {label: s for label, s, _ in rows}
    upper = by.get("upper bound")
    least = by.get("prefixlb least_load")
    sglang = by.get("sglang-router cache_aware")
    peers = [s for label, s, _ in rows if label.startswith(("sglang-router", "vllm-router"))]
    lines = []
    for label, s, _ in rows:
        if not label.startswith(("prefixlb cache_aware", "control")):
            continue
        t = s["ttft_ms"]
        checks = []
        if upper:
            checks.append(("hit >= 0.95 UB", s["hit_rate"] >= 0.95 * upper["hit_rate"],
                           f"{s['hit_rate'] / max(upper['hit_rate'], 1e-9):.2f} x UB"))
        if http and sglang:
            checks.append(("p99 <= 0.5 sglang", t["p99"] <= 0.5 * sglang["ttft_ms"]["p99"],
                           f"{t['p99'] / sglang['ttft_ms']['p99']:.2f} x sglang"))
        if least:
            checks.append(("p99 < least_load", t["p99"] < least["ttft_ms"]["p99"],
                           f"{t['p99'] / least['ttft_ms']['p99']:.2f} x least_load"))
        if http and peers:
            best = min(p["ttft_ms"]["p50"] for p in peers)
            checks.append(("p50 <= peers", t["p50"] <= best, f"{t['p50'] / best:.2f} x best peer"))
        checks.append(("imbalance <= 1.15", s["imbalance"] <= 1.15, f"{s['imbalance']:.2f}"))
        # The trace holds prompts longer than the model's context: every router (and the upper
        # bound) gets the same 400s for those, so only errors beyond them count.
        floor = upper["errors"] if upper else 0
        checks.append(("no errors beyond over-long prompts", s["errors"] <= floor, f"{s['errors']} vs {floor}"))
        text = "; ".join(f"{name} {'✅' if ok else '❌'} ({value})" for name, ok, value in checks)
        lines.append(f"- {label}: {text}")
    return lines


def _util(meta: dict) -> str:
    u = meta.get("mean_utilisation")
    return f" (mean busy {u:.0%})" if isinstance(u, float) else ""


def section(title: str, rows: list[tuple[str, dict, dict]], http: bool) -> list[str]:
    """A titled table plus its goal checks."""
    util = {label: _util(meta) + (" ⚠" if not meta.get("faithfulness", {}).get("faithful", True) else "")
            for label, _, meta in rows}
    lines = [f"### {title}", "", table([(label + util[label], s) for label, s, _ in rows]), ""]
    for label, _, meta in rows:
        if meta.get("note"):
            lines.append(f"- {label}: {meta['note']}")
        f = meta.get("faithfulness")
        if f and not f["faithful"]:
            lines.append(f"- ⚠ {label}: not faithful -- {'; '.join(f['reasons'])}: its latencies are the box's")
    lines += goal_checks(rows, http) + [""]
    return lines


def validation(sim_rows: list[tuple[str, dict, dict]], http_rows: list[tuple[str, dict, dict]]) -> list[str]:
    """Simulator vs HTTP replay, row by row: hit-rate difference (points) and TTFT p50 ratio."""
    sim = {label: s for label, s, _ in sim_rows}
    lines = ["| run | hit rate sim / HTTP | difference (points) | TTFT p50 sim / HTTP (s) | ratio | "
             f"within {MAX_SIM_HIT_POINTS:g} points and {MAX_SIM_P50_ERROR:.0%} |",
             "|---|---|---|---|---|---|"]
    for label, h, _ in http_rows:
        s = sim.get(label)
        if s is None:
            continue
        diff = 100.0 * (s["hit_rate"] - h["hit_rate"])
        p50s, p50h = s["ttft_ms"]["p50"] / 1000, h["ttft_ms"]["p50"] / 1000
        ratio = p50s / p50h if p50h else math.nan
        ok = abs(diff) <= MAX_SIM_HIT_POINTS and abs(ratio - 1.0) <= MAX_SIM_P50_ERROR
        lines.append(f"| {label} | {s['hit_rate']:.3f} / {h['hit_rate']:.3f} | {diff:+.1f} | "
                     f"{p50s:.3f} / {p50h:.3f} | {ratio:.2f} | {'✅' if ok else '❌'} |")
    return lines


def load_http_rows(report_dir: Path) -> list[tuple[str, dict, dict]]:
    """The HTTP rows of an earlier report directory, in the order the report runs them."""
    order = ["upper bound", *(label for label, _, _ in prefixlb_rows(AFFINITIES)), "sglang-router cache_aware",
             "vllm-router cache_aware", "vllm-router consistent_hash"]
    rows = []
    for run_dir in sorted((Path(report_dir) / "http").iterdir()):
        if (run_dir / "summary.json").exists():
            meta = json.loads((run_dir / "meta.json").read_text())
            rows.append((meta["label"], json.loads((run_dir / "summary.json").read_text()), meta))
    rank = {label: i for i, label in enumerate(order)}
    return sorted(rows, key=lambda r: rank.get(r[0], len(order)))


def _workload_of(plan: ReportPlan) -> tuple[Workload, int]:
    """The report's workload and the simulator's block for it (512 tokens for trace-like prompts)."""
    if plan.workload:
        wl = load_workload(plan.workload, plan.seed, plan.num_requests, list(plan.workload_opts) or None)
        return wl, (512 if plan.workload.startswith(("mooncake", "conversation")) else 64)
    return load_workload(f"mooncake:{plan.trace}", plan.seed, plan.num_requests), 512


def sim_upper_bound(plan: ReportPlan, workload: Workload, unit: int) -> tuple[str, dict, dict]:
    """The upper bound from the simulator, as the HTTP replay would see it (its time scale)."""
    result = simulate(workload, _fleet(plan, plan.workers, unit, plan.speedup, upper_bound=True,
                                       time_scale=plan.time_scale))
    result.meta["label"] = "upper bound"
    result.meta["note"] = ("from the simulator (one merged worker, the replay's time scale): a single simulated "
                           "worker process cannot keep the whole fleet's load in real time on a small box")
    summary = write_run(plan.out / "http" / "upper_bound_sim", result.records, result.meta,
                        fleet=list(result.meta["utilisation"]))
    return "upper bound", summary, result.meta


def http_upper_bound(plan: ReportPlan, workload: Workload, unit: int) -> tuple[str, dict, dict]:
    """The upper bound over HTTP if its replay is faithful, else the simulator's (with the reason)."""
    row = http_run(plan, "upper bound", workload, "upper", "none")
    faith = row[2].get("faithfulness", {})
    if faith.get("faithful", True):
        return row
    label, summary, meta = sim_upper_bound(plan, workload, unit)
    meta["note"] += f"; the HTTP replay was not faithful ({'; '.join(faith['reasons'])})"
    return label, summary, meta


def run_report(plan: ReportPlan) -> str:
    """Run everything the plan asks for; returns (and writes) the report's markdown."""
    plan.out.mkdir(parents=True, exist_ok=True)
    trace, unit = _workload_of(plan)
    lines = [f"## Routing report: {trace.name}", "",
             f"Command: `prefixlb bench report {' '.join(sys.argv[3:]) if len(sys.argv) > 3 else ''}`".rstrip(),
             f"Plan: `{json.dumps(dataclasses.asdict(plan), default=str)}`", ""]
    if plan.sim:
        for n in plan.fleet_sizes:
            speed = plan.speedup * n / plan.workers
            rows = sim_scenario(plan, f"{trace.name.split(':')[0]}-{n}w", trace, n, unit, speed)
            lines += section(f"Simulator: {trace.name}, {n} workers, speed-up {speed:g}", rows, http=False)
        for name, opts in (GENERATED.items() if plan.generated_requests > 0 and not plan.workload else ()):
            wl = load_workload(name, plan.seed, plan.generated_requests, opts)
            rows = sim_scenario(plan, name, wl, plan.workers, 64, 1.0)
            lines += section(f"Simulator: {name} ({', '.join(opts)}), {plan.workers} workers", rows, http=False)
        if plan.lora_requests > 0:
            lines += lora_section(plan.lora_requests, plan.lora_rates, plan.out / "sim" / "multi-lora", plan.seed)
        (plan.out / "report.md").write_text("\n".join(lines) + "\n")
    http_rows: list[tuple[str, dict, dict]] = []
    if plan.http_from is not None:
        http_rows = load_http_rows(plan.http_from)
        lines += section(f"HTTP replay (from {plan.http_from})", http_rows, http=True)
    elif plan.http:
        http_rows = [http_upper_bound(plan, trace, unit) if plan.http_upper_bound
                     else sim_upper_bound(plan, trace, unit)]
        for label, policy, a in prefixlb_rows(plan.affinities):
            if plan.http_policies and policy not in plan.http_policies:
                continue
            http_rows.append(http_run(plan, label, trace, "prefixlb", policy, a))
        if plan.peers:
            for peer, policy in (("sglang-router", "cache_aware"), ("vllm-router", "cache_aware"),
                                 ("vllm-router", "consistent_hash")):
                try:
                    http_rows.append(http_run(plan, f"{peer} {policy}", trace, peer, policy))
                except (PeerError, ClusterError) as exc:
                    lines.append(f"- {peer} {policy}: not measured: {exc}")
        lines += section(f"HTTP replay: {plan.workers} simulated workers, time-scale {plan.time_scale:g}, "
                         f"speed-up {plan.speedup:g}", http_rows, http=True)
    if http_rows and plan.sim:
        # The simulator as the replay's router saw the fleet: every period and delay x time scale.
        sim_http = sim_scenario(plan, f"{trace.name.split(':')[0]}-{plan.workers}w-ts{plan.time_scale:g}", trace,
                                plan.workers, unit, plan.speedup, time_scale=plan.time_scale, control=False)
        lines += ["### Simulator vs HTTP replay (same workload, fleet and policies; the simulator sees the "
                  f"replay's delays at time scale {plan.time_scale:g})", "", *validation(sim_http, http_rows), ""]
    text = "\n".join(lines) + "\n"
    (plan.out / "report.md").write_text(text)
    return text


def main(argv: list[str]) -> int:
    """``prefixlb bench report``."""
    p = argparse.ArgumentParser(prog="prefixlb bench report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake trace")
    p.add_argument("--out", default="runs/report")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=16000, help="KV blocks (16 tokens) per worker")
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--time-scale", type=float, default=5.0, help="simulated workers' speed for the HTTP replay")
    p.add_argument("--affinities", default=",".join(f"{a:g}" for a in AFFINITIES))
    p.add_argument("--num-requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--generated-requests", type=int, default=4000, help="0 skips the generated workloads")
    p.add_argument("--fleet-sizes", default="4,8,16", help="simulated fleet sizes for the trace")
    p.add_argument("--lora-requests", type=int, default=10_000, help="0 skips the multi-LoRA tables")
    p.add_argument("--no-http", action="store_true", help="simulator only")
    p.add_argument("--no-sim", action="store_true", help="HTTP replay only")
    p.add_argument("--no-peers", action="store_true", help="skip sglang-router and vllm-router")
    p.add_argument("--http-policies", default="", help="only these prefixlb policies over HTTP (comma list)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis for prefixlb's KV events ('' = none)")
    p.add_argument("--http-from", default=None, help="take the HTTP rows from this earlier report directory")
    p.add_argument("--workload", default=None,
                   help="a workload instead of the trace: conversation, multi-turn, ... or mooncake:FILE")
    p.add_argument("--workload-opt", action="append", default=[], help="workload option key=value (repeatable)")
    p.add_argument("--http-upper-bound", action="store_true",
                   help="replay the upper bound over HTTP too (the simulator's replaces it if not faithful)")
    p.add_argument("--cpu-kv-ratio", type=float, default=0.0,
                   help="simulated workers (and the upper bound) get a CPU KV tier of this many x their KV")
    args = p.parse_args(argv)
    plan = ReportPlan(trace=args.trace, workers=args.workers, kv_blocks=args.kv_blocks, speedup=args.speedup,
                      time_scale=args.time_scale,
                      affinities=tuple(float(a) for a in args.affinities.split(",") if a.strip()),
                      num_requests=args.num_requests, generated_requests=args.generated_requests,
                      lora_requests=args.lora_requests,
                      http=not args.no_http, peers=not args.no_peers, sim=not args.no_sim,
                      redis=args.redis or None, out=Path(args.out),
                      http_policies=tuple(x for x in args.http_policies.split(",") if x),
                      http_from=Path(args.http_from) if args.http_from else None, cpu_kv_ratio=args.cpu_kv_ratio,
                      workload=args.workload, workload_opts=tuple(args.workload_opt),
                      http_upper_bound=args.http_upper_bound,
                      fleet_sizes=tuple(int(n) for n in args.fleet_sizes.split(",") if n.strip()))
    print(run_report(plan))
    print(f"written to {plan.out / 'report.md'}")
    return 0
