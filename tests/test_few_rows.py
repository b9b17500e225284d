"""A plain linear layer's products for a few rows by kvwake's tensor-core kernel (daemon/model/few_rows.py).

The kernel is CUDA's: here on the CPU the layers' routing, the shapes it takes and what the engine and the
loading thread do with it are checked (the kernel itself stood in for where a product is routed); on CUDA the
kernel's numbers against a float32 product, a row's result whatever the other rows, and a model's logits.
What it saves is measured on the GPU (docs/benchmarks.md, "few_rows").
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from kvwake.daemon.kv import cudart
from kvwake.daemon.model import few_rows, kernel_cache

from testkit.tinymodel import make_model_dir

on_cuda = pytest.mark.skipif(not cudart.on_cuda(), reason="the kernel is CUDA's")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(96, 64, bias=False), nn.Linear(96, 32, bias=False)
        self.v_proj = nn.Linear(96, 32, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)


class Net(nn.Module):
    def __init__(self, dtype: mx.Dtype = mx.bfloat16) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 96)
        self.attention = Attention()
        self.up = nn.Linear(128, 128, bias=True)
        self.down = nn.Linear(128, 96, bias=False)
        self.wide = nn.QuantizedLinear.from_linear(nn.Linear(128, 128), group_size=64, bits=4)
        self.set_dtype(dtype)

    def __call__(self, tokens: mx.array) -> mx.array:
        # a tied head's logits
        return self.embed.as_linear(self.down(self.up(self.attention(self.embed(tokens)))))


def test_install_takes_plain_bf16_and_fp16_layers_only_keeps_their_parameters_and_uninstall_undoes_it():
    model = Net()
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert few_rows.install(model) == 6  # q, k, v, up, down and the embedding's head; not the quantized layer
    assert type(model.up) is few_rows.ByRows and type(model.down) is few_rows.ByRows
    assert type(model.embed) is few_rows.EmbeddingByRows and type(model.wide) is nn.QuantizedLinear
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    assert few_rows.install(model) == 0  # once
    assert few_rows.uninstall(model) == 6 and type(model.up) is nn.Linear and type(model.embed) is nn.Embedding
    assert not hasattr(model.attention.q_proj, "_few_rows_group")
    assert few_rows.install(Net(mx.float32)) == 0  # float32: MLX's products


def test_takes_up_to_rows_rows_of_the_weights_dtype_over_whole_pieces():
    w = mx.zeros((40, 64), mx.bfloat16)
    assert few_rows.takes(mx.zeros((2, 64), mx.bfloat16), w)
    assert not few_rows.takes(mx.zeros((1, 64), mx.bfloat16), w)  # one row: MLX's vector kernel
    assert few_rows.takes(mx.zeros((4, 8, 64), mx.bfloat16), w)  # 32 rows in a batch of 4 x 8
    assert not few_rows.takes(mx.zeros((33, 64), mx.bfloat16), w)
    assert not few_rows.takes(mx.zeros((2, 64), mx.float16), w)
    assert not few_rows.takes(mx.zeros((2, 48), mx.bfloat16), mx.zeros((40, 48), mx.bfloat16))  # not whole pieces
    assert not few_rows.takes(mx.zeros((0, 64), mx.bfloat16), w)


def test_a_layers_products_go_to_the_kernel_up_to_rows_rows_and_to_mlx_beyond_with_the_bias_added(monkeypatch):
    calls = []

    def kernel(x, weights, nt=None, warps=few_rows.WARPS):  # stands in for the CUDA kernel: MLX's products
        calls.append((x.size // x.shape[-1], len(weights)))
        return [x @ w.T for w in weights]

    monkeypatch.setattr(few_rows, "kernel_product", kernel)
    reference, model = Net(), Net()
    model.update(reference.parameters())
    few_rows.install(model)
    before = few_rows.counts()
    for shape in ((2, 1), (4, 8), (1, 40), (1, 1)):
        tokens = mx.arange(shape[0] * shape[1]).reshape(shape) % 64
        got, want = model(tokens), reference(tokens)
        if shape[0] * shape[1] in (1, 40):  # MLX's way: the layer's own call, its bias fused as MLX adds it
            assert mx.array_equal(got, want)
        else:  # the kernel's: the bias added after the product (a rounding apart)
            assert mx.allclose(got, want, atol=2e-3)
    # a pass: q, k and v in one launch, then up, down and the head; 2 and 32 rows to the kernel, 40 and 1 to MLX
    assert calls == [(2, 3), (2, 1), (2, 1), (2, 1), (32, 3), (32, 1), (32, 1), (32, 1)]
    after = few_rows.counts()
    assert after["kernel"] - before["kernel"] == 12 and after["launches"] - before["launches"] == 8
    assert after["mlx"] - before["mlx"] == 12


def test_a_group_member_called_with_another_input_computes_its_own_and_nothing_is_kept_once_taken(monkeypatch):
    launches = []

    def kernel(x, weights, nt=None, warps=few_rows.WARPS):
        launches.append(len(weights))
        return [x @ w.T for w in weights]

    monkeypatch.setattr(few_rows, "kernel_product", kernel)
    attention = Attention()
    attention.set_dtype(mx.bfloat16)
    few_rows.install(attention)
    x, other = mx.ones((2, 96), mx.bfloat16), mx.zeros((2, 96), mx.bfloat16)
    group = attention.q_proj._few_rows_group
    q = attention.q_proj(x)
    k = attention.k_proj(other)  # another input: the group's products of it, not x's
    assert launches == [3, 3] and mx.array_equal(k, other @ attention.k_proj.weight.T)
    v = attention.v_proj(other)  # taken from the second launch
    assert launches == [3, 3] and mx.array_equal(v, other @ attention.v_proj.weight.T + attention.v_proj.bias)
    assert q.shape == (2, 64) and group.input is not None  # q's product of `other` still waits
    attention.q_proj(other)
    assert group.input is None and not group.waiting


def test_the_loading_thread_builds_the_kernel_for_a_plain_model_and_not_for_a_quantized_one(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(few_rows, "build", lambda dtype: built.append(dtype) or True)
    plain = make_model_dir(tmp_path / "plain", dtype=mx.float16)
    kernel_cache.BesideLoad(plain, False, None, linears=True).result()
    assert built == [mx.float16]
    kernel_cache.BesideLoad(plain, False, None).result()  # not asked for
    assert built == [mx.float16]
    import json

    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 64, "bits": 4}}))
    kernel_cache.BesideLoad(plain, False, None, linears=True).result()
    assert built == [mx.float16]


def test_the_engine_installs_it_only_on_cuda_and_with_the_knob_on(tmp_path, model_dir):
    from kvwake.daemon.config import Tuning
    from kvwake.daemon.model.engine import Engine
    from kvwake.store import Store

    for on in (True, False):
        store = Store(tmp_path / f"store{on}", block_tokens=16)
        engine = Engine(store, tmp_path, model_dir, warm=False, tuning=Tuning(few_rows=on))
        try:
            installed = any(type(m) is few_rows.ByRows for _, m in engine.model.named_modules())
            assert installed == (on and cudart.on_cuda())
            assert (engine.few_rows_status() is not None) == installed
        finally:
            engine.close()
            store.close()


@on_cuda
@pytest.mark.parametrize("n, k", [(1024, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (1000, 4096), (20, 96)])
def test_the_kernel_gives_a_float32_products_rounding_and_a_rows_result_whatever_the_other_rows(n, k):
    mx.random.seed(n + k)
    w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
    x = mx.random.normal((few_rows.ROWS, k)).astype(mx.bfloat16)
    reference = x.astype(mx.float32) @ w.astype(mx.float32).T
    full = few_rows.kernel_product(x, [w])[0]
    mlx = x @ w.T
    # within twice MLX's own bf16 product's largest difference from the float32 one (the output's rounding)
    assert float(mx.abs(full.astype(mx.float32) - reference).max()) <= 2 * float(
        mx.abs(mlx.astype(mx.float32) - reference).max()) + 1e-6
    for rows in (1, 2, 3, 8, 16, 17):  # one row too: the kernel takes it, the layers give it to MLX
        assert mx.array_equal(few_rows.kernel_product(x[:rows], [w])[0], full[:rows]), rows
    assert mx.array_equal(few_rows.kernel_product(x[31:], [w])[0][0], full[31])
    for nt in (2, 4):  # the column runs a block: the same bits
        assert mx.array_equal(few_rows.kernel_product(x, [w], nt=nt)[0], full)
    # in a group of three (the middle one narrow): each its own bits
    grouped = few_rows.kernel_product(x, [w, w[:24], w])
    assert all(mx.array_equal(a, b) for a, b in zip(grouped, (full, full[:, :24], full)))


@on_cuda
def test_a_models_logits_with_the_kernel_are_mlxs_within_rounding_and_the_same_for_a_row_alone_or_batched(tmp_path):
    from mlx_lm import load

    model, _ = load(str(make_model_dir(tmp_path / "m", dtype=mx.bfloat16)))
    tokens = mx.arange(24).reshape(8, 3) % 200
    before = model(tokens)
    assert few_rows.install(model) > 0
    after = model(tokens)
    alone = model(tokens[2:3])
    assert float(mx.abs(after.astype(mx.float32) - before.astype(mx.float32)).max()) < 0.1
    assert mx.array_equal(alone[0], after[2])
