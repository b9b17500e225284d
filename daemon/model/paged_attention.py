"""Decode attention over pages: one query token per row, rows of any length, no padding and no mask.

Inputs, for one layer: `queries` [rows, q_heads, head_dim] (q_heads a whole
multiple of the KV heads: grouped-query attention), the layer's keys and values
pools [kv_heads, slots, head_dim] (kv/pages.py: page p holds slots
p * page_tokens ..), a page table [rows, max_pages] int32 (row r's pages in
token order; entries past its length are not read) and `lengths` [rows] int32.
The output is [rows, q_heads, head_dim] in the queries' dtype.

Two paths compute it:
- `gather_attention`, everywhere (the reference, and the path on the CPU and on
  Metal): each row's K and V gathered from its pages into one contiguous run,
  then MLX's fused `scaled_dot_product_attention`, so a row's result is what
  that kernel gives over the same KV held contiguously.
- `kernel_attention`, on CUDA: flash-decoding in two `mx.fast.cuda_kernel`s.
  The first splits each row's context into spans of `split` tokens; a block of
  threads per (span, KV head, row) reads the span's K and V once for all the
  query heads of that KV head, keeps an online softmax per head (updated once
  per tile of tokens, in base 2) and writes the span's normalized output and
  its log-sum-exp (float32, base 2). The second combines a row's spans,
  weighted by their sums. So a long row spreads over many blocks
  and a short one wastes none: no row is padded to the longest.
A Metal kernel is not written: it could not be verified here (docs/decisions.md,
"Paged KV (issue 51): pages and the decode kernel"); Metal takes the gather path.
"""

from __future__ import annotations

import threading

import mlx.core as mx

from kvwake.daemon.kv import cudart
from kvwake.daemon.kv.paged_cache import for_fused

__all__ = ["ROW_SPLIT", "THREADS", "constant", "decode_attention", "gather_attention", "gather_rows", "kernel_attention", "row_attention", "split_tokens"]

THREADS = 128  # threads per block of the span kernel: four warps
TARGET_BLOCKS = 2048  # spans x KV heads x rows the split aims at: enough blocks to keep every SM busy
# A thread's query and accumulator floats (each): fewer registers, more blocks resident per SM.
REGISTER_FLOATS = 32
# Tokens in a group's tile (2-byte dtypes; half as many of float32): one softmax rescale a tile, and the next
# tile's loads in flight under this one's arithmetic. Two or four were measured (docs/benchmarks.md).
IN_FLIGHT = 4
# A row's spans over a batch's own buffers (row_attention): a fixed size, so a row's sums run in the same
# order whatever rows share its step (a call decodes the same tokens batched or alone)
ROW_SPLIT = 256
MIN_SPLIT = 128  # a span's partial output is q_heads x head_dim floats: below this it costs a share of the KV
SPAN_PAGES = 64  # the most pages a span of the paged kernel reads (their ids held in shared memory)


def gather_attention(queries: mx.array, keys: mx.array, values: mx.array, page_table: mx.array,
                     lengths: mx.array, scale: float, page_tokens: int) -> mx.array:
    """Each row's attention over its pages, gathered contiguous, through MLX's fused attention (the
    reference). A row of length 0 gives zeros."""
    slots = []
    for pages, length in zip(page_table.tolist(), lengths.tolist(), strict=True):
        pages = mx.array(pages[:-(-length // page_tokens)], mx.int32)
        slots.append((pages[:, None] * page_tokens + mx.arange(page_tokens, dtype=mx.int32)).reshape(-1)[:length])
    return gather_rows(queries, keys, values, slots, scale)


def gather_rows(queries: mx.array, keys: mx.array, values: mx.array, slots: list[slice | mx.array | None],
                scale: float) -> mx.array:
    """Row r's attention over the pools' `slots[r]` (its tokens' slots in order, gathered contiguous; or a
    slice, read in place) through MLX's fused attention; a row with no slots (None or empty) gives zeros."""
    rows = []
    for r, row in enumerate(slots):
        if row is None or (isinstance(row, mx.array) and row.size == 0):
            rows.append(mx.zeros(queries.shape[1:], queries.dtype))
            continue
        out = mx.fast.scaled_dot_product_attention(queries[r][None, :, None], for_fused(keys[:, row][None]),
                                                   for_fused(values[:, row][None]), scale=scale)
        rows.append(out[0, :, 0])
    return mx.stack(rows)


def split_tokens(rows: int, kv_heads: int, max_tokens: int) -> int:
    """Tokens per span: about TARGET_BLOCKS blocks over the longest row, a multiple of 64, at least
    MIN_SPLIT."""
    wanted = -(-rows * kv_heads * max_tokens // TARGET_BLOCKS)
    return max(MIN_SPLIT, -(-wanted // 64) * 64)


_HEADER = """
#define KVW_NEG_INF (-__int_as_float(0x7f800000))  // MLX's kernel header does not define inf in every version
template <typename T, int E>
__device__ inline void load_raw(const T* src, uint4* raw) {
  #pragma unroll
  for (int i = 0; i < E * (int)sizeof(T) / 16; ++i) raw[i] = reinterpret_cast<const uint4*>(src)[i];
}

__device__ inline float kvw_float(float x) { return x; }
__device__ inline float kvw_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float kvw_float(__half x) { return __half2float(x); }
template <typename T> __device__ inline T kvw_from_float(float x);
template <> __device__ inline float kvw_from_float<float>(float x) { return x; }
template <> __device__ inline __nv_bfloat16 kvw_from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ inline __half kvw_from_float<__half>(float x) { return __float2half(x); }

template <typename T, int E>
__device__ inline float element(const uint4* raw, int e) {
  return kvw_float(reinterpret_cast<const T*>(raw)[e]);
}
"""

# One block per (span, KV head, row); groups of TPT threads take one token each, a thread E = D / TPT of
# its dims. A group's tokens come in tiles of U: the tile's scores first, then one softmax update for the tile
# (a rescale of the accumulators a tile, not a token), then its values. The next tile's keys are loaded while
# this tile's scores are summed and its values used, and its values while the next scores are computed: the
# loads stay in flight under the arithmetic. Scores are in base 2 (the queries carry scale * log2 e), so
# each exponential is one exp2f; the span's log-sum-exp is written in base 2 too, and the combine reads it so.
_SPANS = """
constexpr int E = D / TPT, GROUPS = THREADS / TPT, WARPS = THREADS / 32, RAW = E * (int)sizeof(T) / 16;
constexpr int STEP = GROUPS * U;
const int span = blockIdx.x, h = blockIdx.y, row = blockIdx.z, spans = gridDim.x;
const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, group = tid / TPT, sub = tid % TPT;
const int q_heads = queries_shape[1], max_pages = page_table_shape[1];
const long slots = keys_shape[1];
const int start = span * split[0], stop = min(lengths[row], start + split[0]);
const float q_scale = scale[0] * 1.4426950408889634f;
float q[G][E], acc[G][E], m[G], l[G];
#pragma unroll
for (int g = 0; g < G; ++g) {
  uint4 raw[RAW];
  load_raw<T, E>(queries + ((long)row * q_heads + h * G + g) * D + sub * E, raw);
  #pragma unroll
  for (int e = 0; e < E; ++e) { q[g][e] = element<T, E>(raw, e) * q_scale; acc[g][e] = 0.f; }
  m[g] = KVW_NEG_INF; l[g] = 0.f;
}
const int* table = page_table + (long)row * max_pages;
// The span's pages into shared memory once: a token's address then waits on no load of the table (a table read
// before each token's KV load put two dependent loads in its way: docs/benchmarks.md, "Paged KV in the fleet").
__shared__ int span_pages[SPAN_PAGES];
const int first_page = start / P;
for (int i = tid; start < stop && i <= (stop - 1) / P - first_page; i += THREADS) span_pages[i] = table[first_page + i];
__syncthreads();
const T* k_head = keys + (long)h * slots * D + sub * E;
const T* v_head = values + (long)h * slots * D + sub * E;
auto slot_of = [&](int t) -> long { return (long)span_pages[t / P - first_page] * P + t % P; };
uint4 k_raw[U][RAW], v_raw[U][RAW];
auto load_tile = [&](uint4 (&raw)[U][RAW], const T* head, int base) {
  #pragma unroll
  for (int u = 0; u < U; ++u) {
    const int t = base + u * GROUPS + group;
    if (t < stop) load_raw<T, E>(head + slot_of(t) * D, raw[u]);
    else {
      #pragma unroll
      for (int i = 0; i < RAW; ++i) raw[u][i] = uint4{0u, 0u, 0u, 0u};  // a token past the span: zeros
    }
  }
};
if (start < stop) { load_tile(k_raw, k_head, start); load_tile(v_raw, v_head, start); }
for (int base = start; base < stop; base += STEP) {  // the same trips for every thread: shuffles meet
  float s[U][G];
  #pragma unroll
  for (int u = 0; u < U; ++u) {
    float k[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) k[e] = element<T, E>(k_raw[u], e);
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float d = 0.f;
      #pragma unroll
      for (int e = 0; e < E; ++e) d += q[g][e] * k[e];
      s[u][g] = d;
    }
  }
  const bool more = base + STEP < stop;
  if (more) load_tile(k_raw, k_head, base + STEP);
  #pragma unroll
  for (int u = 0; u < U; ++u) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      #pragma unroll
      for (int o = TPT / 2; o > 0; o >>= 1) s[u][g] += __shfl_xor_sync(0xffffffff, s[u][g], o);
    }
  }
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    float top = m[g];
    #pragma unroll
    for (int u = 0; u < U; ++u) if (base + u * GROUPS + group < stop) top = fmaxf(top, s[u][g]);
    const float c = top == KVW_NEG_INF ? 1.f : exp2f(m[g] - top);
    l[g] *= c;
    #pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] *= c;
    m[g] = top;
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      s[u][g] = base + u * GROUPS + group < stop ? exp2f(s[u][g] - top) : 0.f;  // now the token's weight
      l[g] += s[u][g];
    }
  }
  #pragma unroll
  for (int u = 0; u < U; ++u) {
    float v[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) v[e] = element<T, E>(v_raw[u], e);
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      #pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] += s[u][g] * v[e];
    }
  }
  if (more) load_tile(v_raw, v_head, base + STEP);
}
// The groups of a warp, by shuffles (a lane holds the same dims as its peers TPT apart); then the warps.
__shared__ float warp_m[WARPS][G], warp_l[WARPS][G], warp_acc[WARPS][G][D];
#pragma unroll
for (int g = 0; g < G; ++g) {
  float top = m[g];
  for (int o = TPT; o < 32; o <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
  const float c = m[g] == KVW_NEG_INF ? 0.f : exp2f(m[g] - top);
  float sum = l[g] * c;
  for (int o = TPT; o < 32; o <<= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
  #pragma unroll
  for (int e = 0; e < E; ++e) {
    float a = acc[g][e] * c;
    for (int o = TPT; o < 32; o <<= 1) a += __shfl_xor_sync(0xffffffff, a, o);
    if (lane < TPT) warp_acc[warp][g][sub * E + e] = a;
  }
  if (lane == 0) { warp_m[warp][g] = top; warp_l[warp][g] = sum; }
}
__syncthreads();
for (int i = tid; i < G * D; i += THREADS) {
  const int g = i / D, d = i % D;
  float top = KVW_NEG_INF, sum = 0.f, a = 0.f;
  for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_m[w][g]);
  for (int w = 0; w < WARPS; ++w) {
    const float c = warp_m[w][g] == KVW_NEG_INF ? 0.f : exp2f(warp_m[w][g] - top);
    sum += warp_l[w][g] * c;
    a += warp_acc[w][g][d] * c;
  }
  const long at = ((long)row * q_heads + h * G + g) * spans + span;
  span_out[at * D + d] = sum > 0.f ? a / sum : 0.f;
  if (d == 0) span_lse[at] = sum > 0.f ? top + log2f(sum) : KVW_NEG_INF;
}
"""

# One thread per (row, query head, dim): a row's spans weighted by 2^(lse - max lse) (base 2, as the spans wrote).
_COMBINE = """
const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
const int spans = span_lse_shape[2];
const long heads = (long)span_lse_shape[0] * span_lse_shape[1];
if (i >= heads * D) return;
const long head = i / D;
const int d = i % D;
const float* lse = span_lse + head * spans;
float top = KVW_NEG_INF, weight = 0.f, a = 0.f;
for (int s = 0; s < spans; ++s) top = fmaxf(top, lse[s]);
for (int s = 0; s < spans; ++s) {
  if (lse[s] == KVW_NEG_INF) continue;
  const float w = exp2f(lse[s] - top);
  weight += w;
  a += w * span_out[(head * spans + s) * D + d];
}
out[i] = kvw_from_float<T>(weight > 0.f ? a / weight : 0.f);
"""

# The same spans over a batch's own buffers, [rows, kv_heads, capacity, head_dim] (mlx-lm's BatchKVCache): row r's
# tokens are slots starts[r] .. starts[r] + lengths[r] of its buffer (the slots before are its left padding).
_ROW_SPANS = (_SPANS
              .replace("const int q_heads = queries_shape[1], max_pages = page_table_shape[1];",
                       "const int q_heads = queries_shape[1];")
              .replace("const long slots = keys_shape[1];", "const long slots = keys_shape[2];")
              .replace(_SPANS[_SPANS.index("const int* table"):_SPANS.index("const T* k_head")],
                       "const long first = starts[row];\n")
              .replace("return (long)span_pages[t / P - first_page] * P + t % P;", "return first + t;")
              .replace("keys + (long)h * slots * D", "keys + ((long)row * keys_shape[1] + h) * slots * D")
              .replace("values + (long)h * slots * D", "values + ((long)row * keys_shape[1] + h) * slots * D")
              )

_kernels: dict[str, object] = {}


def _kernel(name: str) -> object:
    """The span or combine kernel, made once (MLX compiles it per template at its first call)."""
    if name not in _kernels:
        if name == "spans":
            _kernels[name] = mx.fast.cuda_kernel(
                name="kvwake_paged_spans", header=_HEADER, source=_SPANS, output_names=["span_out", "span_lse"],
                input_names=["queries", "keys", "values", "page_table", "lengths", "scale", "split"])
        elif name == "row_spans":
            _kernels[name] = mx.fast.cuda_kernel(
                name="kvwake_row_spans", header=_HEADER, source=_ROW_SPANS, output_names=["span_out", "span_lse"],
                input_names=["queries", "keys", "values", "starts", "lengths", "scale", "split"])
        else:
            _kernels[name] = mx.fast.cuda_kernel(
                name="kvwake_paged_combine", header=_HEADER, input_names=["span_out", "span_lse"],
                output_names=["out"], source=_COMBINE)
    return _kernels[name]


def _threads_per_token(head_dim: int, group: int, itemsize: int) -> int | None:
    """Threads sharing one token: the fewest that keep a thread's G x E query and accumulator floats at
    REGISTER_FLOATS each or less and its share of a token at two 16-byte loads or less (IN_FLIGHT of
    them wait in registers), among those whose share is whole 16-byte pieces; None if none is."""
    fits = [t for t in (1, 2, 4, 8, 16, 32) if head_dim % t == 0 and head_dim // t * itemsize % 16 == 0]
    small = (t for t in fits if head_dim // t * group <= REGISTER_FLOATS and head_dim // t * itemsize <= 32)
    return next(small, fits[-1] if fits else None)


def kernel_attention(queries: mx.array, keys: mx.array, values: mx.array, page_table: mx.array,
                     lengths: mx.array, scale: float, page_tokens: int, split: int | None = None,
                     threads_per_token: int | None = None) -> mx.array:
    """Flash-decoding over pages on CUDA (the module docstring). `split`: tokens per span (default
    `split_tokens`); `threads_per_token` (default: `_threads_per_token`'s). Raises ValueError for shapes
    the kernel does not take (use `gather_attention`)."""
    rows, q_heads, head_dim = queries.shape
    kv_heads, dtype = keys.shape[0], queries.dtype
    group, itemsize = q_heads // kv_heads, dtype.size
    tpt = threads_per_token or _threads_per_token(head_dim, group, itemsize)
    if (tpt is None or head_dim % tpt or head_dim // tpt * itemsize % 16 or q_heads % kv_heads or keys.dtype != dtype
            or page_tokens & (page_tokens - 1)):
        raise ValueError(f"no paged kernel for {q_heads} query heads over {kv_heads} KV heads of {head_dim} "
                         f"({dtype}, {keys.dtype} KV, pages of {page_tokens})")
    max_tokens = page_table.shape[1] * page_tokens
    # a span's pages fit the kernel's shared list (SPAN_PAGES, one more for a span that starts inside a page)
    split = min(split or split_tokens(rows, kv_heads, max_tokens), (SPAN_PAGES - 1) * page_tokens)
    return _flash_decode("spans", queries, keys, values, page_table, lengths, scale, kv_heads, max_tokens, split,
                         tpt, (("P", page_tokens), ("SPAN_PAGES", SPAN_PAGES)))


def row_attention(queries: mx.array, keys: mx.array, values: mx.array, starts: mx.array, lengths: mx.array,
                  scale: float, max_tokens: int | None = None, split: int | None = None) -> mx.array:
    """The same flash-decoding on CUDA over a batch's own KV buffers: keys and values [rows, kv_heads,
    capacity, head_dim] (mlx-lm's BatchKVCache, row-contiguous), row r's tokens at slots starts[r] ..
    starts[r] + lengths[r] (int32), none past `max_tokens` (default: the capacity): a left-padded batch
    decoded with no mask and no padded slot read. Raises ValueError for shapes the kernel does not take."""
    rows, q_heads, head_dim = queries.shape
    kv_heads, dtype = keys.shape[1], queries.dtype
    tpt = _threads_per_token(head_dim, q_heads // kv_heads, dtype.size)
    if tpt is None or q_heads % kv_heads or keys.dtype != dtype or keys.shape[0] != rows:
        raise ValueError(f"no row kernel for {rows} rows of {q_heads} query heads over {keys.shape} "
                         f"({dtype}, {keys.dtype} KV)")
    return _flash_decode("row_spans", queries, keys, values, starts, lengths, scale, kv_heads,
                         max_tokens or keys.shape[2], split or ROW_SPLIT, tpt, ())


def _flash_decode(kernel: str, queries: mx.array, keys: mx.array, values: mx.array, where: mx.array,
                  lengths: mx.array, scale: float, kv_heads: int, max_tokens: int, split: int | None, tpt: int,
                  extra: tuple[tuple[str, int], ...]) -> mx.array:
    """The span kernel (`kernel`: over pages, or over rows' buffers) over the longest row's `max_tokens`,
    then the combine; `where`: the page table or the rows' first slots."""
    rows, q_heads, head_dim = queries.shape
    dtype = queries.dtype
    group, itemsize = q_heads // kv_heads, dtype.size
    split = split or split_tokens(rows, kv_heads, max_tokens)
    spans = -(-max_tokens // split)
    span_out, span_lse = _kernel(kernel)(
        inputs=[queries, keys, values, where, lengths, constant(scale, mx.float32), constant(split, mx.int32)],
        template=[("T", dtype), ("D", head_dim), ("G", group), *extra, ("TPT", tpt),
                  ("THREADS", THREADS), ("U", IN_FLIGHT if itemsize < 4 else IN_FLIGHT // 2)],
        grid=(spans * THREADS, kv_heads, rows), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, q_heads, spans, head_dim), (rows, q_heads, spans)],
        output_dtypes=[mx.float32, mx.float32])
    (out,) = _kernel("combine")(
        inputs=[span_out, span_lse], template=[("T", dtype), ("D", head_dim)],
        grid=(rows * q_heads * head_dim, 1, 1), threadgroup=(128, 1, 1),
        output_shapes=[(rows, q_heads, head_dim)], output_dtypes=[dtype])
    return out


_constants = threading.local()  # per thread: an engine thread's arrays, made on its stream
CONSTANTS_KEPT = 64


def constant(value: float | int, dtype: mx.Dtype) -> mx.array:
    """A one-element array of `value`, made once per value (and thread) and kept: the kernel's scale and span
    length, which a call made afresh for every layer of every step (two small arrays made from host memory
    per layer, each a host-to-device move before the kernel could read it). At most CONSTANTS_KEPT kept."""
    kept = getattr(_constants, "kept", None)
    if kept is None:
        kept = _constants.kept = {}
    made = kept.get((value, dtype))
    if made is None:
        if len(kept) >= CONSTANTS_KEPT:
            kept.clear()
        made = kept[value, dtype] = mx.array([value], dtype)  # from host memory: there at once, nothing to run
    return made


def decode_attention(queries: mx.array, keys: mx.array, values: mx.array, page_table: mx.array,
                     lengths: mx.array, scale: float, page_tokens: int) -> mx.array:
    """The kernel on CUDA, the gather path elsewhere (CPU, Metal)."""
    if cudart.on_cuda():
        return kernel_attention(queries, keys, values, page_table, lengths, scale, page_tokens)
    return gather_attention(queries, keys, values, page_table, lengths, scale, page_tokens)
