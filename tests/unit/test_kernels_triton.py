"""The Triton kernels, run by Triton's CPU interpreter, against the torch references and SDPA.
(With PREFIXLB_KERNELS_TEST_DEVICE=cuda, the same cases run compiled on a GPU.)

Why a child process: the interpreter is chosen when a kernel is *defined* (`@triton.jit` reads
`TRITON_INTERPRET`), so it must be on before `kernels.triton_*` is first imported, and setting it
in the pytest process would leak into every other test and every process they spawn. A kernel
with an out-of-bounds address (say an int32 offset that wrapped) also segfaults the interpreter.
So the kernels run in one spawned child that switches the interpreter on before it imports
anything of triton; tensors go over the pipe, and a crash there fails the test that caused it
instead of killing the whole run. The references and SDPA run here, in the test process.

Tolerances, per dtype (outputs are convex combinations of N(0, 1) values, |out| < ~3):
- fp32: both sides accumulate in fp32 with exact (IEEE, not TF32) products; only the summation
  order differs: 1e-5.
- fp16: the kernel rounds the softmax weights to fp16 before the PV product, as flash attention
  does, and rounds the output to fp16; the references compute in fp32 from the same fp16 inputs:
  2e-3 absolute + 2e-3 relative, a few fp16 ulps.
- bf16 (only with PREFIXLB_KERNELS_TEST_DEVICE=cuda; the interpreter has no bf16): 2e-2, a few
  bf16 ulps.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch
import torch.nn.functional as F

from kernels import attention_ref

# On a CUDA machine, PREFIXLB_KERNELS_TEST_DEVICE=cuda runs the same cases on the compiled kernels
# (inputs built and checked here on CPU, moved to the GPU in the child), adding bf16.
DEVICE = os.environ.get("PREFIXLB_KERNELS_TEST_DEVICE", "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


# ---- the child process ---------------------------------------------------------------------

def _prepare_child() -> None:
    """Pool initializer: runs in the child before anything there imports triton."""
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"


def _moved(value, device: str):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device) for v in value)
    return value


def _backend():
    from kernels.backend import get_attention_backend

    return get_attention_backend("triton", DEVICE)


def _triton(op: str, *args, **kwargs):
    out = getattr(_backend(), op)(*_moved(args, DEVICE), **kwargs)
    return _moved(out, "cpu")


def _triton_write_kv(k, v, k_cache, v_cache, slot_mapping):
    k, v, k_cache, v_cache, slot_mapping = _moved((k, v, k_cache, v_cache, slot_mapping), DEVICE)
    _backend().write_kv(k, v, k_cache, v_cache, slot_mapping)
    return _moved((k_cache, v_cache), "cpu")


def _mapped_cache(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A cache backed by a sparse file: a huge block-id space, only touched pages exist."""
    numel = 1
    for n in shape:
        numel *= n
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def _triton_on_mapped_caches(paths, shape, dtype, k, v, slot_mapping, decode_args, extend_args):
    mapped = [_mapped_cache(p, shape, dtype) for p in paths]
    k_cache, v_cache = _moved(mapped, DEVICE)
    backend = _backend()
    backend.write_kv(*_moved((k, v), DEVICE), k_cache, v_cache, slot_mapping.to(DEVICE))
    decode_args, extend_args = _moved(decode_args, DEVICE), _moved(extend_args, DEVICE)
    decoded = backend.decode(decode_args[0], k_cache, v_cache, *decode_args[1:])
    extended = backend.extend(extend_args[0], k_cache, v_cache, *extend_args[1:])
    if DEVICE != "cpu":  # write back only the touched blocks: the files stay sparse
        touched = torch.unique(slot_mapping // shape[1])
        for host, device_cache in zip(mapped, (k_cache, v_cache)):
            host[touched] = device_cache[touched.to(DEVICE)].cpu()
    return _moved((decoded, extended), "cpu")


class KernelProcess:
    """Calls functions of this module in a spawned child (interpreter on, unless on CUDA)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, fn, *args, **kwargs):
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_prepare_child
            )
        try:
            return self._pool.submit(fn, *args, **kwargs).result(timeout=240)
        except BrokenProcessPool:
            self._pool = None
            raise AssertionError("the kernel process died: a kernel touched memory out of bounds") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


@pytest.fixture(scope="module")
def run_triton():
    kernels = KernelProcess()
    yield kernels
    kernels.close()


# ---- problems ------------------------------------------------------------------------------

def _paged_problem(seed, num_kv_heads, group, head_dim, block_size, dtype, context_lens, shared_blocks):
    """Random caches and block tables: physical blocks shuffled (non-contiguous), sequence 1
    reusing sequence 0's first `shared_blocks` blocks (a shared prefix), tables padded with -1
    (never read)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for s, n in enumerate(blocks_per_seq):
        table = tables[0][:shared_blocks] if s == 1 else []
        while len(table) < n:
            table.append(free.pop())
        tables.append(table)
    width = max(blocks_per_seq) + 2
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, block_tables


def _sdpa_on_gathered(q, k_cache, v_cache, table, context_len, scale, causal_rows=None):
    """`scaled_dot_product_attention` in fp32 on the sequence's KV gathered from the cache."""
    k = attention_ref.gather_kv(k_cache, table, context_len).float().transpose(0, 1)
    v = attention_ref.gather_kv(v_cache, table, context_len).float().transpose(0, 1)
    mask = None
    if causal_rows is not None:
        positions = torch.arange(context_len - causal_rows, context_len)
        mask = torch.arange(context_len)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


SHAPES = [  # (group, head_dim, block_size): GQA ratios 1/4/8, head dims 64/128, block sizes 16/32
    (1, 64, 16), (1, 128, 32), (4, 64, 32), (4, 128, 16), (8, 64, 16), (8, 128, 32),
]


# ---- write_kv --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_places_tokens_exactly_where_the_reference_does_and_skips_padding(run_triton, dtype):
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(9, 16, 2, 64, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(6, 2, 64, generator=gen)  # fp32 input into the cache dtype: same rounding
    v = torch.randn(6, 2, 64, generator=gen)
    slots = torch.tensor([0, 17, -1, 143, 31, -5], dtype=torch.int64)

    got_k, got_v = run_triton(_triton_write_kv, k, v, k_cache.clone(), v_cache.clone(), slots)
    attention_ref.write_kv(k, v, k_cache, v_cache, slots)

    assert torch.equal(got_k, k_cache)
    assert torch.equal(got_v, v_cache)
    assert int((got_k != 0).any(dim=(2, 3)).sum()) == 4  # four real tokens, two padding


# ---- paged decode --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("group,head_dim,block_size", SHAPES)
def test_decode_matches_reference_and_sdpa(run_triton, group, head_dim, block_size, dtype):
    # 70 and 45 are not multiples of 16 or 32; 1 is a single-token context.
    context_lens = [70, 45, 1]
    num_kv_heads = 2
    k_cache, v_cache, tables = _paged_problem(
        7, num_kv_heads, group, head_dim, block_size, dtype, context_lens, shared_blocks=45 // block_size
    )
    q = torch.randn(3, num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5

    # Default partition (one split on CPU) and 64-token partitions: 70 tokens -> 2 splits, 45 ->
    # 1 split and an empty one, 1 -> 1 split and an empty one, merged by the second kernel.
    whole = run_triton(_triton, "decode", q, k_cache, v_cache, tables, lens, scale)
    split = run_triton(_triton, "decode", q, k_cache, v_cache, tables, lens, scale, partition_size=64)
    expected = attention_ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)

    assert whole.dtype == dtype
    torch.testing.assert_close(whole, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(split, expected, **TOLERANCE[dtype])
    for s, n in enumerate(context_lens):
        sdpa = _sdpa_on_gathered(q[s : s + 1], k_cache, v_cache, tables[s], n, scale)
        torch.testing.assert_close(split[s : s + 1].float(), sdpa, **TOLERANCE[dtype])


def test_decode_of_a_zero_length_padding_row_is_zero_with_and_without_splits(run_triton):
    k_cache, v_cache, tables = _paged_problem(3, 1, 4, 64, 16, torch.float32, [20, 0], shared_blocks=0)
    q = torch.randn(2, 4, 64)
    lens = torch.tensor([20, 0], dtype=torch.int32)

    for partition in (None, 64):
        out = run_triton(_triton, "decode", q, k_cache, v_cache, tables, lens, 0.125, partition_size=partition)
        assert torch.equal(out[1], torch.zeros(4, 64))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "block_n,partition,num_warps,num_stages",
    # Tiles smaller than a block (16 < 32) and larger (64, 128); partitions of 3 tiles (48, 96:
    # 70 tokens -> splits of 48+22 / 70+0), none (one split), one tile (128).
    [(16, 48, 2, 2), (32, 96, 4, 3), (64, None, 8, 4), (128, 128, 4, 2)],
)
def test_decode_tiling_knobs_change_the_schedule_not_the_result(run_triton, block_n, partition, num_warps, num_stages):
    context_lens = [70, 45, 1]
    k_cache, v_cache, tables = _paged_problem(7, 2, 4, 128, 32, torch.float16, context_lens, shared_blocks=1)
    q = torch.randn(3, 8, 128, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    lens = torch.tensor(context_lens, dtype=torch.int32)

    out = run_triton(
        _triton, "decode", q, k_cache, v_cache, tables, lens, 0.088,
        partition_size=partition, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
    )

    expected = attention_ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.088)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float16])


def _triton_decode_into(q, k_cache, v_cache, tables, lens, scale, out, partition_size):
    q, k_cache, v_cache, tables, lens, out = _moved((q, k_cache, v_cache, tables, lens, out), DEVICE)
    result = _backend().decode(q, k_cache, v_cache, tables, lens, scale, out=out, partition_size=partition_size)
    return result.data_ptr() == out.data_ptr(), _moved(out, "cpu")


@pytest.mark.parametrize("partition", [None, 64])
def test_decode_writes_into_a_given_out_tensor_with_and_without_splits(run_triton, partition):
    k_cache, v_cache, tables = _paged_problem(5, 2, 4, 64, 16, torch.float32, [70, 45], shared_blocks=0)
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4))
    lens = torch.tensor([70, 45], dtype=torch.int32)
    poisoned = torch.full_like(q, float("nan"))

    same, out = run_triton(_triton_decode_into, q, k_cache, v_cache, tables, lens, 0.125, poisoned, partition)

    assert same
    expected = attention_ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_decode_refuses_a_partition_that_is_not_a_multiple_of_16(run_triton):
    k_cache, v_cache, tables = _paged_problem(5, 1, 4, 64, 16, torch.float32, [20], shared_blocks=0)
    q = torch.randn(1, 4, 64)

    with pytest.raises(ValueError, match="multiple of 16"):
        run_triton(_triton, "decode", q, k_cache, v_cache, tables, torch.tensor([20], dtype=torch.int32), 0.125,
                   partition_size=40)


def _partition_for_waves(*args):
    from kernels.triton_decode import partition_for_waves

    return partition_for_waves(*args)


@pytest.mark.parametrize(
    "tiles,programs_per_split,expected",
    [
        (128, 512, 128),  # batch 64 x 8 KV heads x 4K: 512 programs fit one wave of 660: one split
        (128, 640, 128),  # 640 still fit one wave
        (128, 768, 43),  # one split: a full wave plus 108 programs; 3 splits of 43 tiles cost less
        (512, 8, 12),  # one sequence x 16K: 43 splits, 344 programs, just over the 330 that saturate
    ],
)
def test_decode_splits_are_chosen_by_counting_waves(run_triton, tiles, programs_per_split, expected):
    # An H200 with the CUDA tiling: 132 SMs x 5 programs = 660 slots, 330 programs saturate HBM;
    # partitions of at least 4 tiles (128 tokens in tiles of 32).
    assert run_triton(_partition_for_waves, tiles, programs_per_split, 660, 330.0, 4) == expected


# ---- prefix extend ---------------------------------------------------------------------------

# (context_len, new tokens) per sequence: 70 cached + 40 new (two query tiles of 32; key tiles
# before the first query need no causal mask at tiles of 32 and 64); 32 cached (blocks shared
# with sequence 0) + 13 new; no prefix and one token; no prefix, 37 new.
EXTEND_SEQS = [(110, 40), (45, 13), (1, 1), (37, 37)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("group,head_dim,block_size", SHAPES)
def test_extend_matches_reference_and_causal_sdpa(run_triton, group, head_dim, block_size, dtype):
    context_lens = [n for n, _ in EXTEND_SEQS]
    q_lens = [m for _, m in EXTEND_SEQS]
    num_kv_heads = 1 if group == 8 else 2
    k_cache, v_cache, tables = _paged_problem(
        11, num_kv_heads, group, head_dim, block_size, dtype, context_lens, shared_blocks=32 // block_size
    )
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5

    out = run_triton(_triton, "extend", q, k_cache, v_cache, tables, starts, lens, scale)
    # The GPU's tile shape too: one query tile per sequence here.
    out_64 = run_triton(_triton, "extend", q, k_cache, v_cache, tables, starts, lens, scale, tiles=(64, 64))
    expected = attention_ref.prefix_extend_attention(q, k_cache, v_cache, tables, starts, lens, scale)

    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(out_64, expected, **TOLERANCE[dtype])
    for s, (n, m) in enumerate(EXTEND_SEQS):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        sdpa = _sdpa_on_gathered(q[rows], k_cache, v_cache, tables[s], n, scale, causal_rows=m)
        torch.testing.assert_close(out[rows].float(), sdpa, **TOLERANCE[dtype])


# ---- 64-bit offsets ----------------------------------------------------------------------------

def test_block_ids_past_the_int32_element_offset_are_read_and_written_correctly(run_triton, tmp_path):
    # With block_size 16, 1 KV head and head_dim 64, a block is 1,024 elements, so block ids from
    # 2^21 on put the element offset past 2^31: int32 index arithmetic would wrap to a negative
    # offset (the interpreter then reads outside the cache and dies, a GPU reads garbage). The
    # caches are sparse files mapped shared by both processes: 4 GiB of fp16 each in address space,
    # only the touched pages materialised.
    block_size, head_dim, dtype = 16, 64, torch.float16
    num_blocks = 2**21 + 8
    shape = (num_blocks, block_size, 1, head_dim)
    paths = []
    for name in ("k", "v"):
        path = tmp_path / f"{name}_cache.bin"
        with open(path, "wb") as f:
            f.truncate(num_blocks * block_size * head_dim * 2)
        paths.append(str(path))
    gen = torch.Generator().manual_seed(9)
    table = [num_blocks - 1, 12, 2**21 + 3, 2**21]  # high, low, high, exactly 2^21
    context_len = 55
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(context_len)])
    k = torch.randn(context_len, 1, head_dim, generator=gen).to(dtype)
    v = torch.randn(context_len, 1, head_dim, generator=gen).to(dtype)
    tables = torch.tensor([table], dtype=torch.int32)
    lens = torch.tensor([context_len], dtype=torch.int32)
    q_decode = torch.randn(1, 4, head_dim, generator=gen).to(dtype)
    q_extend = torch.randn(20, 4, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, 20], dtype=torch.int32)

    decoded, extended = run_triton(
        _triton_on_mapped_caches, paths, shape, dtype, k, v, slots,
        (q_decode, tables, lens, 0.125), (q_extend, tables, starts, lens, 0.125),
    )

    k_cache, v_cache = (_mapped_cache(p, shape, dtype) for p in paths)  # sees the child's writes
    assert torch.equal(attention_ref.gather_kv(k_cache, tables[0], context_len), k)
    assert torch.equal(attention_ref.gather_kv(v_cache, tables[0], context_len), v)
    expected_decode = attention_ref.paged_decode_attention(q_decode, k_cache, v_cache, tables, lens, 0.125)
    expected_extend = attention_ref.prefix_extend_attention(q_extend, k_cache, v_cache, tables, starts, lens, 0.125)
    torch.testing.assert_close(decoded, expected_decode, **TOLERANCE[dtype])
    torch.testing.assert_close(extended, expected_extend, **TOLERANCE[dtype])
