"""bench/kernels.py and bench/kernels_sweep.py off the GPU: accounting, SDPA baselines, the
sweep's candidates and flow, and their refusal on CPU.

The GPU numbers themselves can only come from a CUDA machine; these tests check that what the
benchmark computes around the timings is right, using the torch reference backend as the kernel
and a timer that reports a fixed duration.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench import kernels as bench_kernels
from bench import kernels_sweep
from kernels.backend import TORCH_BACKEND

SMALL = bench_kernels.Shape(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA A100-SXM4-80GB", 2.0e12),
        ("NVIDIA A100-SXM4-40GB", 1.555e12),
        ("Tesla T4", None),
    ],
)
def test_peak_bandwidth_is_looked_up_by_device_name(name, peak):
    assert bench_kernels.peak_bandwidth(name) == peak


def test_decode_row_counts_kv_and_qo_bytes_and_derives_bandwidth_and_peak_fraction():
    row = bench_kernels.bench_decode(
        torch, TORCH_BACKEND, 2, 100, torch.float32, SMALL, torch.device("cpu"), timer=lambda fn: 0.5, peak=1e12
    )

    # K and V: 2 x batch 2 x 100 tokens x 2 kv heads x 64 x 4 bytes; Q and O: 2 x 2 x 8 heads x 64 x 4.
    assert row.bytes_moved == 204_800 + 8_192
    assert row.kernel_gbps == pytest.approx(212_992 / 0.5 / 1e6)
    assert row.kernel_peak == pytest.approx(212_992 / 0.5e-3 / 1e12)
    # The folded-GQA SDPA baseline computes the same attention as the reference.
    assert row.max_abs_err < 1e-5


def test_extend_row_agrees_with_causal_sdpa_for_both_extend_and_recompute():
    row = bench_kernels.bench_extend(
        torch, TORCH_BACKEND, 40, 9, torch.float32, SMALL, torch.device("cpu"), timer=lambda fn: 1.0
    )

    assert (row.prefix, row.new_tokens) == (40, 9)
    assert row.max_abs_err < 1e-5
    assert (row.extend_ms, row.recompute_ms, row.sdpa_recompute_ms) == (1.0, 1.0, 1.0)


def test_full_benchmark_refuses_without_cuda_and_says_how_to_smoke_test():
    result = subprocess.run([sys.executable, "-m", "bench.kernels"], capture_output=True, text=True)

    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr
    assert result.stdout == ""


def test_smoke_run_checks_the_triton_kernels_on_cpu_without_printing_timings():
    result = subprocess.run([sys.executable, "-m", "bench.kernels", "--smoke"], capture_output=True, text=True)

    assert result.returncode == 0, result.stderr
    assert "correctness only, no timings" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("  ")]
    # Two dtypes x (one decode shape + one extend shape); each row is only its max error.
    assert [row[0] for row in rows] == ["float32", "float16", "float32", "float16"]
    assert all(row[-3:-1] == ["max", "err"] for row in rows)


def test_graph_timer_fills_the_device_time_columns_of_a_decode_row():
    row = bench_kernels.bench_decode(
        torch, TORCH_BACKEND, 2, 100, torch.float32, SMALL, torch.device("cpu"),
        timer=lambda fn: 0.5, peak=1e12, graph_timer=lambda fn: 0.25,
    )

    assert (row.kernel_ms, row.kernel_graph_ms, row.sdpa_graph_ms) == (0.5, 0.25, 0.25)


def test_sweep_tries_one_partition_per_split_count_down_to_128_tokens_and_8192_programs():
    assert kernels_sweep.split_candidates(1024, 8, 64) == [1024, 512, 384, 256, 192, 128]
    # Batch 64 x 8 KV heads: 512 programs per split, so at most 16 splits.
    assert kernels_sweep.split_candidates(16384, 512, 64) == [16384, 8192, 5504, 4096, 3328, 2752, 2048, 1408, 1024]


def test_sweep_refuses_without_cuda():
    result = subprocess.run([sys.executable, "-m", "bench.kernels_sweep"], capture_output=True, text=True)

    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr


def test_sweep_smoke_run_checks_every_variant_against_sdpa_on_cpu(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.kernels_sweep", "--smoke", "--tilings", "32x4x2", "--out", str(tmp_path)],
        capture_output=True, text=True,
    )

    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    # Context 300 in tiles of 32: partitions of 320, 160 and 128 tokens (1, 2 and 3 splits).
    assert [(r["variant"], r["splits"]) for r in rows] == [
        ("sdpa", None), ("default", 1), ("32x4x2", 1), ("32x4x2", 2), ("32x4x2", 3), ("occupancy", None),
    ]
    assert all(r["ok"] for r in rows)
    assert "failures: 0" in (tmp_path / "summary.txt").read_text()
