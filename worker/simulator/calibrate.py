"""Check the latency model against a real GPU: time a model profile's shapes with torch.

    python -m worker.simulator.calibrate --gpu H200 --model llama-3-8b [--device cuda]

Builds one decoder layer of the profile's shape with random bf16 weights (QKV, output, SwiGLU
projections; flash attention through ``scaled_dot_product_attention`` with GQA), runs it
``num_layers`` times per step (each layer with its own KV buffers) under a CUDA graph (so kernel launches do not count), plus the LM
head for the rows that sample, and times prefill and decode steps with CUDA events. For each case
it prints the measured time, the latency model's prediction, and the fractions of peak compute
and peak bandwidth the measurement reached — the efficiencies the model assumes (0.6 / 0.75).
Plain torch, no fused kernels beyond SDPA: a lower bound on what a serving engine reaches.
"""
from __future__ import annotations

import argparse
import json

from worker.simulator.latency import LatencyModel, StepShape
from worker.simulator.profiles import get_gpu, get_model

PREFILL_CASES = ((512, 0), (2048, 0), (8192, 0), (512, 7680))  # (new tokens, cached tokens)
DECODE_CASES = ((1, 1024), (16, 1024), (64, 2048), (256, 1024))  # (batch, context per sequence)


def _timed(fn, device: str, iters: int = 10) -> float:
    """Median seconds of ``fn`` (a CUDA graph replay on GPU, a plain call on CPU)."""
    import torch

    if device == "cpu":
        import time
        times = []
        for _ in range(max(2, iters // 5)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _layer(model, device: str, dtype):
    import torch

    h, hd = model.hidden_size, model.head_dim
    q_dim, kv_dim = model.num_heads * hd, model.num_kv_heads * hd
    inter = int(round((model.matmul_params - model.vocab_size * h) / model.num_layers - 2 * h * q_dim
                      - 2 * h * kv_dim) / (3 * h))
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)
    return {"qkv": w(h, q_dim + 2 * kv_dim), "o": w(q_dim, h), "gate_up": w(h, 2 * inter), "down": w(inter, h),
            "lm_head": w(h, model.vocab_size)}, inter


def _step_fn(model, weights, x, caches, cached: int, causal_bias, sample_rows: int):
    """One forward step of ``num_layers`` identical layers over ``x`` ([batch, new, hidden]).

    ``caches`` holds one (K, V) buffer pair per layer, ``cached + new`` positions long: the new
    tokens' KV is written after the ``cached`` ones and attention reads the whole buffer in place,
    as a paged-attention kernel would (no copies).
    """
    import torch.nn.functional as F

    hd, nh, nkv = model.head_dim, model.num_heads, model.num_kv_heads
    batch, new = x.shape[0], x.shape[1]

    def fn():
        h = x
        for kc, vc in caches:
            qkv = h @ weights["qkv"]
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(batch, new, nh, hd).transpose(1, 2)
            kc[:, :, cached:] = k.view(batch, new, nkv, hd).transpose(1, 2)
            vc[:, :, cached:] = v.view(batch, new, nkv, hd).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, kc, vc, attn_mask=causal_bias, enable_gqa=True)
            h = h + attn.transpose(1, 2).reshape(batch, new, nh * hd) @ weights["o"]
            gate, up = (h @ weights["gate_up"]).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ weights["down"]
        return h[:, -1:, :].reshape(-1, h.shape[-1])[:sample_rows] @ weights["lm_head"]
    return fn


def run(gpu_name: str, model_name: str, device: str = "cuda", small: bool = False) -> list[dict]:
    """Time every case; return one record per case."""
    import torch
    from torch.nn.attention.bias import causal_lower_right

    gpu, model = get_gpu(gpu_name), get_model(model_name)
    if small:  # a CPU smoke run of the script itself
        from dataclasses import replace
        model = replace(model, num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                        vocab_size=512, num_params=2 * 12 * 256 * 256 + 2 * 512 * 256)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    weights, _ = _layer(model, device, dtype)
    ideal = LatencyModel(gpu, model, tp=1, compute_efficiency=1.0, bandwidth_efficiency=1.0,
                         step_overhead_s=0.0, min_kv_fraction=0.0)
    default = LatencyModel(gpu, model, tp=1, min_kv_fraction=0.0)
    out = []
    cases = [("prefill", n, c, 1) for n, c in PREFILL_CASES] + [("decode", 1, ctx - 1, b) for b, ctx in DECODE_CASES]
    for kind, new, cached, batch in cases:
        if small:
            new, cached, batch = min(new, 64), min(cached, 64), min(batch, 4)
        shape = StepShape()
        for _ in range(batch):
            if kind == "prefill":
                shape.add_prefill(new, cached, samples=True)
            else:
                shape.add_decode(cached + 1)
        x = torch.randn(batch, new, model.hidden_size, device=device, dtype=dtype) * 0.02
        caches = [(torch.randn(batch, model.num_kv_heads, cached + new, model.head_dim, device=device, dtype=dtype),
                   torch.randn(batch, model.num_kv_heads, cached + new, model.head_dim, device=device, dtype=dtype))
                  for _ in range(model.num_layers)]
        bias = causal_lower_right(new, cached + new) if new > 1 else None
        t = _timed(_step_fn(model, weights, x, caches, cached, bias, batch), device)
        del caches
        compute, memory = ideal.flops(shape) / ideal.flops_per_s, ideal.bytes_moved(shape) / ideal.bytes_per_s
        out.append({"case": kind, "new": new, "cached": cached, "batch": batch, "measured_ms": t * 1e3,
                    "model_ms": default.step_time(shape) * 1e3, "compute_fraction": compute / t,
                    "bandwidth_fraction": memory / t})
    return out


def main(argv: list[str] | None = None) -> int:
    """Print a table (and the records as JSON lines with ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test of the script)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    records = run(args.gpu, args.model, args.device, args.small)
    print("case     new  cached  batch  measured_ms  model_ms  of_peak_compute  of_peak_bandwidth")
    for r in records:
        print(f"{r['case']:<7} {r['new']:>4} {r['cached']:>7} {r['batch']:>6} {r['measured_ms']:>12.3f} "
              f"{r['model_ms']:>9.3f} {r['compute_fraction']:>16.3f} {r['bandwidth_fraction']:>18.3f}")
    if args.json:
        for r in records:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
