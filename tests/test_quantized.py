"""A quantized model's products by their rows (daemon/model/quantized.py).

The engine installs them on CUDA only, where MLX compiles its tile kernels at first use; the choice and the
numbers are the same code here, so each rows' way and the results against MLX's own layer are checked on the
CPU too. What it saves on the GPU (a first round's compiles, prefill's products) is measured there
(docs/benchmarks.md, "4-bit products").
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from kvwake.daemon.model import attention, quantized


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.QuantizedLinear.from_linear(nn.Linear(256, 128, bias=True), group_size=64, bits=4)
        self.down = nn.QuantizedLinear.from_linear(nn.Linear(128, 256, bias=False), group_size=64, bits=4)
        self.plain = nn.Linear(256, 256)
        self.embed = nn.QuantizedEmbedding.from_embedding(nn.Embedding(64, 256), group_size=64, bits=4)

    def __call__(self, x: mx.array) -> mx.array:
        return self.embed.as_linear(self.plain(self.down(self.up(x))))  # a tied head's logits


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in quantized.counts().items() if v != before[k]}


def test_install_gives_the_quantized_layers_the_products_by_rows_and_leaves_their_parameters():
    model = Two()
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert quantized.install(model) == 3
    assert type(model.up) is quantized.ByRows and type(model.down) is quantized.ByRows
    assert type(model.embed) is quantized.EmbeddingByRows and type(model.plain) is nn.Linear
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    assert quantized.install(model) == 0  # once


@pytest.mark.parametrize("rows, way", [(1, "vector"), (5, "vector"), (6, "dequantized"), (8, "dequantized"),
                                       (100, "dequantized"),
                                       (600, "dequantized")])
def test_each_products_rows_take_their_way_and_give_what_mlxs_layer_gives(rows, way):
    reference = Two()
    model = Two()
    model.update(reference.parameters())
    quantized.install(model)
    x = mx.random.normal((1, rows, 256))
    before = quantized.counts()
    out, want = model(x), reference(x)
    assert _delta(before) == {way: 3}  # the pass's quantized layers and its tied head
    # float32: MLX's quantized product and the dequantized one differ by the sums' order only; on CUDA MLX's
    # float32 product rounds its inputs to TF32 (10 bits of mantissa)
    tolerance = 2e-3 if attention.on_cuda() else 1e-4
    assert mx.abs(out - want).max().item() <= tolerance * max(1.0, mx.abs(want).max().item())


def test_from_vector_rows_mlxs_quantized_product_is_never_called(monkeypatch):
    """What MLX would compile a tile kernel for (8 rows or more) never reaches its quantized product, nor do the
    6-7 rows its vector kernel reads the weight for 6-7 times: a spy on it sees the fewer rows only."""
    model = Two()
    quantized.install(model)
    seen: list[int] = []
    real = mx.quantized_matmul

    def spy(x, *args, **kwargs):
        seen.append(x.size // x.shape[-1])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(quantized.mx, "quantized_matmul", spy)
    for rows in (1, 5, 6, 7, 8, 16, 64, 300):
        mx.eval(model(mx.random.normal((1, rows, 256))))
    assert seen == [1] * 3 + [5] * 3  # three quantized products a pass, the fewer rows' only


def test_a_quantized_models_daemon_says_how_its_products_went(tmp_path):
    """A real daemon on a 4-bit model (`mlx_lm convert -q` of the tiny one): on CUDA its quantized layers take
    the products by rows and status counts them (a 300-token append dequantized, a lone call's decode steps
    by the vector kernel); elsewhere the layers are MLX's own and status says null."""
    from mlx_lm import convert

    from testkit.daemon import Daemon
    from testkit.tinymodel import make_model_dir

    convert(hf_path=str(make_model_dir(tmp_path / "src")), mlx_path=str(tmp_path / "q4"), quantize=True,
            q_group_size=64, q_bits=4)
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", tmp_path / "q4").start()
    try:
        with d.client() as c:
            c.call("session.create", session_id="q")
            c.call("session.append", session_id="q", tokens=[10 + i % 240 for i in range(300)])
            assert len(c.call("session.generate", session_id="q", max_tokens=4)["tokens"]) == 4
            q = c.call("status")["generation"]["quantized"]
        if not attention.on_cuda():
            assert q is None
        else:
            # 7 quantized products a layer (q, k, v, o, gate, up, down), and the embedding (tied: the head)
            assert q["layers"] == 2 * 7 + 1 and q["dequantize_rows"] == quantized.VECTOR_ROWS
            assert q["products"]["dequantized"] >= q["layers"] and q["products"]["vector"] >= 3 * q["layers"]
    finally:
        assert d.stop() == 0
