"""Decode attention over pages: the gather path against plain attention over each row's contiguous KV."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvwake.daemon.kv.pages import PageLayout, PagePool
from kvwake.daemon.model import paged_attention

KV_HEADS, HEAD_DIM, PAGE = 2, 16, 8


def filled(lengths: list[int], dtype: mx.Dtype, seed: int) -> tuple[PagePool, list[tuple[mx.array, mx.array]]]:
    """A one-layer pool holding one session per row, rows appended in turns (so their pages interleave),
    and each row's K and V as it was written."""
    mx.random.seed(seed)
    layout = PageLayout(layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_tokens=PAGE, block_tokens=PAGE,
                        dtype=dtype)
    pool = PagePool(layout, capacity=sum(-(-n // PAGE) for n in lengths) + 1)
    written: list[list[tuple[mx.array, mx.array]]] = [[] for _ in lengths]
    for r in range(len(lengths)):
        pool.open(f"r{r}")
    for step in range(0, max(lengths), 5):  # five tokens a turn: pages of different rows interleave
        for r, n in enumerate(lengths):
            count = min(5, n - step)
            if count > 0:
                k, v = (mx.random.normal((KV_HEADS, count, HEAD_DIM)).astype(dtype) for _ in range(2))
                pool.append(f"r{r}", [k], [v])
                written[r].append((k, v))
    rows = [(mx.concatenate([k for k, _ in w], axis=1), mx.concatenate([v for _, v in w], axis=1)) if w else None
            for w in written]
    return pool, rows


def table_of(pool: PagePool, rows: int) -> tuple[mx.array, mx.array]:
    tables = [pool.table(f"r{r}").pages for r in range(rows)]
    width = max(1, *(len(t) for t in tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    return mx.array(padded, mx.int32), mx.array([pool.table(f"r{r}").tokens for r in range(rows)], mx.int32)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("q_heads", [2, 8])  # plain, and four query heads per KV head
def test_gather_path_is_plain_attention_over_each_rows_contiguous_kv(dtype: mx.Dtype, q_heads: int) -> None:
    lengths = [1, 37, 8, 64, 13]  # ragged: one token, page-aligned, a partial last page
    pool, rows = filled(lengths, dtype, seed=len(lengths) + q_heads)
    queries = mx.random.normal((len(lengths), q_heads, HEAD_DIM)).astype(dtype)
    table, sizes = table_of(pool, len(lengths))
    scale = HEAD_DIM ** -0.5
    out = paged_attention.gather_attention(queries, pool.keys[0], pool.values[0], table, sizes, scale, PAGE)
    assert out.shape == (len(lengths), q_heads, HEAD_DIM) and out.dtype == dtype
    for r, (k, v) in enumerate(rows):
        alone = mx.fast.scaled_dot_product_attention(queries[r][None, :, None], k[None], v[None], scale=scale)
        assert mx.array_equal(out[r], alone[0, :, 0]).item(), f"row {r} of {lengths[r]} tokens"


def test_gather_path_computes_attention() -> None:
    """Against softmax(q k^T * scale) v written out in float32, each query head over its KV head."""
    lengths = [19, 3]
    pool, rows = filled(lengths, mx.float32, seed=7)
    queries = mx.random.normal((2, 4, HEAD_DIM))
    table, sizes = table_of(pool, 2)
    out = paged_attention.gather_attention(queries, pool.keys[0], pool.values[0], table, sizes, 0.3, PAGE)
    for r, (k, v) in enumerate(rows):
        kv_head = mx.array([0, 0, 1, 1])  # query heads 0-1 read KV head 0, 2-3 KV head 1
        scores = (queries[r][:, None] * k[kv_head]).sum(-1) * 0.3  # [q_heads, tokens]
        expected = (mx.softmax(scores, axis=-1)[..., None] * v[kv_head]).sum(1)
        assert mx.allclose(out[r], expected, atol=1e-5).item()


def test_a_row_of_no_tokens_gives_zeros() -> None:
    pool, _ = filled([0, 9], mx.float32, seed=3)
    queries = mx.random.normal((2, 2, HEAD_DIM))
    table, sizes = table_of(pool, 2)
    out = paged_attention.gather_attention(queries, pool.keys[0], pool.values[0], table, sizes, 0.25, PAGE)
    assert mx.array_equal(out[0], mx.zeros((2, HEAD_DIM))).item() and not mx.array_equal(out[1], 0).item()


def test_spans_cover_the_longest_row_in_about_the_target_blocks() -> None:
    assert paged_attention.split_tokens(rows=1, kv_heads=8, max_tokens=1024) == paged_attention.MIN_SPLIT
    split = paged_attention.split_tokens(rows=32, kv_heads=8, max_tokens=12288)
    assert split % 64 == 0 and 32 * 8 * -(-12288 // split) <= paged_attention.TARGET_BLOCKS


def _cuda() -> bool:
    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="the paged kernel is a CUDA kernel: MLX does not run on CUDA here")
@pytest.mark.parametrize("dtype,bound", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("split", [None, 64])  # one span for short rows, and many
def test_the_cuda_kernel_agrees_with_the_gather_path(dtype: mx.Dtype, bound: float, split: int | None) -> None:
    lengths = [1, 37, 8, 64, 13, 0, 300]
    pool, _ = filled(lengths, dtype, seed=11)
    queries = mx.random.normal((len(lengths), 8, HEAD_DIM)).astype(dtype)
    table, sizes = table_of(pool, len(lengths))
    args = (queries, pool.keys[0], pool.values[0], table, sizes, HEAD_DIM ** -0.5, PAGE)
    ref = paged_attention.gather_attention(*args).astype(mx.float32)
    got = paged_attention.kernel_attention(*args, split=split)
    assert got.dtype == dtype and mx.abs(got.astype(mx.float32) - ref).max().item() <= bound
