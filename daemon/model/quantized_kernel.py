"""A 4-bit layer's product for a few rows on CUDA: the weight read once, dequantized in registers.

A batch decoding multiplies a few rows by every weight of the model. For a 4-bit model MLX has two ways, both
far from the weight's bytes: its vector kernel reads the weight once a row, and a dequantized product writes
the weight out in bf16 and reads it back, each product (docs/benchmarks.md, "4-bit products"). Here
(`kernel_product`, taken by model/quantized.py for MIN_ROWS to ROWS rows) one kernel reads each packed row of
the weight once with its scales and biases, dequantizes it in registers to the activations' dtype, and
multiplies it with the rows by the tensor cores (`mma.sync` m16n8k16, the rows as the A operand padded to 16
or 32, float accumulators): sm_80 or later, which the build beside the load finds out (a GPU without them
fails it, and its products stay MLX's).

Layout: a block takes 8 x NT output columns; its WARPS warps take every WARPS-th piece of 128 elements of
the weight's rows; in a piece a lane (g = lane / 4, q = lane % 4) reads 32 consecutive elements of column
row n0 + 8t + g (16 bytes: 32 nibbles, one scale and bias: a group of 32, 64 or 128 holds them) and the same 32
elements of each input row it holds (g, g + 8, g + 16, g + 24), and multiplies them in 8 steps of 16: in
step j its four B values are its elements 4j ... 4j + 3 (the m16n8k16 fragment's k = 2q, 2q + 1, 2q + 8,
2q + 9), its A values the inputs' same four. The sum over a piece's elements does not care in which order
they go. The warps' sums are added in a fixed order through shared memory.

A row's result depends on that row, the weight and WARPS only, not on the other rows nor on how many there
are: a session decodes the same bits in any batch of MIN_ROWS to ROWS rows (alone, one row, it takes MLX's
vector kernel, the faster there). The numbers differ from MLX's products by rounding: each weight is
dequantized in float (scale times value plus bias) and rounded once to the activations' dtype, where MLX's
dequantize may round twice, then the products are summed in float in the kernel's order. Affine mode, 4 bits,
groups of 32, 64 or 128, bf16 or fp16 activations, the inner size a multiple of 128 (`takes`); anything else is
model/quantized.py's. CUDA only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

__all__ = ["MIN_ROWS", "ROWS", "WARPS", "build", "kernel_product", "takes", "takes_rows"]

ROWS = 32  # the most rows it takes: two m16 tiles of the tensor cores' product
# the fewest: one row decodes faster through MLX's vector kernel (docs/benchmarks.md, "4-bit products")
MIN_ROWS = 2
WARPS = 4  # warps a block, each taking every WARPS-th piece of a weight row (their sums added in a fixed order)
PIECE = 128  # weight elements four lanes take at a time (32 each: one 16-byte load of nibbles)
_MMA = {"bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"}
_TYPE = {mx.bfloat16: "bf16", mx.float16: "f16"}

_HEADER = """
__device__ inline void kvw_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ inline void kvw_store(__half* p, float v) { *p = __float2half(v); }
__device__ inline float kvw_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float kvw_float(__half v) { return __half2float(v); }
// two floats as the activations' dtype, packed as an mma operand register (the first in the low half)
__device__ inline unsigned kvw_pack(float a, float b, __nv_bfloat16*) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ inline unsigned kvw_pack(float a, float b, __half*) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&v);
}
"""

_SOURCE = """
constexpr int NB = NT * 8, MR = MT * 16;
const int K = x_shape[x_ndim - 1];
int M = 1;
for (int d = 0; d < x_ndim - 1; ++d) M *= x_shape[d];
const long N = w_shape[0];
const int groups = scales_shape[1];
const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
const long n0 = (long)blockIdx.x * NB;
const int pieces = K / 128;
const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
const uint4* wp[NT];
const __PT__* sp[NT];
const __PT__* bp[NT];
bool wok[NT];
#pragma unroll
for (int t = 0; t < NT; ++t) {
  const long n = n0 + t * 8 + g;
  wok[t] = n < N;
  const long row = wok[t] ? n : 0L;
  wp[t] = reinterpret_cast<const uint4*>(w + row * (K / 8)) + q;
  sp[t] = scales + row * groups;
  bp[t] = biases + row * groups;
}
const uint4* xp[MT][2];
bool xok[MT][2];
#pragma unroll
for (int i = 0; i < MT; ++i) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = i * 16 + h * 8 + g;
    xok[i][h] = m < M;
    xp[i][h] = reinterpret_cast<const uint4*>(x + (long)(xok[i][h] ? m : 0) * K) + q * 4;
  }
}
float acc[MT][NT][4];
#pragma unroll
for (int i = 0; i < MT; ++i)
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][t][e] = 0.f;
// the group of a lane's 32 elements of piece c: (128 c + 32 q) / (K / groups)
const int group_size = K / groups;
uint4 wv[NT];
float sv[NT], bv[NT];
int c = warp;
#pragma unroll
for (int t = 0; t < NT; ++t) {
  const bool ok = c < pieces && wok[t];
  const int gi = ok ? (c * 128 + q * 32) / group_size : 0;
  wv[t] = ok ? __ldg(wp[t] + c * 4) : zero;
  sv[t] = ok ? kvw_float(sp[t][gi]) : 0.f;
  bv[t] = ok ? kvw_float(bp[t][gi]) : 0.f;
}
for (; c < pieces; c += WARPS) {
  const int cn = c + WARPS;
  uint4 wn[NT];
  float sn[NT], bn[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const bool ok = cn < pieces && wok[t];
    const int gi = ok ? (cn * 128 + q * 32) / group_size : 0;
    wn[t] = ok ? __ldg(wp[t] + cn * 4) : zero;
    sn[t] = ok ? kvw_float(sp[t][gi]) : 0.f;
    bn[t] = ok ? kvw_float(bp[t][gi]) : 0.f;
  }
  uint4 xv[MT][2][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int u = 0; u < 4; ++u) xv[i][h][u] = xok[i][h] ? __ldg(xp[i][h] + c * 16 + u) : zero;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    // this step's B values of each column run: nibbles 4j .. 4j + 3 of the lane's 32 (word j / 2, half j % 2)
    unsigned b0[NT], b1[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const unsigned word = (j >> 1) == 0 ? wv[t].x : (j >> 1) == 1 ? wv[t].y : (j >> 1) == 2 ? wv[t].z : wv[t].w;
      const unsigned nib = word >> ((j & 1) * 16);
      const float w0 = (float)(nib & 15u) * sv[t] + bv[t], w1 = (float)((nib >> 4) & 15u) * sv[t] + bv[t];
      const float w2 = (float)((nib >> 8) & 15u) * sv[t] + bv[t], w3 = (float)((nib >> 12) & 15u) * sv[t] + bv[t];
      b0[t] = kvw_pack(w0, w1, (__PT__*)nullptr);
      b1[t] = kvw_pack(w2, w3, (__PT__*)nullptr);
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      // the inputs' elements 4j .. 4j + 3: uint4 j / 2, its x, y (j even) or z, w (j odd)
      const uint4 lo = xv[i][0][j >> 1], hi = xv[i][1][j >> 1];
      const unsigned a0 = (j & 1) ? lo.z : lo.x, a2 = (j & 1) ? lo.w : lo.y;
      const unsigned a1 = (j & 1) ? hi.z : hi.x, a3 = (j & 1) ? hi.w : hi.y;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        asm volatile("MMA {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(acc[i][t][0]), "+f"(acc[i][t][1]), "+f"(acc[i][t][2]), "+f"(acc[i][t][3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0[t]), "r"(b1[t]));
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) { wv[t] = wn[t]; sv[t] = sn[t]; bv[t] = bn[t]; }
}
__shared__ float partial[WARPS * MR * NB];
#pragma unroll
for (int i = 0; i < MT; ++i)
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float* p = partial + (warp * MR + i * 16 + g) * NB + t * 8 + 2 * q;
    p[0] = acc[i][t][0];
    p[1] = acc[i][t][1];
    p[8 * NB] = acc[i][t][2];
    p[8 * NB + 1] = acc[i][t][3];
  }
__syncthreads();
for (int o = threadIdx.x; o < MR * NB; o += WARPS * 32) {
  const int m = o / NB;
  const long n = n0 + o % NB;
  if (m < M && n < N) {
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) s += partial[v * MR * NB + o];
    kvw_store(y + (long)m * N + n, s);
  }
}
"""

_POINTEE = {"bf16": "__nv_bfloat16", "f16": "__half"}
_kernels: dict[str, Any] = {}
_calls: dict[tuple, Any] = {}
CALLS_KEPT = 1024


def _kernel(kind: str) -> Any:
    """The kernel for activations of `kind` ("bf16", "f16"), made once (MLX compiles it per template at its first
    call)."""
    if kind not in _kernels:
        _kernels[kind] = mx.fast.cuda_kernel(
            name=f"kvwake_q4_rows_{kind}", input_names=["x", "w", "scales", "biases"], output_names=["y"],
            header=_HEADER, source=_SOURCE.replace("MMA", _MMA[kind]).replace("__PT__", _POINTEE[kind]))
    return _kernels[kind]


def takes(weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int) -> bool:
    """Whether the kernel takes a layer's weight (asked once, as it is installed): 4-bit affine (biases given) in
    groups of 32, 64 or 128, scales and biases of bf16 or fp16 (the activations' dtype), an inner size that is
    a multiple of PIECE. Its products then go to it by their rows (`takes_rows`)."""
    if weight.ndim != 2 or weight.dtype != mx.uint32 or biases is None:
        return False
    k = weight.shape[1] * 8
    groups = (weight.shape[0], k // group_size)
    return (bits == 4 and group_size in (32, 64, 128) and scales.dtype in _TYPE and biases.dtype == scales.dtype
            and k % PIECE == 0 and scales.shape == groups and biases.shape == groups)


def takes_rows(x: mx.array, dtype: mx.Dtype) -> bool:
    """Whether a product of `x` by a weight the kernel takes (`takes`), its activations' dtype `dtype`, goes to
    it: MIN_ROWS to ROWS rows of that dtype. (x's rows are read 16 bytes at a time: MLX hands a row-contiguous
    view over as it is, whose offset, a whole number of rows of K elements, keeps them aligned.)"""
    return x.dtype == dtype and MIN_ROWS <= x.size // x.shape[-1] <= ROWS


def kernel_product(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, nt: int | None = None,
                   warps: int = WARPS) -> mx.array:
    """`x` times the dequantized `weight` (transposed) by the kernel (module docstring): x [..., K] of up to
    ROWS rows. `nt` (the column runs a block) and `warps` are for a benchmark's sweep."""
    key = (x.dtype, x.shape, weight.shape[0], nt, warps)
    call = _calls.get(key)
    if call is None:
        if len(_calls) >= CALLS_KEPT:
            _calls.clear()
        call = _calls[key] = _call(x, weight.shape[0], nt, warps)
    return call([x, weight, scales, biases])


def _call(x: mx.array, n: int, nt: int | None, warps: int) -> Any:
    """The kernel's call for inputs shaped as `x` and `n` columns, what it passes besides the arrays made once
    (a decode step calls it for every layer)."""
    nt = nt or (2 if n <= 4096 else 4)  # more blocks for a narrow weight, to keep the memory busy
    rows = x.size // x.shape[-1]
    kernel = _kernel(_TYPE[x.dtype])
    kwargs = {"template": [("NT", nt), ("WARPS", warps), ("MT", 1 if rows <= 16 else 2)],
              "grid": (-(-n // (8 * nt)) * warps * 32, 1, 1), "threadgroup": (warps * 32, 1, 1),
              "output_shapes": [(*x.shape[:-1], n)], "output_dtypes": [x.dtype]}
    return lambda inputs: kernel(inputs=inputs, **kwargs)[0]


def build(dtype: Any) -> bool:
    """Compile the kernel's variants for activations of `dtype` (two column runs, one and two row tiles):
    MLX compiles a custom kernel at its first call, which a first decode step would otherwise wait for.
    Whether the dtype is one it takes."""
    if dtype not in _TYPE:
        return False
    out = []
    for n in (8, 8192):
        w, s, b = mx.quantize(mx.zeros((n, PIECE), dtype), group_size=64, bits=4)
        out += [kernel_product(mx.zeros((rows, PIECE), dtype), w, s, b) for rows in (2, 20)]
    mx.eval(out)
    return True
