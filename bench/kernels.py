"""GPU benchmark of the Triton attention kernels against SDPA on pre-gathered KV.

    python -m bench.kernels                     # on a CUDA machine: the full grid below
    python -m bench.kernels --json out.json     # also write the rows as JSON
    python -m bench.kernels --smoke             # on CPU: tiny shapes through Triton's interpreter,
                                                # correctness only, no timings

Decode: batch 1/16/64 x context 1K/4K/16K, bf16 and fp16, Llama-3-8B attention shape (32 query
heads, 8 KV heads, head_dim 128, block size 16, physical blocks shuffled). For each shape: the
kernel's time, the bytes it must move (K and V of every context token, Q in and O out) divided by
that time, and the fraction of the device's HBM peak; the same for
`scaled_dot_product_attention` on K/V already gathered into dense tensors (the best a
non-paged kernel can do: it skips the block-table indirection). Prefix-extend: 256 new tokens on
a 4,096-token cached prefix vs recomputing all 4,352 tokens (the same kernel with no prefix, and
causal SDPA over the dense 4,352). Each kernel output is checked against SDPA before it is timed.

Timings are medians of `triton.testing.do_bench` (which flushes L2 between runs): what a caller
that launches the op eagerly sees, so when the host needs longer to launch it than do_bench's
L2 flush takes to run, host overhead shows. Decode also gets the median of CUDA-graph replays
with the same flush before each (`graph ms`): device time alone. On a machine without CUDA the
full benchmark refuses: the interpreter's timings say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

# Device name fragments (most specific first) -> HBM peak bytes/s, from the vendors' data sheets.
PEAK_HBM_BYTES_PER_S = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM
    ("A100-SXM4-40GB", 1.555e12),
    ("A100-PCIE-40GB", 1.555e12),
    ("A100", 2.0e12),  # 80 GB
)
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
TARGET = ("bfloat16", 64, 4096, 0.70)  # issue 3: decode >= 70% of HBM peak at batch 64 x 4K (H200)


@dataclass(frozen=True, slots=True)
class Shape:
    """Attention geometry of the benchmarked model."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass(slots=True)
class DecodeRow:
    """One decode shape: times in ms, bandwidth in GB/s, peak fraction in [0, 1] or None."""

    dtype: str
    batch: int
    context: int
    bytes_moved: int
    max_abs_err: float
    kernel_ms: float | None = None
    sdpa_ms: float | None = None
    kernel_gbps: float | None = None
    sdpa_gbps: float | None = None
    kernel_peak: float | None = None
    sdpa_peak: float | None = None
    kernel_graph_ms: float | None = None
    sdpa_graph_ms: float | None = None


@dataclass(slots=True)
class ExtendRow:
    """Prefix-extend vs full recompute at one dtype: times in ms."""

    dtype: str
    prefix: int
    new_tokens: int
    max_abs_err: float
    extend_ms: float | None = None
    recompute_ms: float | None = None
    sdpa_recompute_ms: float | None = None


def peak_bandwidth(device_name: str) -> float | None:
    """HBM peak of a device in bytes/s, or None when the name is not in the table."""
    for fragment, peak in PEAK_HBM_BYTES_PER_S:
        if fragment in device_name:
            return peak
    return None


def _paged_kv(torch, batch, context, shape, dtype, device, gen):
    """Random paged caches holding `batch` sequences of `context` tokens in shuffled blocks."""
    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_seq)
    return k_cache, v_cache, tables.to(torch.int32)


def _dense(cache, tables, context):
    """`[batch, kv_heads, context, head_dim]`, contiguous: what SDPA reads."""
    gathered = cache[tables.long()].flatten(1, 2)[:, :context]
    return gathered.transpose(1, 2).contiguous()


def _sdpa_causal(torch, q, k, v, scale):
    """Causal SDPA with grouped heads; q `[batch, heads, n, dim]`, k/v `[batch, kv_heads, n, dim]`."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def cuda_graph_ms(torch, fn, reps: int = 50) -> float:
    """Median device time of `fn` in ms: replays of a CUDA graph of one call, the L2 flushed
    (a 256 MB write, as do_bench does) before each; no host launch overhead."""
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    graph.replay()
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[reps // 2]


def bench_decode(torch, backend, batch, context, dtype, shape, device, timer, peak=None, graph_timer=None) -> DecodeRow:
    """One decode shape: check the kernel against SDPA, then time both (if `timer`, which
    returns milliseconds; also with `graph_timer`, the same for device time alone); `peak`
    (bytes/s) turns bandwidths into fractions of the device peak."""
    gen = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
    k_cache, v_cache, tables = _paged_kv(torch, batch, context, shape, dtype, device, gen)
    q = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = shape.head_dim**-0.5
    k_dense, v_dense = _dense(k_cache, tables, context), _dense(v_cache, tables, context)
    # One query token per head: the query heads sharing a KV head become that head's query rows,
    # so SDPA runs without GQA support (and its fastest kernels) and reads each KV head once.
    group = shape.num_heads // shape.num_kv_heads
    q_folded = q.view(batch, shape.num_kv_heads, group, shape.head_dim)

    def kernel():
        return backend.decode(q, k_cache, v_cache, tables, lens, scale, max_context_len=context)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q_folded, k_dense, v_dense, scale=scale)

    expected = sdpa().reshape(batch, shape.num_heads, shape.head_dim)
    err = (kernel().float() - expected.float()).abs().max().item()
    element = q.element_size()
    kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * element
    qo_bytes = 2 * batch * shape.num_heads * shape.head_dim * element
    row = DecodeRow(str(dtype).removeprefix("torch."), batch, context, kv_bytes + qo_bytes, err)
    if timer is not None:
        row.kernel_ms, row.sdpa_ms = timer(kernel), timer(sdpa)
        row.kernel_gbps = row.bytes_moved / row.kernel_ms / 1e6
        row.sdpa_gbps = row.bytes_moved / row.sdpa_ms / 1e6
        if peak is not None:
            row.kernel_peak = row.kernel_gbps * 1e9 / peak
            row.sdpa_peak = row.sdpa_gbps * 1e9 / peak
    if graph_timer is not None:
        row.kernel_graph_ms, row.sdpa_graph_ms = graph_timer(kernel), graph_timer(sdpa)
    return row


def bench_extend(torch, backend, prefix, new_tokens, dtype, shape, device, timer) -> ExtendRow:
    """New tokens on a cached prefix vs recomputing the whole sequence (one sequence)."""
    gen = torch.Generator(device=device).manual_seed(prefix + new_tokens)
    total = prefix + new_tokens
    k_cache, v_cache, tables = _paged_kv(torch, 1, total, shape, dtype, device, gen)
    q_all = torch.randn(total, shape.num_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    q_new = q_all[prefix:].contiguous()
    lens = torch.tensor([total], dtype=torch.int32, device=device)
    starts_new = torch.tensor([0, new_tokens], dtype=torch.int32, device=device)
    starts_all = torch.tensor([0, total], dtype=torch.int32, device=device)
    scale = shape.head_dim**-0.5
    k_dense, v_dense = _dense(k_cache, tables, total), _dense(v_cache, tables, total)
    q_dense = q_all.transpose(0, 1)[None]

    def extend():
        return backend.extend(q_new, k_cache, v_cache, tables, starts_new, lens, scale, max_query_len=new_tokens)

    def recompute():
        return backend.extend(q_all, k_cache, v_cache, tables, starts_all, lens, scale, max_query_len=total)

    def sdpa_recompute():
        return _sdpa_causal(torch, q_dense, k_dense, v_dense, scale)

    expected = sdpa_recompute()[0].transpose(0, 1).float()
    err = max(
        (extend().float() - expected[prefix:]).abs().max().item(),
        (recompute().float() - expected).abs().max().item(),
    )
    row = ExtendRow(str(dtype).removeprefix("torch."), prefix, new_tokens, err)
    if timer is not None:
        row.extend_ms, row.recompute_ms, row.sdpa_recompute_ms = timer(extend), timer(recompute), timer(sdpa_recompute)
    return row


def _print_decode(rows: list[DecodeRow]) -> None:
    print("decode: dtype batch context | kernel ms GB/s peak | sdpa(dense) ms GB/s peak | kernel/sdpa time"
          " | graph ms: kernel peak, sdpa peak | max err")
    for r in rows:
        if r.kernel_ms is None:
            print(f"  {r.dtype:>8} {r.batch:>5} {r.context:>7} | max err {r.max_abs_err:.2e}")
            continue
        graph = ""
        if r.kernel_graph_ms is not None:
            fraction = r.kernel_peak * r.kernel_ms / r.kernel_graph_ms if r.kernel_peak is not None else None
            sdpa_fraction = r.sdpa_peak * r.sdpa_ms / r.sdpa_graph_ms if r.sdpa_peak is not None else None
            graph = f" | {r.kernel_graph_ms:8.4f} {_pct(fraction)}, {r.sdpa_graph_ms:8.4f} {_pct(sdpa_fraction)}"
        print(
            f"  {r.dtype:>8} {r.batch:>5} {r.context:>7} | {r.kernel_ms:8.4f} {r.kernel_gbps:7.0f} {_pct(r.kernel_peak)}"
            f" | {r.sdpa_ms:8.4f} {r.sdpa_gbps:7.0f} {_pct(r.sdpa_peak)} | {r.kernel_ms / r.sdpa_ms:5.2f}x"
            f"{graph} | {r.max_abs_err:.2e}"
        )


def _print_extend(rows: list[ExtendRow]) -> None:
    print("prefix-extend: dtype prefix+new | extend ms | recompute ms (same kernel) | recompute ms (sdpa) | speedup | max err")
    for r in rows:
        if r.extend_ms is None:
            print(f"  {r.dtype:>8} {r.prefix}+{r.new_tokens} | max err {r.max_abs_err:.2e}")
            continue
        print(
            f"  {r.dtype:>8} {r.prefix}+{r.new_tokens} | {r.extend_ms:8.4f} | {r.recompute_ms:8.4f}"
            f" | {r.sdpa_recompute_ms:8.4f} | {r.recompute_ms / r.extend_ms:5.1f}x vs kernel,"
            f" {r.sdpa_recompute_ms / r.extend_ms:5.1f}x vs sdpa | {r.max_abs_err:.2e}"
        )


def _pct(fraction: float | None) -> str:
    return "  n/a" if fraction is None else f"{fraction:5.0%}"


def _parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0, 1 if a kernel disagrees with SDPA, 2 if it cannot run here."""
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes via the interpreter, no timings")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = parser.parse_args(argv)

    if args.smoke:
        # Before triton is first imported: the kernels are defined for the interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kernels.backend import get_attention_backend

    graph_timer = None
    if args.smoke:
        device, shape, timer, peak = torch.device("cpu"), Shape(8, 2, 64, 16), None, None
        dtypes, batches, contexts = [torch.float32, torch.float16], [2], [100]
        prefix, new_tokens = 40, 9
        print("smoke run on CPU through Triton's interpreter: correctness only, no timings")
    else:
        if not torch.cuda.is_available():
            print("bench.kernels needs a CUDA GPU (none here); `--smoke` checks the code paths on CPU", file=sys.stderr)
            return 2
        import triton.testing

        device, shape = torch.device("cuda"), Shape()
        dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
        batches, contexts = _parse_ints(args.batches), _parse_ints(args.contexts)
        prefix, new_tokens = args.prefix, args.new_tokens

        def timer(fn) -> float:
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

        def graph_timer(fn) -> float:
            return cuda_graph_ms(torch, fn)

        name = torch.cuda.get_device_name(device)
        peak = peak_bandwidth(name)
        print(f"device: {name}; HBM peak {'unknown' if peak is None else f'{peak / 1e12:.2f} TB/s'}")
        print(f"shape: {shape}; torch {torch.__version__}, triton {triton.__version__}")

    backend = get_attention_backend("triton", device)
    decode_rows, extend_rows = [], []
    for dtype in dtypes:
        for batch in batches:
            for context in contexts:
                decode_rows.append(
                    bench_decode(torch, backend, batch, context, dtype, shape, device, timer, peak, graph_timer)
                )
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        extend_rows.append(bench_extend(torch, backend, prefix, new_tokens, dtype, shape, device, timer))
    _print_decode(decode_rows)
    _print_extend(extend_rows)

    for r in decode_rows:
        if (r.dtype, r.batch, r.context) == TARGET[:3] and r.kernel_peak is not None:
            verdict = "met" if r.kernel_peak >= TARGET[3] else "NOT met"
            graph = ""
            if r.kernel_graph_ms is not None:
                graph = f"; {r.kernel_peak * r.kernel_ms / r.kernel_graph_ms:.0%} in graph replay"
            print(f"target: decode {r.dtype} batch {r.batch} x {r.context} at {r.kernel_peak:.0%} of peak"
                  f" (goal {TARGET[3]:.0%}): {verdict}{graph}")
    wrong = [r for r in [*decode_rows, *extend_rows] if r.max_abs_err > TOLERANCE[r.dtype]]
    for r in wrong:
        print(f"MISMATCH vs SDPA: {r}", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"decode": [asdict(r) for r in decode_rows], "extend": [asdict(r) for r in extend_rows]}, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
