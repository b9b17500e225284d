"""A quantized model's products on CUDA, chosen by their rows.

MLX on CUDA multiplies by affine-quantized weights three ways, by the rows of the product: fewer than 8 rows
by its vector kernel (built into its library), more by a CuTe tile kernel it compiles with NVRTC at first use,
one per tile (16, 32 or 64 rows), each compile about 30 s of one core. Measured on the H200
(bench/q4_kernels.py, docs/benchmarks.md "4-bit products"), that tile kernel is also about 3x slower than
dequantizing the weight and multiplying in its own dtype (cuBLAS) once the rows are many: a prefill chunk's
product of 2,048 rows by a 14,336 x 4,096 weight takes 2.3 ms through it and 0.7 ms dequantized.

So a quantized layer here (`install`) takes, by its product's rows:
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

__all__ = ["DEQUANTIZE_ROWS", "TILES", "VECTOR_ROWS", "ByRows", "compiling", "counts", "done", "install",
           "starting", "tile_of"]

VECTOR_ROWS = 8  # below: MLX's vector kernel, in its library
DEQUANTIZE_ROWS = 256  # from here dequantized: about where the tile kernel's time passes a dequantize's
TILES = (16, 32, 64)  # MLX's tile kernels by rows: up to 16, up to 32, more

_lock = threading.Lock()
_compiling: Counter[tuple[str, int, int, int]] = Counter()  # (dtype, bits, group size, tile): warmers at work
_counts: Counter[str] = Counter()  # products taken each way, for status


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


class ByRows(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product goes by its rows (module docstring). `install` gives a loaded layer
    this class; its parameters and their names stay as they are."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows < VECTOR_ROWS:
            _counts["vector"] += 1
            return super().__call__(x)
        if rows < DEQUANTIZE_ROWS:
            if not _compiling or (str(x.dtype).removeprefix("mlx.core."), self.bits, self.group_size,
                                  tile_of(rows)) not in _compiling:
                _counts["tile"] += 1
                return super().__call__(x)
            _counts["cold"] += 1
        else:
            _counts["dequantized"] += 1
        weight = mx.dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                               bits=self.bits, mode=self.mode).astype(x.dtype)
        out = x @ weight.T
        return out + self["bias"] if "bias" in self else out


def install(model: nn.Module) -> int:
    """Give every affine nn.QuantizedLinear of `model` the products by rows (`ByRows`); how many layers."""
    n = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and module.mode == "affine":
            module.__class__ = ByRows
            n += 1
    return n
