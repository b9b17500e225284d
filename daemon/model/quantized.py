"""A quantized model's products on CUDA, chosen by their rows.

MLX on CUDA multiplies by affine-quantized weights three ways, by the rows of the product: fewer than 8 rows
by its vector kernel (built into its library), more by a CuTe tile kernel it compiles with NVRTC at first use,
one per tile (16, 32 or 64 rows), each compile about 30 s of one core. Measured on the H200
(bench/q4_kernels.py, docs/benchmarks.md "4-bit products"), that tile kernel is also about 3x slower than
dequantizing the weight and multiplying in its own dtype (cuBLAS) once the rows are many: a prefill chunk's
product of 2,048 rows by a 14,336 x 4,096 weight takes 2.3 ms through it and 0.7 ms dequantized.

So a quantized layer here (`install`; a quantized embedding too, as the output head a tied model makes of it)
takes, by its product's rows:
- fewer than VECTOR_ROWS: MLX's own call (its vector kernel);
- DEQUANTIZE_ROWS or more (prefill chunks, packed turns): the weight dequantized, then a plain product;
- between: MLX's own call (its tile kernel) once that tile's kernel is in MLX's disk cache, else dequantized
  too, so a product never waits for a compile. The kernel warmer (model/kernel_cache.py) compiles each tile
  in a child process; until its child ends, the tile counts as compiling (`compiling`).

Only the affine mode (what `mlx_lm convert -q` writes); CUDA only (Metal has its own kernels; on the CPU the
layers are left as they are). The numbers differ from MLX's own call by the products' rounding, as they
already do between its kernels by rows.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["DEQUANTIZE_ROWS", "TILES", "VECTOR_ROWS", "ByRows", "EmbeddingByRows", "compiling", "counts", "done",
           "install", "product", "starting", "tile_of"]

VECTOR_ROWS = 8  # below: MLX's vector kernel, in its library
DEQUANTIZE_ROWS = 256  # from here dequantized: about where the tile kernel's time passes a dequantize's
TILES = (16, 32, 64)  # MLX's tile kernels by rows: up to 16, up to 32, more

_lock = threading.Lock()
_compiling: Counter[tuple[str, int, int, int]] = Counter()  # (dtype, bits, group size, tile): warmers at work
# products taken each way, for status: counted without the lock (a product is on an engine thread's hot path, and
# two models' threads racing on a count lose one now and then, no more)
_counts: Counter[str] = Counter()


def tile_of(rows: int) -> int:
    """The tile kernel MLX takes for a product of `rows` rows (VECTOR_ROWS or more)."""
    return next((t for t in TILES if rows <= t), TILES[-1])


def starting(dtype: str, bits: int, group_size: int, tile: int) -> None:
    """A warmer began compiling this tile's kernel (kernel_cache.Warmer): its products go dequantized until
    `done`."""
    with _lock:
        _compiling[dtype, bits, group_size, tile] += 1


def done(dtype: str, bits: int, group_size: int, tile: int) -> None:
    """That warmer ended (its kernel in the disk cache, or it failed or was stopped: MLX then compiles it at
    first use, as with no warmer)."""
    with _lock:
        key = (dtype, bits, group_size, tile)
        _compiling[key] -= 1
        if _compiling[key] <= 0:
            del _compiling[key]


def compiling() -> list[dict[str, Any]]:
    """The tiles whose kernels a warmer is compiling now."""
    with _lock:
        return [{"dtype": d, "bits": b, "group_size": g, "tile": t} for d, b, g, t in sorted(_compiling)]


def counts() -> dict[str, int]:
    """Products taken each way since the start: `vector`, `tile`, `dequantized` (large), `cold` (dequantized
    while the tile's kernel was compiling)."""
    return {k: _counts[k] for k in ("vector", "tile", "dequantized", "cold")}


def product(layer: nn.QuantizedLinear | nn.QuantizedEmbedding, x: mx.array) -> mx.array:
    """`x` times the layer's quantized weight (transposed), the way its rows call for (module docstring)."""
    rows = x.size // x.shape[-1]
    if rows < VECTOR_ROWS:
        _counts["vector"] += 1
        way = "mlx"
    elif rows >= DEQUANTIZE_ROWS:
        _counts["dequantized"] += 1
        way = "dequantize"
    elif not _compiling or (str(x.dtype).removeprefix("mlx.core."), layer.bits, layer.group_size,
                            tile_of(rows)) not in _compiling:
        _counts["tile"] += 1
        way = "mlx"
    else:
        _counts["cold"] += 1
        way = "dequantize"
    if way == "mlx":
        return mx.quantized_matmul(x, layer["weight"], scales=layer["scales"], biases=layer.get("biases"),
                                   transpose=True, group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    weight = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), group_size=layer.group_size,
                           bits=layer.bits, mode=layer.mode).astype(x.dtype)
    return x @ weight.T


class ByRows(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product goes by its rows (`product`). `install` gives a loaded layer this
    class; its parameters and their names stay as they are."""

    def __call__(self, x: mx.array) -> mx.array:
        out = product(self, x)
        return out + self["bias"] if "bias" in self else out


class EmbeddingByRows(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose `as_linear` (the output head of a model that ties it to its embedding: a
    batch's logits are a product of its rows) goes by its rows too."""

    def as_linear(self, x: mx.array) -> mx.array:
        return product(self, x)


def install(model: nn.Module) -> int:
    """Give every affine quantized linear layer of `model`, and a quantized embedding's use as the output head,
    the products by rows (`ByRows`, `EmbeddingByRows`); how many layers. (A mixture of experts' quantized
    layers take MLX's gathered products: left as they are.)"""
    n = 0
    for _, module in model.named_modules():
        if module.__class__ in _BY_ROWS and module.mode == "affine":
            module.__class__ = _BY_ROWS[module.__class__]
            n += 1
    return n


_BY_ROWS: dict[type, type] = {nn.QuantizedLinear: ByRows, nn.QuantizedEmbedding: EmbeddingByRows}
