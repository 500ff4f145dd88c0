"""The routing report's goal checks and validation table, and the load generator's stream parser."""
from __future__ import annotations

from bench.loadgen import _Stream
from bench.records import RequestRecord
from bench.routing_report import faithfulness, goal_checks, section, validation
from bench.stats import summarize


def _summary(hit: float, p50: float, p99: float, imbalance: float = 1.0, errors: int = 0) -> dict:
    return {"hit_rate": hit, "ttft_ms": {"p50": p50, "p90": p99, "p99": p99, "mean": p50},
            "imbalance": imbalance, "errors": errors}


def test_goal_checks_compare_cache_aware_with_the_upper_bound_least_load_and_the_peers():
    rows = [
        ("upper bound", _summary(0.40, 100, 1000, errors=1), {}),
        ("prefixlb cache_aware a=0.8", _summary(0.39, 200, 1500, 1.10, errors=1), {}),
        ("prefixlb least_load", _summary(0.10, 300, 2000), {}),
        ("sglang-router cache_aware", _summary(0.38, 250, 4000), {}),
        ("vllm-router cache_aware", _summary(0.30, 180, 5000), {}),
    ]
    (line,) = goal_checks(rows, http=True)
    assert line == ("- prefixlb cache_aware a=0.8: hit >= 0.95 UB ✅ (0.97 x UB); "
                    "p99 <= 0.5 sglang ✅ (0.38 x sglang); p99 < least_load ✅ (0.75 x least_load); "
                    "p50 <= peers ❌ (1.11 x best peer); imbalance <= 1.15 ✅ (1.10); "
                    "no errors beyond over-long prompts ✅ (1 vs 1)")
    (sim_line,) = goal_checks(rows[:3], http=False)
    assert "sglang" not in sim_line and "peers" not in sim_line


def test_validation_lists_hit_rate_difference_in_points_and_the_p50_ratio():
    sim = [("prefixlb round_robin", _summary(0.050, 400, 900), {})]
    http = [("prefixlb round_robin", _summary(0.062, 500, 1000), {}), ("sglang-router cache_aware",
                                                                        _summary(0.1, 1, 1), {})]
    lines = validation(sim, http)
    assert lines[2] == "| prefixlb round_robin | 0.050 / 0.062 | -1.2 | 0.400 / 0.500 | 0.80 | ❌ |"
    assert len(lines) == 3  # rows without a simulated twin are skipped
    close = validation([("x", _summary(0.061, 460, 900), {})], [("x", _summary(0.062, 500, 1000), {})])
    assert close[2].endswith("| 0.92 | ✅ |")


def test_a_replay_whose_load_generator_or_workers_fell_behind_is_flagged_not_faithful():
    on_time = [RequestRecord(i, 0.0, send_lag_ms=5.0) for i in range(100)]
    late = on_time[:90] + [RequestRecord(i, 0.0, send_lag_ms=800.0) for i in range(10)]
    assert faithfulness(on_time, 0.05) == {"send_lag_p99_s": 0.005, "worker_behind_max_s": 0.05,
                                           "faithful": True, "reasons": []}
    flagged = faithfulness(late, 2.0)
    assert not flagged["faithful"]
    assert flagged["reasons"] == ["load generator 0.80 s behind schedule (p99)",
                                  "a simulated worker 2.00 s behind its model"]
    done = [RequestRecord(0, 0.0, "sim-0", ttft_ms=10.0, e2e_ms=20.0, prompt_tokens=10, completion_tokens=1)]
    rows = [("upper bound", summarize(done, fleet=["sim-0"]), {"faithfulness": flagged})]
    text = "\n".join(section("HTTP", rows, http=True))
    assert "upper bound ⚠" in text and "not faithful -- load generator 0.80 s behind" in text


def test_stream_parser_takes_the_first_chunk_as_first_token_and_reads_usage_and_worker():
    s = _Stream()
    s.feed(b": keep-alive\n", 0.5)
    s.feed(b'data: {"system_fingerprint":"w3","choices":[{"text":"a"}],"usage":null}\n', 1.0)
    s.feed(b'data: {"choices":[{"text":"b"}],"usage":null}\n', 2.0)
    s.feed(b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,'
           b'"prompt_tokens_details":{"cached_tokens":4}}}\n', 3.0)
    s.feed(b"data: [DONE]\n", 4.0)
    assert (s.first_at, s.worker_id, s.error) == (1.0, "w3", None)
    assert s.usage == {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}


def test_stream_parser_reports_an_error_chunk():
    s = _Stream()
    s.feed(b'data: {"error":{"message":"worker died","type":"server_error"}}\n', 1.0)
    assert s.error == "worker died" and s.usage is None


def test_the_load_generator_reports_how_far_it_fell_behind_the_arrival_schedule():
    import asyncio
    import json
    import time

    from aiohttp import web

    from bench.loadgen import LoadConfig, run_load
    from bench.stats import SUMMARY_KEYS, send_lag
    from bench.workloads import RequestSpec, TextSource, Workload
    from tests.support import completions_server

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"system_fingerprint":"w0","choices":[{"text":"a"}],"usage":null}\n\n')
        await resp.write(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,'
                         b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    class SlowText(TextSource):  # the generator's own work (here: rendering) outlasts the gaps
        def prompt(self, spec: RequestSpec) -> str:
            time.sleep(0.05)
            return "ab"

    async def main() -> list:
        async with completions_server(completions) as url:
            wl = Workload("t", [RequestSpec(i, i * 0.001, ((i, 2),), 1) for i in range(6)])
            cfg = LoadConfig(target=url, model="m", time_scale=2.0, progress=False)
            return await run_load(wl, cfg, SlowText())

    records = asyncio.run(main())
    assert all(r.ok for r in records)
    # The last request was due at 5 ms but could leave only after six 50 ms renderings (x2 time scale).
    assert records[-1].send_lag_ms > 400
    lag = send_lag(records)
    assert lag["p99"] > 400 and json.dumps(lag)
    assert tuple(summarize(records)) == SUMMARY_KEYS  # summary.json keeps exactly its contract's keys


def test_the_http_upper_bound_takes_the_default_workers_tensor_parallel_degree():
    # "one worker with the fleet's compute" = n x the TP a simulated worker picks by default
    # (1 for Llama-3-8B on an H100-80G; a larger default model would need more).
    from bench.routing_report import _default_sim_tp
    from worker.simulator.latency import LatencyModel
    from worker.simulator.profiles import get_gpu, get_model

    assert _default_sim_tp() == LatencyModel(get_gpu("H100-80G"), get_model("llama-3-8b")).tp == 1
