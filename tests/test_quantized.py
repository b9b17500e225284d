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

from kvwake.daemon.model import attention, quantized, quantized_kernel


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
    by the vector kernel, two calls decoding together by kvwake's kernel, which takes every layer of a hidden
    size of 128); elsewhere the layers are MLX's own and status says null. (Not the tests' hidden size of 64:
    MLX 0.32.4's own product of two rows by a 4-bit weight with 64 inputs never ends on CUDA, mlx-lm's
    BatchGenerator included: bench/q4_hang.py, docs/benchmarks.md "4-bit products".)"""
    import threading

    from mlx_lm import convert

    from testkit.daemon import Daemon
    from testkit.tinymodel import make_model_dir

    convert(hf_path=str(make_model_dir(tmp_path / "src", hidden_size=128, intermediate_size=256)),
            mlx_path=str(tmp_path / "q4"), quantize=True, q_group_size=64, q_bits=4)
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", tmp_path / "q4").start()
    try:
        with d.client() as c:
            c.call("session.create", session_id="q")
            c.call("session.append", session_id="q", tokens=[10 + i % 240 for i in range(300)])
            assert len(c.call("session.generate", session_id="q", max_tokens=4)["tokens"]) == 4
            c.call("session.fork", session_id="q", new_session_id="r")
            c.call("session.wake", session_id="r")  # awake: the two decode together from their first steps
        together, failed = threading.Barrier(2, timeout=60), []

        def generate(sid: str) -> None:
            try:
                with d.client() as c:
                    together.wait()
                    assert len(c.call("session.generate", session_id=sid, max_tokens=48)["tokens"]) == 48
            except BaseException as exc:  # noqa: BLE001 - asserted on the test's own thread
                failed.append(exc)

        threads = [threading.Thread(target=generate, args=(sid,)) for sid in ("q", "r")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failed == []
        with d.client() as c:
            q = c.call("status")["generation"]["quantized"]
        if not attention.on_cuda():
            assert q is None
        else:
            # 7 quantized products a layer (q, k, v, o, gate, up, down), and the embedding (tied: the head)
            assert q["layers"] == 2 * 7 + 1 and q["dequantize_rows"] == quantized.VECTOR_ROWS
            assert q["kernel_rows"] == quantized_kernel.ROWS
            products = q["products"]
            assert products["dequantized"] >= q["layers"] and products["vector"] >= 3 * q["layers"]
            assert products["kernel"] >= q["layers"]  # every layer's product of a step of two rows, at least once
    finally:
        assert d.stop() == 0


class Wide(nn.Module):
    """Layers the kernel takes (inner sizes of 128 and 256) beside one it does not (64)."""

    def __init__(self, group_size: int = 64) -> None:
        super().__init__()
        self.up = nn.QuantizedLinear.from_linear(nn.Linear(128, 256, bias=True), group_size=group_size, bits=4)
        self.down = nn.QuantizedLinear.from_linear(nn.Linear(256, 64, bias=False), group_size=group_size, bits=4)
        self.narrow = nn.QuantizedLinear.from_linear(nn.Linear(64, 128), group_size=group_size, bits=4)
        self.set_dtype(mx.bfloat16)

    def __call__(self, x: mx.array) -> mx.array:
        return self.narrow(self.down(self.up(x)))


def test_with_the_kernel_up_to_its_rows_go_to_it_where_it_takes_the_layer_and_installing_again_switches_it(monkeypatch):
    calls = []

    def kernel(x, weight, scales, biases, nt=None, warps=quantized_kernel.WARPS):  # stands in for the CUDA kernel
        calls.append((x.size // x.shape[-1], x.shape[-1]))
        return x @ mx.dequantize(weight, scales, biases, group_size=64, bits=4).astype(x.dtype).T

    monkeypatch.setattr(quantized_kernel, "kernel_product", kernel)
    model = Wide()
    assert quantized.install(model, kernel=True) == 3
    for rows in (1, 2, 32, 33):
        mx.eval(model(mx.random.normal((1, rows, 128)).astype(mx.bfloat16)))
    # up (128) and down (256) to the kernel from 2 to 32 rows; the narrow layer (64), 1 and 33 rows the old ways
    assert calls == [(2, 128), (2, 256), (32, 128), (32, 256)]
    assert quantized.install(model, kernel=False) == 0  # installed already: only the kernel's switch
    mx.eval(model(mx.random.normal((1, 2, 128)).astype(mx.bfloat16)))
    assert len(calls) == 4


def test_the_kernel_takes_4_bit_affine_bf16_or_fp16_rows_up_to_its_rows_over_whole_pieces():
    w, s, b = mx.quantize(mx.zeros((16, 256), mx.bfloat16), group_size=64, bits=4)
    assert quantized_kernel.takes(w, s, b, 64, 4)
    assert not quantized_kernel.takes(w, s, None, 64, 4)
    assert not quantized_kernel.takes(w, s.astype(mx.float32), b.astype(mx.float32), 64, 4)
    assert not quantized_kernel.takes(w, s[:, :2], b[:, :2], 64, 4)  # scales of another shape
    w8, s8, b8 = mx.quantize(mx.zeros((16, 256), mx.bfloat16), group_size=64, bits=8)
    assert not quantized_kernel.takes(w8, s8, b8, 64, 8)
    w64, s64, b64 = mx.quantize(mx.zeros((16, 64), mx.bfloat16), group_size=64, bits=4)
    assert not quantized_kernel.takes(w64, s64, b64, 64, 4)  # not whole pieces
    assert quantized_kernel.takes_rows(mx.zeros((3, 256), mx.bfloat16), mx.bfloat16)
    assert quantized_kernel.takes_rows(mx.zeros((4, 8, 256), mx.bfloat16), mx.bfloat16)  # 32 rows
    assert not quantized_kernel.takes_rows(mx.zeros((1, 256), mx.bfloat16), mx.bfloat16)  # one: MLX's kernel
    assert not quantized_kernel.takes_rows(mx.zeros((33, 256), mx.bfloat16), mx.bfloat16)
    assert not quantized_kernel.takes_rows(mx.zeros((3, 256), mx.float32), mx.bfloat16)


@pytest.mark.skipif(not attention.on_cuda(), reason="the kernel is CUDA's")
@pytest.mark.parametrize("n, k, group_size, dtype", [(1024, 4096, 64, mx.bfloat16), (4096, 14336, 64, mx.bfloat16),
                                                    (14336, 4096, 64, mx.bfloat16), (1000, 4096, 32, mx.bfloat16),
                                                    (20, 256, 128, mx.float16)])
def test_the_kernel_gives_the_dequantized_products_rounding_and_a_rows_result_whatever_the_other_rows(n, k, group_size,
                                                                                                      dtype):
    mx.random.seed(n + k)
    w, s, b = mx.quantize((mx.random.normal((n, k)) * 0.02).astype(dtype), group_size=group_size, bits=4)
    x = mx.random.normal((quantized_kernel.ROWS, k)).astype(dtype)
    dense = mx.dequantize(w, s, b, group_size=group_size, bits=4)
    reference = x.astype(mx.float32) @ dense.astype(mx.float32).T
    full = quantized_kernel.kernel_product(x, w, s, b)
    mlx = x @ dense.astype(dtype).T
    gap = float(mx.abs(mlx.astype(mx.float32) - reference).max())
    assert float(mx.abs(full.astype(mx.float32) - reference).max()) <= 2 * gap + 1e-6
    for rows in (1, 2, 7, 16, 17):  # one row too: the kernel computes it so, the layers give it to MLX
        assert mx.array_equal(quantized_kernel.kernel_product(x[:rows], w, s, b), full[:rows]), rows
    assert mx.array_equal(quantized_kernel.kernel_product(x[None, 31:], w, s, b)[0, 0], full[31])
    for nt in (2, 4):  # the column runs a block: the same bits
        assert mx.array_equal(quantized_kernel.kernel_product(x, w, s, b, nt=nt), full)


def test_the_loading_thread_builds_the_4_bit_kernel_for_a_4_bit_affine_model_only_and_says_whether_it_did(
        tmp_path, monkeypatch):
    """The engine takes the kernel only where the thread beside the load built it: a GPU that cannot run it
    (its compile fails) keeps MLX's products rather than failing every batched step."""
    import json

    from kvwake.daemon.model import kernel_cache
    from testkit.tinymodel import make_model_dir

    built = []
    monkeypatch.setattr(quantized_kernel, "build", lambda dtype: built.append(dtype) or True)
    path = make_model_dir(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())

    def beside(quantization=None, asked=True) -> bool:
        (path / "config.json").write_text(json.dumps({**config, **({"quantization": quantization}
                                                                    if quantization else {})}))
        load = kernel_cache.BesideLoad(path, False, None, quantized=asked)
        load.result()
        return load.quantized_built

    assert not beside() and built == []  # not quantized
    assert not beside({"group_size": 64, "bits": 8}) and built == []
    assert not beside({"group_size": 32, "bits": 4, "mode": "mxfp4"}) and built == []
    assert not beside({"group_size": 64, "bits": 4}, asked=False) and built == []  # tuning off
    assert beside({"group_size": 64, "bits": 4}) and built == [mx.bfloat16]

    def fails(dtype):
        raise RuntimeError("nvrtc: mma with .bf16 requires sm_80 or higher")

    monkeypatch.setattr(quantized_kernel, "build", fails)
    assert not beside({"group_size": 64, "bits": 4})
