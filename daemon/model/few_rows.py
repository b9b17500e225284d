"""A plain linear layer's product for a few rows on CUDA: one tensor-core kernel that reads the weight once.

A batch decoding multiplies a few rows (one a session) by every weight matrix of the model: the step is the
weights' bytes read, each once. MLX hands a product of one row to its vector kernel (about 3 TB/s on the
H200) and any more to cuBLAS, whose kernels for 2-64 rows read the 8B shape's weights at about 1.8 TB/s: a
decode step's linear layers took 7.6-9.4 ms at 2-32 rows where one row took 5.1 (docs/benchmarks.md,
"decode_rows"). That is half of a step of 8 rows at 12k contexts.

Here (`install`) a linear layer of a bf16 or fp16 model multiplies up to ROWS rows by one kernel
(`mx.fast.cuda_kernel`): the rows padded to 32 as the A operand of the tensor cores' m16n8k16 product
(`mma.sync`, float accumulators), each block WARPS warps over a run of 8 x NT output columns, each warp every
WARPS-th 32-element piece of the weight's rows (16-byte loads, the next piece's in flight while this one is
multiplied), the warps' partial sums added in a fixed order through shared memory. Within a piece the 32
elements go to the two m16n8k16 steps in an order of the kernel's own (a thread's 16 contiguous bytes as its
B fragments, the rows' same elements as its A fragments): a sum over all of them does not care.

What it computes for a row depends on that row, the weight and WARPS only: not on the other rows, nor on how
many there are (up to ROWS), nor on NT. So a session's linear layers give the same numbers decoding alone or in
any batch of up to ROWS rows, which MLX's own products (its vector kernel for one row, cuBLAS's kernels chosen
by the rows) do not. The numbers differ from MLX's by the products' rounding (float accumulators both).

More rows than ROWS (a prefill, a larger batch) take MLX's product as before. CUDA only: on the CPU and Metal
the layers are left as they are (`install` does nothing), so the CPU's numbers are unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvwake.daemon.kv import cudart

__all__ = ["GROUPS", "MIN_ROWS", "ROWS", "WARPS", "ByRows", "EmbeddingByRows", "build", "columns", "counts",
           "install", "kernel_product", "takes", "uninstall", "wanted"]

ROWS = 32  # the most rows the kernel takes: two m16 tiles of the tensor cores' product
MIN_ROWS = 2  # the fewest: one row reads the weights faster through MLX's vector kernel (docs/benchmarks.md)
WARPS = 4  # warps a block, splitting each weight row's pieces among them (their order of adding is fixed)
PIECE = 32  # weight elements a thread group takes at a time (two m16n8k16 steps); the inner size's multiple
# products taken each way, for status: counted without a lock, as model/quantized.py's are (a lost count now
# and then between two models' threads, no more)
_counts: Counter[str] = Counter()

_MMA = {"bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"}
_TYPE = {mx.bfloat16: "bf16", mx.float16: "f16"}
_POINTEE = {"bf16": "__nv_bfloat16", "f16": "__half"}

_HEADER = """
__device__ inline void kvw_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ inline void kvw_store(__half* p, float v) { *p = __float2half(v); }
"""

# x [rows, K], w [N, K] (row-major, as nn.Linear holds it), y [rows, N]. Block b: columns b * 8 NT ...;
# lane (g = lane / 4, q = lane % 4) loads weight row n0 + 8t + g and input rows 16i + g, 16i + g + 8, each at
# elements 32c + 8q ... 32c + 8q + 7 of piece c: the m16n8k16 fragments' (row g, k 2q, 2q + 1, 2q + 8, 2q + 9) of
# two steps j = 0, 1 are those eight elements' 4j ... 4j + 3.
_SOURCE = """
constexpr int MT = 2, NB = NT * 8, MR = MT * 16;
const int K = x_shape[x_ndim - 1];
int M = 1;
for (int d = 0; d < x_ndim - 1; ++d) M *= x_shape[d];
const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
PART
const long n0 = (long)block * NB;
const int pieces = K / 32;
const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
const uint4* wp[NT];
bool wok[NT];
#pragma unroll
for (int t = 0; t < NT; ++t) {
  const long n = n0 + t * 8 + g;
  wok[t] = n < N;
  wp[t] = reinterpret_cast<const uint4*>(w + (wok[t] ? n : 0L) * K) + q;
}
const uint4* xp[MT][2];
bool xok[MT][2];
#pragma unroll
for (int i = 0; i < MT; ++i) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = i * 16 + h * 8 + g;
    xok[i][h] = m < M;
    xp[i][h] = reinterpret_cast<const uint4*>(x + (long)(xok[i][h] ? m : 0) * K) + q;
  }
}
float acc[MT][NT][4];
#pragma unroll
for (int i = 0; i < MT; ++i)
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][t][e] = 0.f;
uint4 wv[NT], xv[MT][2];
int c = warp;
#pragma unroll
for (int t = 0; t < NT; ++t) wv[t] = (c < pieces && wok[t]) ? __ldg(wp[t] + c * 4) : zero;
#pragma unroll
for (int i = 0; i < MT; ++i)
#pragma unroll
  for (int h = 0; h < 2; ++h) xv[i][h] = (c < pieces && xok[i][h]) ? __ldg(xp[i][h] + c * 4) : zero;
for (; c < pieces; c += WARPS) {
  const int cn = c + WARPS;
  uint4 wn[NT], xn[MT][2];
#pragma unroll
  for (int t = 0; t < NT; ++t) wn[t] = (cn < pieces && wok[t]) ? __ldg(wp[t] + cn * 4) : zero;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) xn[i][h] = (cn < pieces && xok[i][h]) ? __ldg(xp[i][h] + cn * 4) : zero;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const unsigned a0 = j ? xv[i][0].z : xv[i][0].x, a1 = j ? xv[i][1].z : xv[i][1].x;
      const unsigned a2 = j ? xv[i][0].w : xv[i][0].y, a3 = j ? xv[i][1].w : xv[i][1].y;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const unsigned b0 = j ? wv[t].z : wv[t].x, b1 = j ? wv[t].w : wv[t].y;
        asm volatile("MMA {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(acc[i][t][0]), "+f"(acc[i][t][1]), "+f"(acc[i][t][2]), "+f"(acc[i][t][3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) wv[t] = wn[t];
#pragma unroll
  for (int i = 0; i < MT; ++i) { xv[i][0] = xn[i][0]; xv[i][1] = xn[i][1]; }
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


def _part(parts: int) -> str:
    """The lines that give a block its weight, output and column run: blocks 0 .. ceil(N0 / NB) - 1 take the
    first weight, the next ones the second, and so on (a group's products in one launch)."""
    body = ["long block = blockIdx.x, N = 0;", "const __PT__* w = nullptr;", "__PT__* y = nullptr;"]
    for i in range(parts - 1):
        body.append(f"if (w == nullptr && block < (w{i}_shape[0] + NB - 1) / NB) {{ w = w{i}; y = y{i}; N = w{i}_shape[0]; }}")
        body.append(f"else if (w == nullptr) block -= (w{i}_shape[0] + NB - 1) / NB;")
    last = parts - 1
    body.append(f"if (w == nullptr) {{ w = w{last}; y = y{last}; N = w{last}_shape[0]; }}")
    return "\n".join(body)


_kernels: dict[tuple[str, int], Any] = {}


def _kernel(kind: str, parts: int) -> Any:
    """The kernel for `kind` ("bf16", "f16") over `parts` weights, made once (MLX compiles it per template at its
    first call)."""
    if (kind, parts) not in _kernels:
        source = _SOURCE.replace("MMA", _MMA[kind]).replace("PART", _part(parts)).replace("__PT__", _POINTEE[kind])
        _kernels[kind, parts] = mx.fast.cuda_kernel(
            name=f"kvwake_few_rows_{kind}_{parts}", input_names=["x", *(f"w{i}" for i in range(parts))],
            output_names=[f"y{i}" for i in range(parts)], header=_HEADER, source=source)
    return _kernels[kind, parts]


def wanted(few_rows: bool) -> bool:
    """Whether a model's plain linear layers take the kernel: asked for (tuning `few_rows`), and on CUDA."""
    return few_rows and cudart.on_cuda()


def columns(n: int, parts: int = 1) -> int:
    """NT, the 8-column runs a block takes: two for a lone weight of up to 4,096 rows (more blocks to keep the
    GPU's memory busy), four for wider ones and for a group (fewer blocks, each reading the rows' inputs once)."""
    return 2 if parts == 1 and n <= 4096 else 4


def takes(x: mx.array, weight: mx.array) -> bool:
    """Whether the kernel takes this product: MIN_ROWS to ROWS rows, bf16 or fp16 on both sides, a 2-D weight
    whose rows are whole pieces."""
    return (x.dtype in _TYPE and weight.dtype == x.dtype and weight.ndim == 2 and x.shape[-1] == weight.shape[1]
            and weight.shape[1] % PIECE == 0 and MIN_ROWS <= x.size // x.shape[-1] <= ROWS)


def kernel_product(x: mx.array, weights: Sequence[mx.array], nt: int | None = None,
                   warps: int = WARPS) -> list[mx.array]:
    """`x @ w.T` for each of `weights` (one to three, the same K) by the kernel, in one launch (module
    docstring): x [..., K] of up to ROWS rows, each weight [N, K]. `nt` (the column runs a block: `columns`'
    by default) and `warps` are for the benchmark's sweep."""
    key = (x.dtype, x.shape, tuple(w.shape[0] for w in weights), nt, warps)
    call = _calls.get(key)
    if call is None:
        if len(_calls) >= CALLS_KEPT:
            _calls.clear()
        call = _calls[key] = _call(x, weights, nt, warps)
    return call(inputs=[x, *weights])


# A decode step calls the kernel for every layer: what each call passes besides its arrays is made once per
# shape (a step's host time is what a small batch's step waits for: docs/benchmarks.md, "few_rows")
_calls: dict[tuple, Any] = {}
CALLS_KEPT = 1024


def _call(x: mx.array, weights: Sequence[mx.array], nt: int | None, warps: int) -> Any:
    nt = nt or columns(weights[0].shape[0], len(weights))
    blocks = sum(-(-w.shape[0] // (8 * nt)) for w in weights)
    kernel = _kernel(_TYPE[x.dtype], len(weights))
    kwargs = {"template": [("NT", nt), ("WARPS", warps)], "grid": (blocks * warps * 32, 1, 1),
              "threadgroup": (warps * 32, 1, 1), "output_shapes": [(*x.shape[:-1], w.shape[0]) for w in weights],
              "output_dtypes": [x.dtype] * len(weights)}
    return lambda inputs: kernel(inputs=inputs, **kwargs)


def counts() -> dict[str, int]:
    """Products taken each way since the start: `kernel` (here, each layer's counted), `launches` (the kernel's:
    a group's products are one), `mlx` (fewer or more rows, or a shape it does not take)."""
    return {k: _counts[k] for k in ("kernel", "launches", "mlx")}


class _Group:
    """Layers that multiply the same input (an attention's q, k and v projections; an MLP's gate and up): the
    first of them called with an input computes every member's product in one launch, and each other member
    called with that same array takes its own from here. Called with another input, a member computes all
    again (a model that calls them otherwise is only slower, never wrong: each product is the same bits alone
    or in the group, the columns being the kernel's own)."""

    def __init__(self, layers: list[ByRows]) -> None:
        self.layers = layers
        self.input: mx.array | None = None
        self.waiting: dict[int, mx.array] = {}  # id(layer) -> its product of `input`, until it takes it

    def product(self, layer: ByRows, x: mx.array) -> mx.array:
        if x is self.input and id(layer) in self.waiting:
            out = self.waiting.pop(id(layer))
            if not self.waiting:
                self.input = None
            return out
        outs = kernel_product(x, [m["weight"] for m in self.layers])
        _counts["kernel"] += len(self.layers)
        _counts["launches"] += 1
        self.input, self.waiting = x, {id(m): y for m, y in zip(self.layers, outs) if m is not layer}
        return next(y for m, y in zip(self.layers, outs) if m is layer)


class ByRows(nn.Linear):
    """nn.Linear whose product goes by its rows. `install` gives a loaded layer this class; its parameters and
    their names stay as they are."""

    def __call__(self, x: mx.array) -> mx.array:
        if not takes(x, self["weight"]):
            _counts["mlx"] += 1
            return super().__call__(x)  # MLX's product, its bias added as MLX adds it
        group = getattr(self, "_few_rows_group", None)
        if group is not None:
            out = group.product(self, x)
        else:
            (out,) = kernel_product(x, [self["weight"]])
            _counts["kernel"] += 1
            _counts["launches"] += 1
        return out + self["bias"] if "bias" in self else out


class EmbeddingByRows(nn.Embedding):
    """nn.Embedding whose `as_linear` (the output head of a model that ties it to its embedding) goes by its
    rows too."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not takes(x, self["weight"]):
            _counts["mlx"] += 1
            return super().as_linear(x)
        _counts["kernel"] += 1
        _counts["launches"] += 1
        return kernel_product(x, [self["weight"]])[0]


_BY_ROWS: dict[type, type] = {nn.Linear: ByRows, nn.Embedding: EmbeddingByRows}
_PLAIN: dict[type, type] = {v: k for k, v in _BY_ROWS.items()}
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # members called with the same input


def install(model: nn.Module) -> int:
    """Give every plain linear layer of `model` whose weight is bf16 or fp16, and such an embedding's use as
    the output head, the products by rows, and the layers of each of GROUPS under one module (the same input
    dims and dtype) their group; how many layers. Only exactly nn.Linear and nn.Embedding (a quantized layer is
    model/quantized.py's)."""
    n = 0
    for _, module in model.named_modules():
        if module.__class__ in _BY_ROWS and module["weight"].dtype in _TYPE:
            module.__class__ = _BY_ROWS[module.__class__]
            n += 1
    for _, module in model.named_modules():
        for names in GROUPS:
            layers = [module.get(name) for name in names]
            if all(type(m) is ByRows for m in layers) and len({(m["weight"].shape[1], m["weight"].dtype)
                                                                 for m in layers}) == 1:
                group = _Group(layers)
                for m in layers:
                    object.__setattr__(m, "_few_rows_group", group)  # not a parameter nor a child
    return n


def uninstall(model: nn.Module) -> int:
    """`install` undone (the benchmark's baseline in the same process); how many layers."""
    n = 0
    for _, module in model.named_modules():
        if module.__class__ in _PLAIN:
            module.__dict__.pop("_few_rows_group", None)
            module.__class__ = _PLAIN[module.__class__]
            n += 1
    return n


def build(dtype: Any) -> bool:
    """Compile the kernel's variants for `dtype` (a lone weight's two column runs, a group of two and of
    three): MLX compiles a custom kernel at its first call, which a first decode step would otherwise wait for,
    and keeps it for the process. Whether the dtype is one the kernel takes."""
    if dtype not in _TYPE:
        return False
    x = mx.zeros((2, PIECE), dtype)
    mx.eval([kernel_product(x, [mx.zeros((n, PIECE), dtype) for n in sizes])
             for sizes in ((8,), (8192,), (8, 8), (8, 8, 8))])
    return True
