"""Sweep of the Triton paged-decode kernel's tuning knobs on a CUDA GPU, in one run.

    python -m bench.kernels_sweep --out DIR                 # bf16, batch 1/16/64 x context 1K/4K/16K
    python -m bench.kernels_sweep --batches 64 --contexts 4096 --tilings 64x4x3,32x4x3

Shapes as in bench/kernels.py (Llama-3-8B attention, block size 16, shuffled blocks). For each
shape: SDPA on pre-gathered dense KV (the baseline), the kernel with its defaults, then every
tiling (`block_n x num_warps x num_stages`) at every split count that leaves partitions of at
least 128 tokens. Each variant writes into a NaN-poisoned `out` and is checked against SDPA in
fp32 on the same inputs before it is timed; a variant that fails is reported, never ranked.

Times are medians with the L2 flushed (a 256 MB write) before each run, two ways:
- `gpu`: replays of a CUDA graph of the call: device time alone;
- `eager`: the call itself, as `triton.testing.do_bench` times it: when the host needs longer to
  launch than the flush takes to run, this includes the difference.
`host_us` (batch 1 x 1K) is the wall-clock per call of back-to-back calls: Python and launches.

Writes `rows.jsonl` (every measurement) and `summary.txt` (what it prints) under `--out`.
Compiles run first, in parallel processes sharing Triton's on-disk cache.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

from bench.kernels import Shape, _dense, _paged_kv, cuda_graph_ms, peak_bandwidth

TILINGS = (
    "32x2x3,32x4x2,32x4x3,32x4x4,32x8x3,32x8x4,"
    "64x4x2,64x4x3,64x4x4,64x8x2,64x8x3,64x8x4,"
    "128x4x2,128x8x2,128x8x3"
)
SMOKE_TILINGS = "32x4x2,64x4x3"
SPLITS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
MIN_PARTITION = 128
MAX_PROGRAMS = 8192
FLUSH_BYTES = 256 * 2**20
MAX_ABS_ERR, MAX_REL_ERR = 3e-2, 1e-2  # bf16 outputs against fp32 SDPA


@dataclass(frozen=True, slots=True)
class Tiling:
    """One launch shape of the decode kernel."""

    block_n: int
    num_warps: int
    num_stages: int

    @classmethod
    def parse(cls, text: str) -> Tiling:
        block_n, warps, stages = (int(part) for part in text.split("x"))
        return cls(block_n, warps, stages)

    def __str__(self) -> str:
        return f"{self.block_n}x{self.num_warps}x{self.num_stages}"


@dataclass(slots=True)
class Row:
    """One measured variant of one shape (times in ms, `peak` a fraction of HBM peak)."""

    batch: int
    context: int
    variant: str
    partition: int | None = None
    splits: int | None = None
    ok: bool = True
    max_abs_err: float = 0.0
    rel_err: float = 0.0
    gpu_ms: float | None = None
    eager_ms: float | None = None
    gpu_peak: float | None = None
    extra: dict = field(default_factory=dict)


def split_candidates(context: int, programs_per_split: int, block_n: int) -> list[int]:
    """Partition lengths (multiples of `block_n`) to try: one per distinct split count."""
    partitions = []
    for splits in SPLITS:
        partition = -(-(-(-context // splits)) // block_n) * block_n
        used = -(-context // partition)
        if splits > 1 and partition < max(block_n, MIN_PARTITION):
            continue
        if used > 64 or programs_per_split * used > MAX_PROGRAMS or partition in partitions:
            continue
        partitions.append(partition)
    return partitions


class Timer:
    """Median device times with the L2 flushed before each run (see the module docstring)."""

    def __init__(self, torch, reps: int) -> None:
        self.torch, self.reps = torch, reps
        self.flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")

    def _median(self, launch) -> float:
        torch = self.torch
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for start, end in zip(starts, ends):
            self.flush.zero_()
            start.record()
            launch()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))

    def eager(self, fn) -> float:
        for _ in range(3):
            fn()
        return self._median(fn)

    def gpu(self, fn) -> float:
        return cuda_graph_ms(self.torch, fn, self.reps)

    def host_us(self, fn, calls: int = 200) -> float:
        fn()
        self.torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        self.torch.cuda.synchronize()
        return elapsed / calls * 1e6


class WallTimer:
    """`--smoke` on CPU: one call's wall-clock time stands in for every timing (the flow, not
    the numbers, is what a smoke run checks)."""

    def _once(self, fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def eager(self, fn) -> float:
        return self._once(fn)

    gpu = eager

    def host_us(self, fn) -> float:
        return self._once(fn) * 1e3


def _precompile(tilings: list[str]) -> str:
    """In a spawned process: compile (direct and split) each tiling into Triton's disk cache."""
    import torch

    from kernels.triton_decode import paged_decode_attention

    shape, gen = Shape(), torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache, tables = _paged_kv(torch, 1, 1024, shape, torch.bfloat16, torch.device("cuda"), gen)
    q = torch.randn(1, shape.num_heads, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    for text in tilings:
        t = Tiling.parse(text)
        for partition in (1024, 512):
            paged_decode_attention(
                q, k_cache, v_cache, tables, lens, 0.1, max_context_len=1024, partition_size=partition,
                block_n=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages,
            )
    torch.cuda.synchronize()
    return f"{os.getpid()}: {len(tilings)} tilings"


def precompile(tilings: list[Tiling], jobs: int, say) -> None:
    chunks = [[str(t) for t in tilings[i::jobs]] for i in range(jobs) if tilings[i::jobs]]
    start = time.perf_counter()
    try:
        with ProcessPoolExecutor(len(chunks), mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_precompile, chunks))
        say(f"precompiled {len(tilings)} tilings in {len(chunks)} processes: {time.perf_counter() - start:.1f} s")
    except Exception as exc:  # the sweep still compiles each tiling when it first runs it
        say(f"precompile failed ({exc!r}); compiling inline")


def occupancy(kernel, num_warps: int) -> dict:
    """Registers, shared memory and resident programs per SM of a compiled Triton kernel."""
    if hasattr(kernel, "result"):  # a compile still in flight
        kernel = kernel.result()
    info = {"regs": getattr(kernel, "n_regs", None), "shared": kernel.metadata.shared}
    if info["regs"]:  # Hopper: 64K registers (in 256-register steps per warp), 228 KB shared per SM
        per_warp = -(-info["regs"] * 32 // 256) * 256
        info["estimate"] = min(65536 // (per_warp * num_warps), 233472 // (info["shared"] + 1024), 64 // num_warps, 32)
    try:
        from cuda.bindings import driver

        err, blocks = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            driver.CUfunction(kernel.function), 32 * num_warps, kernel.metadata.shared
        )
        info["programs_per_sm"] = blocks if int(err) == 0 else None
    except Exception as exc:
        info["programs_per_sm"] = None
        info["occupancy_error"] = repr(exc)[:120]
    return info


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; returns 0, 1 if any variant disagreed with SDPA, 2 without CUDA."""
    parser = argparse.ArgumentParser(prog="python -m bench.kernels_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="folder for rows.jsonl and summary.txt")
    parser.add_argument("--batches", help="default 1,16,64 (smoke: 2)")
    parser.add_argument("--contexts", help="default 1024,4096,16384 (smoke: 300)")
    parser.add_argument("--tilings", help=f"block_n x num_warps x num_stages, comma-separated (default {TILINGS})")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=8, help="processes for the compiles (0: compile inline)")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny fp16 shapes via the interpreter, fake times")
    args = parser.parse_args(argv)
    args.batches = args.batches or ("2" if args.smoke else "1,16,64")
    args.contexts = args.contexts or ("300" if args.smoke else "1024,4096,16384")
    args.tilings = args.tilings or (SMOKE_TILINGS if args.smoke else TILINGS)

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench.kernels_sweep needs a CUDA GPU (none here); `--smoke` checks its flow on CPU", file=sys.stderr)
        return 2
    import triton

    os.makedirs(args.out, exist_ok=True)
    sweep = Sweep(torch, args, open(os.path.join(args.out, "rows.jsonl"), "w", encoding="utf-8"))
    sweep.say(f"device: {sweep.device_name}; torch {torch.__version__}, triton {triton.__version__}; "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    if not args.smoke:
        sweep.measure_copy_bandwidth()
        if args.jobs > 0:
            precompile(sweep.tilings, min(args.jobs, len(sweep.tilings)), sweep.say)
    for batch in [int(b) for b in args.batches.split(",")]:
        for context in [int(c) for c in args.contexts.split(",")]:
            sweep.run_shape(batch, context)
    sweep.report()
    with open(os.path.join(args.out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(sweep.summary) + "\n")
    return 1 if sweep.failures else 0


class Sweep:
    """The measurements of one run, the rows they produced, and the report."""

    def __init__(self, torch, args, rows_file) -> None:
        import torch.nn.functional as F

        from kernels import triton_decode

        self.torch, self.F, self.decode = torch, F, triton_decode
        self.rows_file, self.summary, self.failures = rows_file, [], 0
        self.tilings = [Tiling.parse(t) for t in args.tilings.split(",") if t]
        if args.smoke:
            self.device, self.device_name, self.peak = torch.device("cpu"), "cpu (interpreter)", None
            self.shape, self.dtype, self.timer = Shape(8, 2, 64, 16), torch.float16, WallTimer()
            self.host_context = None
        else:
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.device_name = torch.cuda.get_device_name(self.device)
            self.peak = peak_bandwidth(self.device_name)
            self.shape, self.dtype, self.timer = Shape(), torch.bfloat16, Timer(torch, args.reps)
            self.host_context = min(int(c) for c in args.contexts.split(","))
        self.occupancies: dict[str, dict] = {}
        self.best: dict[tuple[int, int], dict[str, Row]] = {}
        self.baseline: dict[tuple[int, int], dict[str, Row]] = {}

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.summary.append(line)

    def record(self, row: Row) -> Row:
        self.rows_file.write(json.dumps(asdict(row)) + "\n")
        self.rows_file.flush()
        return row

    def measure_copy_bandwidth(self) -> None:
        src = self.torch.empty(2**30, dtype=self.torch.uint8, device=self.device)
        dst = self.torch.empty_like(src)
        ms = self.timer.eager(lambda: dst.copy_(src))
        self.say(f"device-to-device copy: {2 * 2**30 / ms / 1e6:.0f} GB/s (read + write);"
                 f" HBM peak {self.peak / 1e9 if self.peak else float('nan'):.0f} GB/s;"
                 f" {self.torch.cuda.get_device_properties(self.device).multi_processor_count} SMs")

    def run_shape(self, batch: int, context: int) -> None:
        """Baselines, then every tiling at every split count, for one shape."""
        torch, F, decode, shape = self.torch, self.F, self.decode, self.shape
        gen = torch.Generator(device=self.device).manual_seed(batch * 7919 + context)
        k_cache, v_cache, tables = _paged_kv(torch, batch, context, shape, self.dtype, self.device, gen)
        q = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen, device=self.device).to(self.dtype)
        lens = torch.full((batch,), context, dtype=torch.int32, device=self.device)
        scale = shape.head_dim**-0.5
        group = shape.num_heads // shape.num_kv_heads
        k_dense, v_dense = _dense(k_cache, tables, context), _dense(v_cache, tables, context)
        q_folded = q.view(batch, shape.num_kv_heads, group, shape.head_dim)
        reference = F.scaled_dot_product_attention(
            q_folded.float(), k_dense.float(), v_dense.float(), scale=scale
        ).reshape(batch, shape.num_heads, shape.head_dim)
        reference_norm = reference.norm().item()
        element = q.element_size()
        nbytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * element + 2 * q.numel() * element
        out = torch.empty_like(q)

        def check(row: Row, fn) -> bool:
            out.fill_(float("nan"))
            fn()
            diff = (out.float() - reference).nan_to_num(nan=float("inf"))
            row.max_abs_err = diff.abs().max().item()
            row.rel_err = diff.norm().item() / reference_norm
            row.ok = math.isfinite(row.max_abs_err) and row.max_abs_err <= MAX_ABS_ERR and row.rel_err <= MAX_REL_ERR
            if not row.ok:
                self.failures += 1
                self.record(row)
                self.say(f"  FAILED b{batch} x {context} {row.variant} partition {row.partition}:"
                         f" max err {row.max_abs_err:.2e}, rel {row.rel_err:.2e}")
            return row.ok

        def timed(row: Row, fn) -> Row:
            row.gpu_ms, row.eager_ms = self.timer.gpu(fn), self.timer.eager(fn)
            row.gpu_peak = nbytes / (row.gpu_ms * 1e-3) / self.peak if self.peak else None
            return self.record(row)

        def sdpa():
            return F.scaled_dot_product_attention(q_folded, k_dense, v_dense, scale=scale)

        def kernel(**knobs):
            return lambda: decode.paged_decode_attention(
                q, k_cache, v_cache, tables, lens, scale, max_context_len=context, out=out, **knobs
            )

        key = (batch, context)
        sdpa_row = timed(Row(batch, context, "sdpa"), sdpa)
        default_row = Row(batch, context, "default")
        default_row.partition = decode._choose_partition(
            context, batch * shape.num_kv_heads, decode.CUDA_TILING.block_n, self.device
        )
        default_row.splits = -(-context // default_row.partition)
        if check(default_row, kernel()):
            timed(default_row, kernel())
        self.baseline[key] = {"sdpa": sdpa_row, "default": default_row}
        if batch == 1 and context == self.host_context:
            host = {
                "sdpa": self.timer.host_us(sdpa),
                "one_split": self.timer.host_us(kernel(partition_size=context)),
                "four_splits": self.timer.host_us(kernel(partition_size=context // 4)),
                "empty_like": self.timer.host_us(lambda: torch.empty_like(q)),
            }
            self.say("host us per call (Python + launches): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))
            self.record(Row(batch, context, "host_us", extra=host))

        self.best[key] = {}
        for tiling in self.tilings:
            knobs = {"block_n": tiling.block_n, "num_warps": tiling.num_warps, "num_stages": tiling.num_stages}
            for partition in split_candidates(context, batch * shape.num_kv_heads, tiling.block_n):
                row = Row(batch, context, str(tiling), partition, -(-context // partition))
                compiled_before = set(self._compiled())
                if not check(row, kernel(partition_size=partition, **knobs)):
                    continue
                for added in set(self._compiled()) - compiled_before:
                    mode = "direct" if row.splits == 1 else "split"
                    compiled = self._compiled()[added]
                    self.occupancies.setdefault(f"{tiling} {mode}", occupancy(compiled, tiling.num_warps))
                timed(row, kernel(partition_size=partition, **knobs))
                if str(tiling) not in self.best[key] or row.gpu_ms < self.best[key][str(tiling)].gpu_ms:
                    self.best[key][str(tiling)] = row
        if not self.best[key]:
            self.say(f"b{batch} x {context}: no variant passed its check")
            del self.best[key]
            return
        winner = min(self.best[key].values(), key=lambda r: r.gpu_ms)
        self.say(
            f"b{batch} x {context}: sdpa gpu {sdpa_row.gpu_ms:.4f} eager {sdpa_row.eager_ms:.4f}"
            f" | default p{default_row.partition} gpu {_ms(default_row.gpu_ms)} eager {_ms(default_row.eager_ms)}"
            f" | best {winner.variant} p{winner.partition} (x{winner.splits}) gpu {winner.gpu_ms:.4f}"
            f" ({_pct(winner.gpu_peak)}) eager {winner.eager_ms:.4f}"
        )
        del k_cache, v_cache, tables, k_dense, v_dense, reference, out
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _compiled(self) -> dict:
        """Triton's in-process cache of compiled split kernels (empty on CPU)."""
        if self.device.type != "cuda":
            return {}
        try:
            return self.decode._decode_split_kernel.device_caches[self.device.index][0]
        except Exception:
            return {}

    def report(self) -> None:
        say, keys = self.say, list(self.best)
        say("occupancy (regs, shared bytes, programs/SM by the driver/estimated): " + "; ".join(
            f"{k} {v.get('regs')},{v.get('shared')},{v.get('programs_per_sm')}/{v.get('estimate')}"
            for k, v in sorted(self.occupancies.items())
        ))
        self.record(Row(0, 0, "occupancy", extra=self.occupancies))
        say("per tiling at its best split count: gpu ms / splits per shape, then geomean of time / best time")
        say("  tiling    " + " ".join(f"{f'b{b}x{c}':>14}" for b, c in keys) + "   geomean")
        winners = [min(self.best[k].values(), key=lambda r: r.gpu_ms).gpu_ms for k in keys]
        scored = []
        for tiling in self.tilings:
            rows = [self.best[k].get(str(tiling)) for k in keys]
            if any(r is None for r in rows):
                continue
            ratio = math.exp(statistics.mean(math.log(r.gpu_ms / w) for r, w in zip(rows, winners)))
            scored.append((ratio, str(tiling), rows))
        for ratio, tiling, rows in sorted(scored):
            say(f"  {tiling:9} " + " ".join(f"{r.gpu_ms:9.4f}/x{r.splits:<3}" for r in rows) + f"   {ratio:.3f}")
        say("per shape: sdpa gpu/eager ms; default (current heuristic) partition, gpu/eager ms")
        for k in keys:
            s, d = self.baseline[k]["sdpa"], self.baseline[k]["default"]
            say(f"  b{k[0]} x {k[1]}: sdpa {s.gpu_ms:.4f}/{s.eager_ms:.4f} ({_pct(s.gpu_peak)});"
                f" default p{d.partition} {_ms(d.gpu_ms)}/{_ms(d.eager_ms)} ({_pct(d.gpu_peak)})")
        say(f"failures: {self.failures}")
        self.rows_file.close()


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _pct(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.0%}"


if __name__ == "__main__":
    sys.exit(main())
