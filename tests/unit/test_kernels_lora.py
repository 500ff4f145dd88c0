"""The multi-LoRA ops: torch references against the definition, Triton kernels against both.

The definition is the per-token loop ``y[t] += B[s_t] @ (A[s_t] @ x[t])`` in float64; the
references group rows by slot, the kernels tile and mask. Kernels run in the spawned
interpreter child of ``test_kernels_triton`` (same reasons, same tolerances; with
PREFIXLB_KERNELS_TEST_DEVICE=cuda they run compiled on a GPU and bf16 is added).

Shapes are chosen to hit the edges: K and N are not multiples of any tile, ranks are below the
tile's 16 (padded), ``y`` is a column slice of a wider fused output (row stride != N), slot 0
holds NaN (so a kernel that reads it instead of skipping it poisons the output).
"""
from __future__ import annotations

import pytest
import torch

from kernels import lora_ref
from tests.unit.test_kernels_triton import DEVICE, DTYPES, TOLERANCE, KernelProcess, _moved

K, N, R, SLOTS = 96, 80, 8, 4


@pytest.fixture(scope="module")
def run_triton():
    kernels = KernelProcess()
    yield kernels
    kernels.close()


def _backend():
    from kernels.backend import get_lora_backend

    return get_lora_backend("triton", DEVICE)


def _problem(seed: int, num_tokens: int, dtype: torch.dtype):
    """x, the slot stacks (slot 0 = NaN, slot 3 of rank 4 padded with zeros) and a fused output
    ``out`` of which ``y = out[:, 16:16 + N]`` is the slice the op adds into."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, K, generator=gen).to(dtype)
    a = torch.randn(SLOTS, R, K, generator=gen) / K**0.5
    b = torch.randn(SLOTS, N, R, generator=gen) / R**0.5
    a[3, 4:], b[3, :, 4:] = 0.0, 0.0
    a[0], b[0] = float("nan"), float("nan")
    out = torch.randn(num_tokens, N + 40, generator=gen).to(dtype)
    return x, a.to(dtype), b.to(dtype), out


def _definition(out: torch.Tensor, x, a, b, slot_per_row: list[int]) -> torch.Tensor:
    """The per-token loop in float64 on the slice ``out[:, 16:16 + N]``, rounded once."""
    expected = out.clone()
    for t, s in enumerate(slot_per_row):
        if s == 0:
            continue
        delta = b[s].double() @ (a[s].double() @ x[t].double())
        expected[t, 16:16 + N] = (out[t, 16:16 + N].double() + delta).to(out.dtype)
    return expected


BGMV_SLOTS = [0, 2, 1, 2, 0, 3, 1, 1, 3]  # mixed adapters, two rows without one
# (start, length, slot): a segment longer than two 16-row tiles, one of one row, one of slot 0
# between two of the same adapter, and one row left over that no segment covers.
SGMV_SEGMENTS = [(0, 5, 1), (5, 1, 0), (6, 37, 2), (43, 1, 3), (44, 20, 1)]
SGMV_TOKENS = 65


def _segments():
    starts, lens, slots = (torch.tensor(col, dtype=torch.int32) for col in zip(*SGMV_SEGMENTS))
    per_row = [0] * SGMV_TOKENS
    for start, n, s in SGMV_SEGMENTS:
        per_row[start:start + n] = [s] * n
    return starts, lens, slots, per_row


# ---- references -------------------------------------------------------------------------------

def test_bgmv_reference_matches_the_per_token_definition_and_leaves_slot_0_rows_untouched():
    x, a, b, out = _problem(1, len(BGMV_SLOTS), torch.float32)
    got = out.clone()
    lora_ref.bgmv(got[:, 16:16 + N], x, a, b, torch.tensor(BGMV_SLOTS, dtype=torch.int32))

    torch.testing.assert_close(got, _definition(out, x, a, b, BGMV_SLOTS), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[[0, 4]], out[[0, 4]])  # slot 0: bit-identical
    assert torch.equal(got[:, :16], out[:, :16]) and torch.equal(got[:, 16 + N:], out[:, 16 + N:])


def test_sgmv_reference_matches_the_definition_segment_by_segment():
    x, a, b, out = _problem(2, SGMV_TOKENS, torch.float32)
    starts, lens, slots, per_row = _segments()
    got = out.clone()
    lora_ref.sgmv(got[:, 16:16 + N], x, a, b, starts, lens, slots)

    torch.testing.assert_close(got, _definition(out, x, a, b, per_row), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[5], out[5]) and torch.equal(got[64], out[64])


def test_a_zero_b_makes_the_delta_vanish_exactly():
    # PEFT's default initialisation (B = 0): the adapter must change nothing, bit for bit.
    x, a, b, out = _problem(3, 4, torch.float32)
    b[1:] = 0.0
    got = out.clone()
    lora_ref.bgmv(got[:, 16:16 + N], x, a, b, torch.tensor([1, 2, 3, 1], dtype=torch.int32))
    assert torch.equal(got, out)


# ---- Triton kernels ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("tiles", [None, (32, 16)], ids=["default-tiles", "small-tiles"])
def test_bgmv_kernel_matches_the_reference(run_triton, dtype, tiles):
    x, a, b, out = _problem(4, len(BGMV_SLOTS), dtype)
    slot_ids = torch.tensor(BGMV_SLOTS, dtype=torch.int32)
    expected = out.clone()
    lora_ref.bgmv(expected[:, 16:16 + N], x, a, b, slot_ids)

    got = run_triton(_triton_bgmv_into_slice, out.clone(), x, a, b, slot_ids, tiles)

    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    assert torch.equal(got[[0, 4]], out[[0, 4]])
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("tiles", [None, (32, 64, 16)], ids=["default-tiles", "other-tiles"])
def test_sgmv_kernel_matches_the_reference(run_triton, dtype, tiles):
    x, a, b, out = _problem(5, SGMV_TOKENS, dtype)
    starts, lens, slots, _ = _segments()
    expected = out.clone()
    lora_ref.sgmv(expected[:, 16:16 + N], x, a, b, starts, lens, slots)

    got = run_triton(_triton_sgmv_into_slice, out.clone(), x, a, b, starts, lens, slots, tiles)

    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    assert torch.equal(got[5], out[5]) and torch.equal(got[64], out[64])
    assert torch.isfinite(got).all()


def test_kernels_of_an_empty_batch_do_nothing(run_triton):
    x, a, b, out = _problem(6, 0, torch.float32)
    empty = torch.zeros(0, dtype=torch.int32)
    assert run_triton(_triton_bgmv_into_slice, out.clone(), x, a, b, empty, None).shape == (0, N + 40)
    assert run_triton(_triton_sgmv_into_slice, out.clone(), x, a, b, empty, empty, empty, None).shape == (0, N + 40)


def _triton_bgmv_into_slice(out, x, a, b, slot_ids, tiles):
    out, x, a, b, slot_ids = _moved((out, x, a, b, slot_ids), DEVICE)
    _backend().bgmv(out[:, 16:16 + N], x, a, b, slot_ids, tiles=tiles)
    return _moved(out, "cpu")


def _triton_sgmv_into_slice(out, x, a, b, starts, lens, slots, tiles):
    out, x, a, b, starts, lens, slots = _moved((out, x, a, b, starts, lens, slots), DEVICE)
    _backend().sgmv(out[:, 16:16 + N], x, a, b, starts, lens, slots, tiles=tiles)
    return _moved(out, "cpu")
