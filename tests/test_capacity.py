"""KV buffers off cuDNN's 256-token grid below 16k tokens (kv/capacity.py): what CUDA's decode needs, checked
on the CPU for what it must not change (every token and result as with mlx-lm's own growth)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvwake.daemon.kv import capacity
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session import Session
from kvwake.store import Store
from tests.test_engine import engine  # noqa: F401  (the fixture)


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
