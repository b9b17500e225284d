"""A quantized model's products on CUDA: MLX's vector kernel for a few rows, the weight dequantized for more.

MLX on CUDA multiplies by affine-quantized weights two ways, by the rows of the product: fewer than 8 rows by
its vector kernel (built into its library; it reads the weight once a row), more by tile kernels it compiles
with NVRTC at first use, each a compile of tens of seconds that a request would wait for (a fresh machine's
first prefill, a batch's first decode step). Those tile kernels are also slower than dequantizing the weight
and multiplying in the activations' dtype (cuBLAS) once the rows are many (docs/benchmarks.md, "4-bit
products").

So a quantized layer here (`install`; a quantized embedding too, as the output head a tied model makes of it)
takes, with the kernel (`install(kernel=True)`: the engine asks for it once it is built, tuning
`quantized_kernel`), products of 2 to 32 rows (a batch decoding, a prefill chunk that short) by kvwake's
kernel, which reads the 4-bit weight once and dequantizes it in registers (model/quantized_kernel.py);
otherwise MLX's own call below VECTOR_ROWS rows (fewer than the 8 MLX gives its vector kernel: from 6 rows a
dequantized product costs less), and from there the weight dequantized, then a plain product. Nothing is ever
compiled for it at a request (the kernel is built beside the load), and which way a product goes depends on
its rows and the layer only: a row's result through the kernel is the same in any batch of 2 to 32 rows (a
row alone takes MLX's vector kernel).

Only the affine mode (what `mlx_lm convert -q` writes); CUDA only (Metal has its own kernels; on the CPU the
layers are left as they are). The numbers differ from MLX's own call by the products' rounding, as they
already differ between its kernels by rows (docs/decisions.md).
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import mlx.nn as nn

from kvwake.daemon.model import quantized_kernel

__all__ = ["VECTOR_ROWS", "ByRows", "EmbeddingByRows", "counts", "install", "product"]

# below: MLX's vector kernel, in its library, which reads the weight once a row; from here: dequantized, whose
# cost is the same whatever the rows (where the two meet: docs/benchmarks.md, "4-bit products")
VECTOR_ROWS = 6
# products taken each way, for status: counted without a lock (a product is on an engine thread's hot path, and
# two models' threads racing on a count lose one now and then, no more)
_counts: Counter[str] = Counter()


def counts() -> dict[str, int]:
    """Products taken each way since the start: `kernel` (model/quantized_kernel.py), `vector` (MLX's call),
    `dequantized`."""
    return {k: _counts[k] for k in ("kernel", "vector", "dequantized")}


def product(layer: nn.QuantizedLinear | nn.QuantizedEmbedding, x: mx.array) -> mx.array:
    """`x` times the layer's quantized weight (transposed), the way its rows call for (module docstring)."""
    if getattr(layer, "_kernel", False) and quantized_kernel.takes_rows(x, layer["scales"].dtype):
        _counts["kernel"] += 1
        return quantized_kernel.kernel_product(x, layer["weight"], layer["scales"], layer["biases"])
    if x.size // x.shape[-1] < VECTOR_ROWS:
        _counts["vector"] += 1
        return mx.quantized_matmul(x, layer["weight"], scales=layer["scales"], biases=layer.get("biases"),
                                   transpose=True, group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    _counts["dequantized"] += 1
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


def install(model: nn.Module, kernel: bool = False) -> int:
    """Give every affine quantized linear layer of `model`, and a quantized embedding's use as the output head,
    the products by rows (`ByRows`, `EmbeddingByRows`); with `kernel`, up to quantized_kernel.ROWS rows by
    kvwake's kernel where it takes the layer (CUDA only: the caller's to know). How many layers were new to it
    (installed again, a layer only takes the new `kernel`). (A mixture of experts' quantized layers take MLX's
    gathered products: left as they are.)"""
    n = 0
    for _, module in model.named_modules():
        if module.__class__ in _BY_ROWS and module.mode == "affine":
            module.__class__ = _BY_ROWS[module.__class__]
            n += 1
        if module.__class__ in _BY_ROWS.values():  # whether the kernel takes its weight, asked once here
            taken = kernel and quantized_kernel.takes(module["weight"], module["scales"], module.get("biases"),
                                                      module.group_size, module.bits)
            object.__setattr__(module, "_kernel", taken)  # not a parameter nor a child
    return n


_BY_ROWS: dict[type, type] = {nn.QuantizedLinear: ByRows, nn.QuantizedEmbedding: EmbeddingByRows}
