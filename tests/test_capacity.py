"""KV buffers off cuDNN's 256-token grid below 16k tokens (kv/capacity.py): what CUDA's decode needs, checked
on the CPU for what it must not change (every token and result as with mlx-lm's own growth)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvwake.daemon.kv import capacity
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session_state import Session
from kvwake.store import Store
from tests.test_engine import unpaged_engine  # noqa: F401  (the fixture)


@pytest.fixture
def engine(unpaged_engine):  # noqa: F811
    """test_engine's engine out of pages whatever the default: these tests grow a KVCache's buffers, which a paged
    cache does not have (docs/decisions.md, "Paged KV in the fleet, again")."""
    return unpaged_engine


@pytest.fixture
def off_grid():
    was = capacity.installed()  # an engine on CUDA installs it for its process
    capacity.install()
    try:
        yield
    finally:
        (capacity.install if was else capacity.uninstall)()


@pytest.fixture
def own_growth():
    was = capacity.installed()
    capacity.uninstall()
    try:
        yield
    finally:
        if was:
            capacity.install()


def test_buffers_below_the_threshold_sit_off_the_grid_and_above_it_on_it(off_grid):
    assert capacity.capacity(1) == 256 + capacity.OFF_GRID
    assert capacity.capacity(1000) == 1024 + capacity.OFF_GRID
    assert capacity.capacity(capacity.CUDNN_MIN) == capacity.CUDNN_MIN
    # from there on, steps of a power of two near a GROWTH-th of the tokens (all on the 256 grid): a turn of
    # a long conversation rarely meets a new capacity (was every 256 tokens: a cuDNN graph built each time)
    assert capacity.capacity(20000) == 20480 and capacity.capacity(20480) == 20480
    assert capacity.capacity(75000) == 77824 and capacity.capacity(77824 + 1) == 81920
    for tokens in (16385, 30000, 70001, 131072, 200000):
        got = capacity.capacity(tokens)
        assert got % capacity.STEP == 0 and tokens <= got < tokens * (1 + 1 / capacity.GROWTH) + capacity.STEP
    turns = [capacity.capacity(64000 + 110 * t) for t in range(100)]
    assert len(set(turns)) <= 4  # 100 turns of 110 tokens past 64k: a few capacities, not 43
    c = KVCache()
    k = mx.zeros((1, 2, 300, 8))
    c.update_and_fetch(k, k)
    assert c.keys.shape[2] == 512 + capacity.OFF_GRID and capacity.grown(c, 1) == c.keys.shape[2]
    assert capacity.grown(c, 300) == capacity.capacity(600)
    c.update_and_fetch(mx.zeros((1, 2, 300, 8)), mx.zeros((1, 2, 300, 8)))
    assert c.keys.shape[2] == capacity.capacity(600) and c.offset == 600


def test_mlx_lms_own_growth_when_not_installed(own_growth):
    assert KVCache.update_and_fetch is capacity._mlx_update_and_fetch
    c = KVCache()
    k = mx.zeros((1, 2, 300, 8))
    assert capacity.grown(c, 300) == 512
    c.update_and_fetch(k, k)
    assert c.keys.shape[2] == 512 == capacity.capacity(300)
    assert capacity.grown(c, 300) == 300 + 512  # off a step: cut to the offset, then two whole steps


def test_the_same_tokens_and_a_sleep_and_wake_as_exact_with_buffers_off_the_grid(engine, off_grid):
    from tests.test_pipeline import assert_same_kv_and_continuation

    prompt = [(i * 37) % 250 + 5 for i in range(300)]
    params = GenerateParams(max_tokens=12)
    capacity.uninstall()
    own = engine.generate(_appended(engine, "own", prompt), params).tokens
    capacity.install()
    s = _appended(engine, "off", prompt)
    assert engine.generate(s, params).tokens == own
    assert s.cache[0].keys.shape[2] == capacity.capacity(s.processed)  # off the grid
    engine.sleep(s, free=False)
    woken, _ = engine.wake("off")
    assert woken.cache[0].keys.shape[2] == capacity.capacity(woken.processed)  # restored as it grows
    assert_same_kv_and_continuation(engine, s, woken, s.processed)


def _appended(engine, name: str, tokens: list[int]) -> Session:
    s = Session(name)
    engine.append(s, tokens=tokens)
    return s


def test_an_engine_on_cuda_grows_its_buffers_off_the_grid(model_dir, tmp_path, monkeypatch, own_growth):
    from kvwake.daemon.model import attention

    monkeypatch.setattr(attention, "on_cuda", lambda: True)
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, model_dir, warm=False)
    try:
        assert capacity.installed() and attention.decode_warm_capacities() == (1024 + capacity.OFF_GRID,
                                                                               capacity.CUDNN_MIN)
    finally:
        e.close()
        store.close()
        capacity.uninstall()


def _feed_one_at_a_time(layers: list, tokens: int, ahead: bool) -> list[list[int]]:
    """Feed `tokens` tokens to every layer, one a step (a decode), growing ahead or not; each step's buffer
    sizes, taken before the feed (after any growth ahead)."""
    sizes = []
    for t in range(tokens):
        if ahead:
            capacity.grow_ahead(layers)
        before = [c.keys.shape[2] for c in layers]
        sizes.append(before)
        for i, c in enumerate(layers):
            kv = mx.full((1, 2, 1, 8), float(t * 10 + i))
            c.update_and_fetch(kv, kv)
        if ahead:  # every growth came ahead of the feed: none inside it
            assert [c.keys.shape[2] for c in layers] == before, (t, before)
    return sizes


@pytest.mark.parametrize("rule", ["off_grid", "own_growth"])
def test_a_decoding_caches_layers_grow_one_a_step_ahead_to_the_same_buffers(rule, request):
    # Was: every layer grew in the step that met the full buffer (on CUDA that step took several times a
    # plain one: a prefill row's longest decode step was its talker's growth). Now one layer a step
    # in the steps before; the same sizes in the end, the same tokens in them.
    request.getfixturevalue(rule)
    n_layers, prompt = 6, 250
    runs = {}
    for ahead in (False, True):
        layers = [KVCache() for _ in range(n_layers)]
        for i, c in enumerate(layers):
            kv = mx.full((1, 2, prompt, 8), float(-i))
            c.update_and_fetch(kv, kv)
        runs[ahead] = (layers, _feed_one_at_a_time(layers, 600, ahead))
    (own, own_sizes), (early, early_sizes) = runs[False], runs[True]
    assert [c.keys.shape[2] for c in early] == [c.keys.shape[2] for c in own]
    for a, b in zip(own, early):
        assert a.offset == b.offset == prompt + 600
        ka, va = a.keys_and_values()
        kb, vb = b.keys_and_values()
        assert mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()
    changed = [sum(x != y for x, y in zip(early_sizes[t - 1], early_sizes[t])) for t in range(1, len(early_sizes))]
    own_changed = [sum(x != y for x, y in zip(own_sizes[t - 1], own_sizes[t])) for t in range(1, len(own_sizes))]
    assert max(changed) == 1 and changed.count(1) == own_changed.count(n_layers) * n_layers  # a layer a step
    assert max(own_changed) == n_layers  # the old way: all in one step


def test_growing_ahead_leaves_a_solo_generation_and_its_sleep_and_wake_exact(engine, off_grid, monkeypatch):
    from tests.test_pipeline import assert_same_kv_and_continuation

    prompt = [(i * 37) % 250 + 5 for i in range(200)]
    params = GenerateParams(max_tokens=120)  # past the buffer's 264 tokens: it grows while decoding
    real = capacity.grow_ahead
    monkeypatch.setattr(capacity, "grow_ahead", lambda cache: None)  # mlx-lm's way: all layers once full
    own = _appended(engine, "own", prompt)
    want = engine.generate(own, params).tokens
    grown: list[int] = []
    monkeypatch.setattr(capacity, "grow_ahead", lambda cache: grown.append(real(cache)) or grown[-1])
    s = _appended(engine, "ahead", prompt)
    assert engine.generate(s, params).tokens == want
    assert [i for i in grown if i is not None] == list(range(len(s.cache)))  # each layer once, in order
    assert [c.keys.shape[2] for c in s.cache] == [c.keys.shape[2] for c in own.cache]
    engine.sleep(s, free=False)
    woken, _ = engine.wake("ahead")
    assert_same_kv_and_continuation(engine, s, woken, s.processed)


def test_a_call_that_ends_while_growing_ahead_leaves_every_layer_one_size(engine, off_grid):
    # The engine reads a cache's shapes (prefill graphs, turn buckets) off its first layer: a call that ended
    # inside the window where some layers had grown ahead and some not left them of two sizes.
    prompt = [(i * 37) % 250 + 5 for i in range(250)]
    s = _appended(engine, "ends", prompt)
    layers = len(s.cache)
    assert layers >= 2
    stop_at = capacity.capacity(1) - s.processed - layers // 2  # a few layers grown ahead, the rest not yet
    no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
    engine.generate(s, GenerateParams(max_tokens=stop_at, logit_bias=no_eos))
    sizes = {c.keys.shape[2] for c in s.cache}
    assert sizes == {capacity.capacity(capacity.capacity(1) + 1)}, sizes  # all grown, to the size growth makes
    assert all(c.offset == s.cache[0].offset for c in s.cache)


def test_every_call_that_finishes_leaves_its_layers_one_size(engine, off_grid):
    # However a call finishes (its own step, or the token handed out when it joins the batch, decoder._lone_row),
    # Call.finish evens the layers out.
    s = _appended(engine, "finish", [(i * 37) % 250 + 5 for i in range(250)])
    call = engine.start_call(s, GenerateParams(max_tokens=4))
    first = s.cache[0]
    capacity._regrow(first, capacity.next_size(first), first.keys, first.values)  # one layer grown ahead
    assert len({c.keys.shape[2] for c in s.cache}) == 2
    call.finish("length")
    assert {c.keys.shape[2] for c in s.cache} == {first.keys.shape[2]}


def test_growing_ahead_passes_over_layers_that_are_not_plain_kv(own_growth):
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

    def fed(c, n):
        kv = mx.ones((1, 2, n, 64))
        c.update_and_fetch(kv, kv)
        return c

    layers = [fed(KVCache(), 250), fed(RotatingKVCache(max_size=32), 250), fed(QuantizedKVCache(), 250),
              fed(KVCache(), 250)]
    assert capacity.grow_ahead(layers) is None  # 250 of 256: room for more than a token per layer
    for c in layers:
        fed(c, 5)  # the plain layers now hold 255 of 256: within a token per plain layer of full
    rotating, quantized = layers[1].keys, layers[2].keys
    assert [capacity.grow_ahead(layers) for _ in range(3)] == [0, 1, None]  # the two plain layers, in order
    assert [layers[0].keys.shape[2], layers[3].keys.shape[2]] == [512, 512]
    assert layers[1].keys.shape == rotating.shape and layers[2].keys[0].shape == quantized[0].shape  # untouched
