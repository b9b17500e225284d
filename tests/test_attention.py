"""Plain-ops prefill attention (daemon/model/attention.py): the same numbers as the fused kernel, swapped in and out."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from kvwake.daemon.config import Tuning
from kvwake.daemon.kv import cache_blocks as kvstate
from kvwake.daemon.model.attention import PLAIN_MAX_BYTES, plain_attention, plain_prefill


@pytest.fixture(scope="module")
def model(model_dir):
    return mlx_lm.load(str(model_dir))[0]


# A KVCache's buckets over its buffer, whatever the default: a paged cache has no buffer, its turns pad instead
# (`test_a_paged_sessions_short_turns_past_cudnn_min_share_a_padded_shape_built_ahead`)
BUFFERS = Tuning(paged_kv=False)


def logits_after(model, prefix: mx.array, chunk: mx.array, plain: bool) -> mx.array:
    cache = make_prompt_cache(model)
    model(prefix[None], cache=cache)
    mx.eval([c.state for c in cache])
    if plain:
        with plain_prefill(model):
            out = model(chunk[None], cache=cache)
    else:
        out = model(chunk[None], cache=cache)
    return out.astype(mx.float32)


def float64_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal grouped-query attention in float64 numpy: the reference both attentions approximate."""
    rep, q_len, k_len = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    scores[..., np.arange(k_len)[None] > np.arange(k_len - q_len, k_len)[:, None]] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("q_len", [2, 35, 200])
def test_plain_attention_is_as_exact_as_the_fused_kernel(q_len):
    shapes = {"q": (1, 8, q_len, 128), "k": (1, 2, 700, 128), "v": (1, 2, 700, 128)}
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)).astype(mx.bfloat16) for i, s in enumerate(shapes.values()))
    scale = 128 ** -0.5
    exact = float64_attention(*(np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v)), scale)
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    plain = plain_attention(None)(q, k, v, None, scale, "causal")
    fused_error, plain_error = (np.abs(np.array(x.astype(mx.float32)) - exact).max() for x in (fused, plain))
    print(f"q_len {q_len}: max error against float64: fused {fused_error:.5f}, plain {plain_error:.5f}")
    assert plain.dtype == mx.bfloat16 and plain.shape == fused.shape
    assert plain_error <= fused_error * 1.1 + 1e-6


@pytest.mark.parametrize("chunk", [2, 7, 64])
def test_plain_prefill_gives_the_models_logits(model, chunk):
    tokens = mx.random.randint(0, 256, (100 + chunk,), key=mx.random.key(chunk)).astype(mx.uint32)
    fused = logits_after(model, tokens[:100], tokens[100:], plain=False)
    plain = logits_after(model, tokens[:100], tokens[100:], plain=True)
    # Within bf16's reach of each other (a wrong mask or head grouping moves logits by their whole range).
    assert plain.shape == fused.shape
    assert mx.abs(fused - plain).max().item() < 0.1 * mx.abs(fused).max().item()


def test_the_fused_kernel_is_back_after_the_chunk_and_big_chunks_keep_it(model):
    fused = llama.scaled_dot_product_attention
    with plain_prefill(model):
        assert llama.scaled_dot_product_attention is not fused
    assert llama.scaled_dot_product_attention is fused
    calls = []
    attention = plain_attention(lambda *a, **k: calls.append(k["mask"]) or "fused")
    q = mx.zeros((1, 4, 8, 16))
    keys = mx.zeros((1, 2, 8, 16))
    assert attention(q, keys, keys, None, 1.0, mx.zeros((8, 8))) == "fused"  # an array mask: the kernel's
    huge = PLAIN_MAX_BYTES // (4 * 4) + 1  # one query's scores over this many keys pass the byte bound
    assert attention(q, mx.zeros((1, 2, huge, 16)), mx.zeros((1, 2, huge, 16)), None, 1.0, "causal") == "fused"
    assert attention(q[:, :, :1], keys, keys, None, 1.0, None) == "fused"  # one query: the vector kernel
    assert len(calls) == 3 and attention(q, keys, keys, None, 1.0, "causal").shape == (1, 4, 8, 16)


def test_a_short_chunk_over_many_keys_runs_plain_in_pieces_of_queries(monkeypatch):
    from kvwake.daemon.model import attention

    shapes = {"q": (1, 8, 40, 64), "k": (1, 2, 900, 64), "v": (1, 2, 900, 64)}
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)) for i, s in enumerate(shapes.values()))
    fused = []
    plain = plain_attention(lambda *a, **kw: fused.append(1))
    whole = plain(q, k, v, None, 0.125, "causal")
    monkeypatch.setattr(attention, "PLAIN_MAX_BYTES", 8 * 7 * 900 * 4)  # 7 query rows per piece: 6 pieces
    pieces = plain(q, k, v, None, 0.125, "causal")
    assert not fused
    if mx.default_device() == mx.cpu:  # the CPU sums each piece as it sums the whole
        assert mx.allclose(whole, pieces, atol=1e-6).item()
        return
    # CUDA's float32 matmuls pick kernels (and TF32 paths) by shape: pieces differ from the whole in the last
    # bits, so both are held to a float64 reference: the pieces are no less exact than the whole.
    exact = float64_attention(*(np.array(x, dtype=np.float64) for x in (q, k, v)), 0.125)
    whole_error, pieces_error = (np.abs(np.array(x) - exact).max() for x in (whole, pieces))
    print(f"from float64: pieces {pieces_error:.2e}, the whole {whole_error:.2e}")
    assert pieces_error <= 2 * whole_error + 1e-6, f"pieces {pieces_error:.2e} from float64, the whole {whole_error:.2e}"


def test_path_costs_choose_plain_ops_where_they_cost_less_than_a_new_fused_shape(model):
    from kvwake.daemon.model.attention import PathCosts

    # Per layer: plain 1 ms at 1k keys and 8 ms at 8k, fused 0.5 and 2 ms, and a 100 ms build for a new shape.
    paths = PathCosts(layers=32, queries=128, table=[(1024, 0.001, 0.0005, 0.1), (8192, 0.008, 0.002, 0.1)])
    assert paths.costs(128, 1024) == pytest.approx((0.032, 0.116))
    assert paths.plain(128, 4000)  # 32 x ~4 ms plain against a build and 32 x ~1.1 ms
    assert not paths.plain(128, 8192)  # 256 ms plain: the fused build pays ...
    assert paths.costs(128, 8192, new=False)[1] == pytest.approx(0.064)  # ... and once built costs no build
    assert not paths.plain(128, 4000, new=False)  # a shape built before: fused (32 x ~1.1 ms)
    assert not paths.plain(64, 65536)  # beyond the table: plain scaled with the keys, 1 s
    measured = PathCosts.measure(model, [256, 1024], queries=16, repeats=1)
    assert [row[0] for row in measured.table] == [256, 1024] and measured.layers == len(model.layers)
    assert all(plain > 0 and fused > 0 and extra >= 0 for _, plain, fused, extra in measured.table)


def test_the_attention_paths_are_measured_once_a_process_and_every_engine_of_the_shape_takes_that(model, monkeypatch):
    # MLX keeps a fused graph for the process: a second engine of the shape (a twin, a model reloaded after an
    # unload) measured no build at the probe's new shape, which the first had built, and chose the fused kernel
    # where the first chose plain ops, so the same chunk ran on another path in each, to other bits (test_packing's
    # twin engines on CUDA: docs/decisions.md). Measured once, every engine of the shape decides alike.
    from kvwake.daemon.model import attention

    monkeypatch.setattr(attention, "_measured", {})
    timed = []

    def fake(heads, kv_heads, head_dim, dtype, queries, keys, repeats):
        timed.append((dtype, keys))
        return 0.001, 0.0005, 0.1 if len(timed) <= 2 else 0.0  # a build, then (graphs kept) none

    monkeypatch.setattr(attention, "_timed_paths", fake)
    first, second = (attention.PathCosts.measure(model, [256, 1024], queries=16, repeats=1) for _ in range(2))
    assert first.table == second.table == [(256, 0.001, 0.0005, 0.1), (1024, 0.001, 0.0005, 0.1)]
    assert len(timed) == 2 and second.layers == len(model.layers)  # the second engine measured nothing
    # another context's ladder: only its own lengths measured (a length measured before had its build seen then)
    other = attention.PathCosts.measure(model, [256, 4096], queries=16, repeats=1)
    assert timed[2:] == [(timed[0][0], 4096)] and other.table == [(256, 0.001, 0.0005, 0.1), (4096, 0.001, 0.0005, 0.0)]


def test_a_copied_prefix_then_plain_prefill_continues_like_one_cache(model):
    tokens = mx.random.randint(0, 256, (90,), key=mx.random.key(5)).astype(mx.uint32)
    cache = make_prompt_cache(model)
    model(tokens[:60][None], cache=cache)
    mx.eval([c.state for c in cache])
    twin = kvstate.copy_prefix(cache, 60)
    with plain_prefill(model):
        a = model(tokens[60:][None], cache=cache)
        b = model(tokens[60:][None], cache=twin)
    assert mx.array_equal(a, b).item()


def test_the_engine_takes_plain_attention_only_for_a_short_chunk_where_it_costs_less(model_dir, tmp_path, monkeypatch):
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=32)
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.001, 0.001, 0.1)])  # a new fused shape: 100 ms more
    used, real = [], attention.plain_attention  # made once per chunk that runs plain
    monkeypatch.setattr(attention, "plain_attention", lambda f, *a: used.append(f) or real(f, *a))
    got = engine.append(Session("s"), tokens=list(range(1, 80)))  # 78 to prefill: chunks of 32, 32, 14
    assert got["prefilled"] == 78 and len(used) == 1
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.1, 0.001, 0.001)])  # plain ops cost more: fused
    engine.append(Session("t"), tokens=list(range(1, 80)))
    assert len(used) == 1
    # Plain costs less than a build but more than a built graph: the shapes "t" ran fused (the engine's
    # one record, buffer capacity included) are built, so the same chunks stay fused.
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.002, 0.001, 0.1)])
    engine.append(Session("u"), tokens=list(range(1, 80)))
    assert len(used) == 1
    engine.append(Session("v"), tokens=list(range(1, 84)))  # its last chunk (18 tokens) never ran: plain
    assert len(used) == 2
    engine.close()
    store.close()


@pytest.mark.parametrize("paged", [False, True], ids=["buffers", "pages"])
def test_before_the_costs_are_measured_a_short_chunk_runs_plain_only_below_cudnn_min_keys(model_dir, tmp_path,
                                                                                          monkeypatch, paged):
    # Was: with no costs yet every short chunk ran plain ops. The daemon measures them in idle moments, which an
    # agent's turns coming one after another did not leave: each turn over a long context ran plain ops where
    # the fused kernel at its shared shape costs a fraction (docs/benchmarks.md, "A lone agent's turn before the
    # warm-up measured its paths").
    from kvwake.daemon.kv import capacity
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA: plain and bucketed prefill on,
    monkeypatch.setattr(attention, "bucket_wanted", lambda: True)
    installed = capacity.installed()  # and buffers grown by kv/capacity.py's rule (an engine on CUDA installs it)
    capacity.install()
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=512, tuning=Tuning(paged_kv=paged))
    engine.planner.paths = None  # as a daemon's before its warm-up's last job
    args = engine.model.args
    dtype = engine.pages.pool.layout.dtype if paged else mx.float32

    def path(held: int) -> str:
        session = Session("s")
        session.cache = engine.make_cache()
        for c in session.cache:
            keys = mx.zeros((1, args.num_key_value_heads, held,
                             args.head_dim or args.hidden_size // args.num_attention_heads), dtype)
            c.state = (keys, keys, held)
        session.tokens, session.processed = [5] * (held + 131), held
        return engine.planner._path(session, 131, held + 131, sliced=False)[0]

    try:
        shared = "padded" if paged else "bucket"  # a paged turn's padded shape, or a bucket over the buffer
        assert path(4096) == "plain" and path(capacity.CUDNN_MIN - 132) == "plain"
        assert path(capacity.CUDNN_MIN - 131) == shared and path(capacity.CUDNN_MIN + 4096) == shared
        if paged:  # no shape to share (the padded mask too large): plain, a graph of its own each turn otherwise
            monkeypatch.setattr(attention, "PADDED_MASK_BYTES", 1)
            assert path(capacity.CUDNN_MIN + 4096) == "plain"
        engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.001, 0.1, 0.1)])  # measured: costs decide again
        assert path(capacity.CUDNN_MIN + 4096) == "plain"
    finally:
        if not installed:
            capacity.uninstall()
        engine.close()
        store.close()


def test_a_full_chunks_new_fused_shape_runs_plain_beside_a_decoding_call_until_it_comes_back(model_dir, tmp_path,
                                                                                           monkeypatch):
    # On CUDA the first slice of a chunk whose cuDNN graph is new (a (queries, keys, buffer capacity)
    # this process never ran: after a prefix hit, every chunk) pays its build: a decoding neighbour's gap
    # (docs/decisions.md, "Many agents at once (issue 24)").
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.model.scheduler.prefill import PLAIN_BEFORE_BUILD
    from kvwake.daemon.model.generation import GenerateParams
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=32)
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.1, 0.001, 0.001)])  # short chunks: fused is cheaper
    used, real = [], attention.plain_attention  # made once per chunk that runs plain
    monkeypatch.setattr(attention, "plain_attention", lambda f, q=attention.PLAIN_MAX_QUERIES: used.append(q) or real(f, q))
    tokens = list(range(1, 66))  # 64 to prefill: two full chunks of 32
    engine.append(Session("alone"), tokens=tokens)
    assert used == []  # nobody decodes: fused, its graphs built
    talker = Session("talker")
    engine.append(talker, tokens=[5, 6, 7])
    engine.decoder.join(engine.start_call(talker, GenerateParams(max_tokens=4)))  # a call decodes from now on
    engine.append(Session("seen"), tokens=tokens)
    assert used == []  # the same shapes: built already
    longer = list(range(1, 98))  # a third full chunk: a shape never run
    for k in range(PLAIN_BEFORE_BUILD + 1):
        used.clear()
        engine.append(Session(f"new{k}"), tokens=longer)
        assert used == ([attention.PLAIN_MAX_QUERIES] if k < PLAIN_BEFORE_BUILD else []), (k, used)
    cold = Session("cold")
    engine.append(cold, tokens=longer)
    assert engine.cache_bytes(cold) > 0 and cold.processed == 96
    engine.close()
    store.close()


def test_the_plain_path_warms_through_the_model_over_a_buffer_larger_than_its_keys_in_several_pieces(model, monkeypatch):
    """As a session's chunk runs it: every layer's attention, in pieces, over keys read from a slice of a
    larger buffer (strided). Warmed on contiguous tensors alone, a prompt's last chunk still paid kernel
    builds at its first attention on CUDA (docs/decisions.md, "Many agents at once (issue 24)")."""
    from mlx_lm.models.cache import KVCache

    from kvwake.daemon.model import attention

    pieces, seen = [], []
    real = mx.softmax
    monkeypatch.setattr(mx, "softmax", lambda x, **kw: pieces.append(x.shape[-2:]) or real(x, **kw))
    update = KVCache.update_and_fetch
    monkeypatch.setattr(KVCache, "update_and_fetch",
                        lambda self, k, v: seen.append((self.offset, k.shape[2], self.keys is not None and self.keys.shape[2])) or update(self, k, v))
    monkeypatch.setattr(attention, "PLAIN_MAX_BYTES", 4 * 4 * 64 * 612)  # (heads x rows x keys x 4): 64 rows at 612 keys
    assert attention.warm_plain(model, 100, 512)
    layers, heads = len(model.layers), model.args.num_attention_heads
    rows = attention.PLAIN_MAX_BYTES // (heads * 612 * 4)
    assert seen[-layers:] == [(512, 100, attention.kvcapacity.capacity(612))] * layers
    assert all(capacity > 612 for *_, capacity in seen[-layers:])  # keys a slice of a larger buffer
    assert len(pieces) == layers * -(-100 // rows) > layers and all(keys == 612 for _, keys in pieces)
    assert sum(n for n, _ in pieces) == 100 * layers


def test_a_plain_warm_up_computes_the_first_layer_and_leaves_the_others_unevaluated(model, monkeypatch):
    """Every layer has one shape, so one builds the kernels of all. Was: the warm-up evaluated every layer's
    cache, a whole chunk's forward pass (the 8B shape's first plain warm-up took most of 0.3 s on a GPU, and
    a restart's first wake waited behind it)."""
    from kvwake.daemon.model import attention

    evaluated = []
    real = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: evaluated.append(a) or real(*a))
    assert attention.warm_plain(model, 100, 512)
    arrays = [x for _, x in tree_flatten(list(evaluated[-1])) if isinstance(x, mx.array)]
    # one layer's keys and values (the second's: the first layer's output), of all
    assert len(model.layers) >= 2 and len(arrays) == 2, [a.shape for a in arrays]


def test_the_plain_path_is_warmed_aligned_and_unaligned_in_one_two_and_several_pieces():
    """MLX on CUDA builds kernels per class of shape: warmed at full aligned chunks only, an unaligned chunk
    over a long cache still paid kernel builds at its first attention, and none once unaligned shapes were
    warmed too (docs/decisions.md, "Many agents at once (issue 24)"). The attention runs over the cached
    keys and the chunk's; for the 8B shape (32 heads) the unaligned ones take one, two and three pieces of
    scores; none past the context."""
    from kvwake.daemon.model import attention

    def pieces(queries: int, cached: int) -> int:
        return -(-queries // (attention.PLAIN_MAX_BYTES // (32 * (cached + queries) * 4)))

    shapes = attention.plain_warm_shapes(512, None)
    assert any(q % 64 == 0 and (q + k) % 64 == 0 for q, k in shapes)  # a full chunk, aligned
    unaligned = [(q, k) for q, k in shapes if q % 2 and (q + k) % 64]
    assert sorted(min(pieces(q, k), 3) for q, k in unaligned) == [1, 2, 3]
    assert all(q + k <= 8192 for q, k in attention.plain_warm_shapes(512, 8192))
    assert len(attention.plain_warm_shapes(512, 8192)) < len(shapes)


def test_a_warm_up_through_a_model_whose_module_takes_attention_elsewhere_warms_nothing(model, monkeypatch):
    import sys

    from kvwake.daemon.model import attention

    monkeypatch.delattr(sys.modules[type(model).__module__], "scaled_dot_product_attention")
    assert not attention.warm_plain(model, 10, 100)


def test_the_daemon_lets_mlx_keep_many_attention_graphs():
    """MLX on CUDA raises once its fused-attention graph cache (256 by default) has missed twice its size over
    the process's life; importing the engine raises that size, unless the user set it (a fresh process each)."""
    import os
    import subprocess
    import sys

    from kvwake.daemon.model import attention

    show = "import os, kvwake.daemon.model.engine; print(os.environ['MLX_CUDA_SDPA_CACHE_SIZE'])"
    env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_SDPA_CACHE_SIZE"}
    unset = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True)
    given = subprocess.run([sys.executable, "-c", show], env={**env, "MLX_CUDA_SDPA_CACHE_SIZE": "77"},
                           capture_output=True, text=True, check=True)
    assert (unset.stdout.strip(), given.stdout.strip()) == (str(attention.SDPA_GRAPHS), "77")


def test_status_says_whether_mlx_records_cuda_graphs_as_mlx_reads_the_variable(monkeypatch):
    """MLX parses MLX_USE_CUDA_GRAPHS with C's atoi; off CUDA there is nothing to say (None)."""
    from kvwake.daemon.model import attention

    monkeypatch.setattr(attention, "on_cuda", lambda: True)
    seen = {}
    for value in ("0", "1", " 2", "-1", "false", "", "0x1", None):
        if value is None:
            monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
        else:
            monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", value)
        seen[value] = attention.cuda_graphs()
    assert seen == {"0": False, "1": True, " 2": True, "-1": True, "false": False, "": False, "0x1": False,
                    None: True}
    monkeypatch.setattr(attention, "on_cuda", lambda: False)
    assert attention.cuda_graphs() is None


@pytest.fixture
def coarse_capacity(monkeypatch):
    """kv/capacity.py's CUDA growth, coarse (geometric) from 64 tokens on: bucketed attention's ground."""
    from kvwake.daemon.kv import capacity

    monkeypatch.setattr(capacity, "CUDNN_MIN", 64)
    capacity.install()
    yield capacity
    capacity.uninstall()


@pytest.mark.parametrize("chunk", [2, 7, 16, 23])
def test_bucketed_attention_gives_the_models_logits_over_a_rewound_buffer(model, coarse_capacity, chunk):
    from kvwake.daemon.model.attention import bucket_shape, bucketed_prefill, query_bucket

    tokens = mx.random.randint(0, 256, (300,), key=mx.random.key(chunk)).astype(mx.uint32)
    fused = logits_after(model, tokens[:100], tokens[100:100 + chunk], plain=False)
    cache = make_prompt_cache(model)
    model(tokens[None, :200], cache=cache)  # 200 tokens, rewound to 100: the buffer past it holds real keys
    mx.eval([c.state for c in cache])
    for c in cache:
        c.trim(100)
    assert cache[0].keys.shape[2] > 100 + chunk and bucket_shape(cache, chunk) == (query_bucket(chunk), cache[0].keys.shape[2])
    with bucketed_prefill(model):
        bucketed = model(tokens[None, 100:100 + chunk], cache=cache).astype(mx.float32)
    assert bucketed.shape == fused.shape
    assert mx.allclose(bucketed, fused, atol=2e-2, rtol=2e-2).item(), mx.abs(bucketed - fused).max().item()
    assert mx.argmax(bucketed[0, -1]).item() == mx.argmax(fused[0, -1]).item()


def test_bucketed_attention_pads_queries_to_a_power_of_two_and_sees_the_whole_buffer(monkeypatch):
    from kvwake.daemon.model import attention
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    k = mx.random.normal((1, 2, 100, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    cache.update_and_fetch(k, k)  # a buffer of 256 tokens (or kv/capacity.py's), 100 used
    seen = []
    real = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, scale, mask: seen.append((q.shape, k.shape, mask.shape)) or real(q, k, v, scale=scale, mask=mask))
    q = mx.random.normal((1, 4, 20, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    keys, values = cache.keys[..., :100, :], cache.values[..., :100, :]
    out = attention.bucketed_attention(None)(q, keys, values, cache, 0.125, "causal")
    cap = cache.keys.shape[2]  # 256; on CUDA, once an engine in this process has set kv/capacity.py's grid, 264
    assert seen == [((1, 4, 32, 64), (1, 2, cap, 64), (1, 1, 32, cap))] and out.shape == (1, 4, 20, 64)
    exact = float64_attention(*(np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, keys, values)), 0.125)
    assert np.abs(np.array(out.astype(mx.float32)) - exact).max() < 2e-2
    assert attention.query_bucket(2) == 16 and attention.query_bucket(17) == 32 and attention.query_bucket(256) == 256
    assert attention.query_bucket(65) == 128 and attention.query_bucket(130) == 192  # multiples of 64 past 64
    assert attention.query_buckets(255) == [128, 192, 64, 256, 32, 16] and attention.query_buckets(63) == [64, 32, 16]


def test_the_engine_runs_short_turns_over_a_long_cache_at_one_shared_fused_shape(model_dir, tmp_path, monkeypatch,
                                                                               coarse_capacity):
    # On CUDA a warm turn over a long cache built a cuDNN graph for its new (queries, keys), a large part of its turn:
    # padded to a query bucket over the whole buffer, the next turns of that bucket reuse it.
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=64, tuning=BUFFERS)
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.1, 0.001, 0.05)])  # fused is cheaper, new or built
    used, real = [], attention.bucketed_attention  # made once per chunk that runs bucketed
    monkeypatch.setattr(attention, "bucketed_attention", lambda f: used.append(1) or real(f))
    session = Session("agent")
    engine.append(session, tokens=list(range(1, 130)))  # 128 to prefill: full chunks, their exact shapes
    assert used == [] and not any(s[0] == "bucket" for s in engine.planner._fused_shapes)
    engine.append(session, tokens=list(range(1, 10)))  # 9 new: 129..137, one chunk of 9 (bucket 16)
    engine.append(session, tokens=list(range(1, 14)))  # 13 new: 138..150, still bucket 16, the same buffer
    buckets = {s for s in engine.planner._fused_shapes if s[0] == "bucket"}
    assert len(used) == 2 and buckets == {("bucket", 16, session.cache[0].keys.shape[2])}, (used, buckets)
    engine.close()
    store.close()


def test_a_short_turn_over_a_boundary_is_one_chunk_and_its_buckets_are_built_while_idle(model_dir, tmp_path,
                                                                                     monkeypatch, coarse_capacity):
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=64, tuning=BUFFERS)
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.1, 0.001, 0.05)])  # fused is cheaper, new or built
    idle: list = []
    engine.planner.idle = idle.append
    built, real = [], attention.warm_bucket
    monkeypatch.setattr(attention, "warm_bucket", lambda m, b, c, like=None: built.append((b, c)) or real(m, b, c, like))
    chunks, bucketed = [], attention.bucketed_attention  # made once per chunk that runs bucketed
    monkeypatch.setattr(attention, "bucketed_attention", lambda f: chunks.append(1) or bucketed(f))
    session = Session("agent")
    engine.append(session, tokens=list(range(1, 121)))  # 119 prefilled: 64 + 55 (the last, bucket 64)
    capacity = session.cache[0].keys.shape[2]
    # buckets 16 and 32 at this capacity, built when idle (64: by the last chunk)
    assert len(idle) == 2 and chunks == [1] and ("bucket", 64, capacity) in engine.planner._fused_shapes
    for job in idle:
        job()
    assert built == [(32, capacity), (16, capacity)]  # the likelier bucket first
    assert {s for s in engine.planner._fused_shapes if s[0] == "bucket"} == {("bucket", b, capacity) for b in (16, 32, 64)}
    idle.clear()
    chunks.clear()
    engine.append(session, tokens=list(range(1, 21)))  # 119..139 crosses 128: one chunk of 20, its graph built
    assert chunks == [1] and session.processed == 139 and idle == []  # nothing new to build
    assert session.cache[0].keys.shape[2] == capacity
    # A capacity the cache grew past before its idle job ran: skipped.
    engine.planner._fused_shapes.clear()
    engine.append(session, tokens=list(range(1, 11)))
    pending = list(idle)
    assert len(pending) == 2  # 32 and 64 (16: run by that chunk)
    idle.clear()
    built.clear()
    engine.append(session, tokens=list(range(1, 200)))  # grows the buffer
    assert session.cache[0].keys.shape[2] > capacity
    for job in pending:
        job()
    assert built == []
    engine.close()
    store.close()


def test_a_long_prefill_ends_by_building_the_likeliest_turns_buckets(model_dir, tmp_path, monkeypatch, coarse_capacity):
    # On CUDA the first turn after a long prompt built its bucket (its first token later than the turns
    # after it): a client that sends it at once leaves no idle time to build it in.
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.model.scheduler import prefill as prefill_mod
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA
    monkeypatch.setattr(prefill_mod, "BUCKET_AHEAD_AFTER", 100)
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=64, tuning=BUFFERS)
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.1, 0.001, 0.05)])
    built, real = [], attention.warm_bucket
    monkeypatch.setattr(attention, "warm_bucket", lambda m, b, c, like=None: built.append((b, c)) or real(m, b, c, like))
    short = Session("short")
    engine.append(short, tokens=list(range(1, 80)))  # 78 prefilled: below BUCKET_AHEAD_AFTER
    assert built == []
    long = Session("long")
    engine.append(long, tokens=list(range(1, 141)))  # 139 prefilled (its last chunk, 11: bucket 16), no idle runner
    capacity = long.cache[0].keys.shape[2]
    # query_buckets(63)[:BUCKETS_AHEAD]: the two likeliest (with only the likeliest built ahead, a turn of the
    # next bucket paid its build in its first token; docs/decisions.md, "Many agents at once (issue 24)")
    assert built == [(64, capacity), (32, capacity)], built
    assert {("bucket", 64, capacity), ("bucket", 32, capacity)} <= engine.planner._fused_shapes
    engine.append(Session("again"), tokens=list(range(1, 141)))  # the same capacity: built already
    assert len(built) == 2
    engine.close()
    store.close()



def test_a_paged_sessions_short_turns_past_cudnn_min_share_a_padded_shape_built_ahead(model, model_dir, tmp_path,
                                                                                     monkeypatch, coarse_capacity):
    """Over pages a lone short turn past CUDNN_MIN ran at its own shape, new every turn (each one plain ops or a
    graph of its own): a paged cache has no buffer for `bucketed_attention` to share. It now runs at its query
    and key buckets (`padded_attention`), which the next turns share, and a long prefill builds the likeliest
    turns' shapes ahead, as over a KVCache (docs/decisions.md, "Paged KV in the fleet, again")."""
    from kvwake.daemon.config import Tuning
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.model.scheduler import prefill as prefill_mod
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA
    monkeypatch.setattr(attention, "KEY_BUCKET_MIN", 64)
    monkeypatch.setattr(prefill_mod, "BUCKET_AHEAD_AFTER", 100)
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=64, tuning=Tuning(paged_kv=True))
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.1, 0.001, 0.05)])  # fused is cheaper, new or built
    built, warm = [], attention.warm_bucket
    monkeypatch.setattr(attention, "warm_bucket", lambda m, b, c, like=None: built.append((b, c)) or warm(m, b, c, like))
    used, padded = [], attention.padded_attention
    monkeypatch.setattr(attention, "padded_attention", lambda f: used.append(1) or padded(f))
    session = Session("agent")
    history = list(range(1, 130))
    engine.append(session, tokens=history)  # 128 prefilled: full chunks at their own shapes, then the likeliest turns'
    assert type(session.cache[0]).__name__ == "PagedKVCache" and used == []
    ahead = [("padded", b, attention.key_bucket(128 + b)) for b in (64, 32)]
    assert built == [shape[1:] for shape in ahead] and set(ahead) <= engine.planner._fused_shapes, built
    turns = [list(range(1, 10)), list(range(1, 14))]  # 9 then 13 new: query bucket 16, keys 137 and 150 (192)
    for turn in turns:
        engine.append(session, tokens=turn)
    assert len(used) == 2 and ("padded", 16, 192) in engine.planner._fused_shapes, (used, engine.planner._fused_shapes)
    # and in a pack that pads its rows (a review's finding: there the short paged turn ran at its own shape)
    assert engine.planner._path(session, 10, session.processed + 10, False, pad=True)[0] == "padded"
    engine.planner.padded_prefill = False  # a longer turn then keeps its own shape, as a KVCache's does
    assert engine.planner._paged_turn(session.cache, 10) == (16, 192)
    with monkeypatch.context() as m:
        m.setattr(attention, "PLAIN_MAX_QUERIES", 8)
        assert engine.planner._paged_turn(session.cache, 10) is None
    engine.planner.padded_prefill = True
    monkeypatch.undo()
    tokens = mx.array(history + turns[0] + turns[1])
    alone = logits_after(model, tokens[:-1], tokens[-1:], plain=False)
    ours = engine.model(tokens[-1:][None], cache=session.cache).astype(mx.float32)
    assert mx.argmax(ours[0, -1]).item() == mx.argmax(alone[0, -1]).item()
    assert mx.allclose(ours, alone, atol=2e-2, rtol=2e-2).item(), mx.abs(ours - alone).max().item()
    engine.close()
    store.close()

def test_bucketed_attention_runs_the_fused_kernel_on_keys_the_model_changed_after_the_cache(monkeypatch):
    # mlx-lm's plamo tiles the KV heads after the cache's update, stablelm casts to float32: the whole
    # buffer would not stand for what they pass (a review finding).
    from mlx_lm.models.cache import KVCache

    from kvwake.daemon.model import attention

    cache = KVCache()
    k = mx.random.normal((1, 2, 100, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    cache.update_and_fetch(k, k)
    q = mx.random.normal((1, 4, 20, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    used = []
    fused = lambda q, k, v, cache, scale, mask, sinks=None: used.append(k.shape) or q  # noqa: E731
    keys = cache.keys[..., :100, :]
    attention.bucketed_attention(fused)(q, mx.concatenate([keys, keys], axis=1), mx.concatenate([keys, keys], axis=1),
                                       cache, 0.125, "causal")
    attention.bucketed_attention(fused)(q.astype(mx.float32), keys.astype(mx.float32), keys.astype(mx.float32),
                                       cache, 0.125, "causal")
    assert used == [(1, 4, 100, 64), (1, 2, 100, 64)]
    attention.bucketed_attention(fused)(q, keys, keys, cache, 0.125, "causal")  # the cache's own: bucketed
    assert len(used) == 2


def test_a_failed_build_ahead_is_logged_and_the_append_stands(model_dir, tmp_path, monkeypatch, coarse_capacity, caplog):
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.model.scheduler import prefill as prefill_mod
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)
    monkeypatch.setattr(prefill_mod, "BUCKET_AHEAD_AFTER", 100)
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=64)
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.1, 0.001, 0.05)])
    monkeypatch.setattr(attention, "warm_bucket", lambda *a: (_ for _ in ()).throw(MemoryError("injected")))
    session = Session("long")
    got = engine.append(session, tokens=list(range(1, 150)))
    assert got["prefilled"] == 148 and session.processed == 148
    assert any("ahead failed" in r.getMessage() for r in caplog.records)
    assert engine.planner._bucketed(session.cache, 1) is None  # one query: the decode kernel, never a bucket
    # An idle build whose session is gone is skipped.
    idle: list = []
    engine.planner.idle = idle.append
    monkeypatch.setattr(prefill_mod, "BUCKET_AHEAD_AFTER", 10_000)
    monkeypatch.setattr(attention, "warm_bucket", lambda *a: pytest.fail("built for a session that is gone"))
    gone = Session("gone")
    engine.append(gone, tokens=list(range(1, 150)))
    del gone
    assert idle
    for job in idle:
        job()
    engine.close()
    store.close()


def test_no_builds_ahead_at_a_capacity_off_the_grid(model_dir, tmp_path, monkeypatch, coarse_capacity):
    # A batch's extracted cache (or a prefix copy) holds exactly its tokens: trimmed and fed a chunk that
    # fits, its buffer keeps a capacity no later turn shares (a review finding): nothing is built for it.
    from mlx_lm.models.cache import KVCache

    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=64, tuning=BUFFERS)
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.1, 0.001, 0.05)])
    idle: list = []
    engine.planner.idle = idle.append
    session = Session("extracted")
    engine.append(session, tokens=list(range(1, 150)))
    assert idle  # on the grid: built ahead when idle
    idle.clear()
    for c in session.cache:  # as a batch hands a row back: a buffer of exactly its tokens
        assert type(c) is KVCache
        c.keys, c.values = c.keys[..., : c.offset, :] + 0, c.values[..., : c.offset, :] + 0
    held = session.cache[0].keys.shape[2]
    assert coarse_capacity.capacity(held) != held
    session.tokens, session.processed = session.tokens[:140], 140
    for c in session.cache:
        c.trim(c.offset - 140)
    engine.append(session, tokens=list(range(1, 6)))  # fits the odd buffer: no growth
    assert session.cache[0].keys.shape[2] == held and idle == []
    engine.close()
    store.close()


def test_a_bucket_is_built_for_the_layers_own_kv_dtype_and_shape(model, monkeypatch):
    # The graph's key holds the keys' shape and dtype: built from the session's buffer, not the model's
    # first floating parameter (a model whose KV dtype differs would build a graph no turn uses).
    from kvwake.daemon.model import attention

    seen = []
    real = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, scale, mask: seen.append((k.shape, k.dtype, q.dtype)) or real(q, k, v, scale=scale, mask=mask))
    like = mx.zeros((1, 2, 512, 32), mx.float16)
    assert attention.warm_bucket(model, 64, 512, like=like)
    assert seen[-1] == ((1, 2, 512, 32), mx.float16, mx.float16)


def test_padded_attention_pads_queries_and_keys_to_shared_buckets_and_stays_exact(monkeypatch):
    # On CUDA each row of a pack of agents' turns (300-500 tokens each over its own history) built a cuDNN graph
    # for its own (queries, keys): padded to buckets, turns of one bucket share it.
    from kvwake.daemon.model import attention

    monkeypatch.setattr(attention, "KEY_BUCKET_MIN", 256)
    seen = []
    real = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, scale, mask: seen.append((q.shape, k.shape, mask.shape)) or real(q, k, v, scale=scale, mask=mask))
    shapes = {"q": (1, 4, 300, 64), "k": (1, 2, 700, 64), "v": (1, 2, 700, 64)}
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)).astype(mx.bfloat16) for i, s in enumerate(shapes.values()))
    out = attention.padded_attention(None)(q, k, v, None, 0.125, "causal")
    assert attention.query_bucket(300) == 320 and attention.key_bucket(700) == 768
    assert seen == [((1, 4, 320, 64), (1, 2, 768, 64), (1, 1, 320, 768))] and out.shape == (1, 4, 300, 64)
    exact = float64_attention(*(np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v)), 0.125)
    assert np.abs(np.array(out.astype(mx.float32)) - exact).max() < 2e-2
    # at most an eighth more keys past KEY_BUCKET_MIN's first steps
    assert [attention.key_bucket(n) for n in (300, 12000, 12300, 40000)] == [512, 12288, 13312, 40960]
    fused = []  # what it leaves to the fused kernel as it was: one query, another mask, quantized KV, sinks, dtypes

    class Quantized:
        bits = 4

    for args, kw in (((q[:, :, :1], k, v, None, 0.125, None), {}),
                     ((q, k, v, None, 0.125, mx.zeros((300, 700), mx.bool_)), {}),
                     ((q, k, v, Quantized(), 0.125, "causal"), {}),
                     ((q, k, v, None, 0.125, "causal"), {"sinks": mx.zeros((4,))}),
                     ((q.astype(mx.float32), k, v, None, 0.125, "causal"), {})):
        attention.padded_attention(lambda *a, **kw: fused.append(1))(*args, **kw)
    assert fused == [1] * 5 and len(seen) == 1


@pytest.mark.parametrize("paged", [False, True], ids=["kvcache", "paged"])
@pytest.mark.parametrize("alike", [False, True], ids=["rows at two shapes", "rows at one shape"])
def test_a_pack_of_longer_turns_runs_its_rows_at_a_shared_padded_shape_where_theirs_differ(
        model, model_dir, tmp_path, monkeypatch, alike, paged):
    # The case the padded path is for: agents' turns that come at once, each row of the pack over its own history,
    # each at a shape of its own (a graph built for each). Rows at one shape build one graph as they are, and a
    # lone turn keeps its own shape (never measured to gain from the padding). Paged rows too: they ran fused at
    # their own shapes, a graph each (docs/benchmarks.md, "Paged KV in the fleet").
    from kvwake.daemon.config import Tuning
    from kvwake.daemon.jobs import Packed
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA
    monkeypatch.setattr(attention, "PLAIN_MAX_QUERIES", 8)
    monkeypatch.setattr(attention, "KEY_BUCKET_MIN", 64)
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=64, max_batch=8,
                    tuning=Tuning(pack_prefill=True, prefill_threads=1, restore_points=False, paged_kv=paged))
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.1, 0.001, 0.05)])
    histories = {"a": list(range(1, 130)), "b": list(range(3, 132))}
    turns = {"a": list(range(40, 60)), "b": list(range(70, 100))}  # keys 148 and 158: one shape (32, 192)
    if alike:
        turns["b"] = list(range(70, 90))  # 20 new as "a": both rows at (20, 148)
    sessions = {sid: Session(sid) for sid in histories}
    for sid, tokens in histories.items():
        engine.append(sessions[sid], tokens=tokens)
    assert all(type(sessions[sid].cache[0]).__name__ == ("PagedKVCache" if paged else "KVCache") for sid in sessions)
    ran, sdpa = [], mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", lambda q, k, v, scale, mask=None, **kw: (
        ran.append((q.shape[2], k.shape[2])) if not isinstance(mask, str) and mask is not None else None) or
        sdpa(q, k, v, scale=scale, mask=mask, **kw))
    packs = engine.counters["prefill_packs"]
    jobs = []
    for sid, turn in turns.items():
        plan = engine.plan(sessions[sid], tokens=turn)
        jobs.append(Packed(engine._adopt_and_start, engine._start_turns,
                           (sessions[sid], plan, (None, 0), len(plan.target) - 1, None)))
    assert not any(isinstance(e, BaseException) for e in engine._start_turns(jobs))
    assert engine.counters["prefill_packs"] == packs + 1  # one pass for both
    padded = {shape for shape in engine.planner._fused_shapes if shape[0] == "padded"}
    if alike:  # their own (causal) shape, one graph for both
        assert ran == [] and padded == set(), (ran, padded)
    else:  # each row, every layer, at the shared shape
        assert ran == [(32, 192)] * (2 * len(engine.model.layers)) and padded == {("padded", 32, 192)}, ran
    # a lone turn after them keeps its own shape
    lone = Session("lone")
    engine.append(lone, tokens=histories["a"])
    engine.append(lone, tokens=list(range(120, 145)))
    assert len(ran) == (0 if alike else 2 * len(engine.model.layers))
    monkeypatch.undo()
    for sid, turn in turns.items():
        whole = mx.array(histories[sid] + turn)
        assert sessions[sid].processed == len(whole) - 1
        alone = logits_after(model, whole[:-1], whole[-1:], plain=False)
        ours = engine.model(whole[-1:][None], cache=sessions[sid].cache).astype(mx.float32)
        assert mx.allclose(ours, alone, atol=2e-2, rtol=2e-2).item(), mx.abs(ours - alone).max().item()
        assert mx.argmax(ours[0, -1]).item() == mx.argmax(alone[0, -1]).item()
    engine.close()
    store.close()


def test_padded_prefill_false_runs_a_turns_longer_chunk_at_its_own_shape(model_dir, tmp_path, monkeypatch):
    from kvwake.daemon.config import Tuning
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA
    monkeypatch.setattr(attention, "PLAIN_MAX_QUERIES", 8)
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, prefill_step=64, tuning=Tuning(padded_prefill=False))
    engine.planner.paths = attention.PathCosts(2, 32, [(64, 0.1, 0.001, 0.05)])
    s = Session("s")
    engine.append(s, tokens=list(range(1, 130)))
    engine.append(s, tokens=list(range(40, 60)))  # 20 new: fused at (20, 148), its own graph
    assert not any(shape[0] == "padded" for shape in engine.planner._fused_shapes)
    assert (20, 148, s.cache[0].keys.shape[2]) in engine.planner._fused_shapes
    engine.close()
    store.close()
