"""Bounded sessions: `max_context`, and the KV a session may hold under MLX's memory limit (daemon/model/memory.py).

A real daemon: its status reports the limits in force; a prompt beyond `--max-context` or beyond
what fits the memory limit is refused with CONTEXT_TOO_LONG (data: tokens, limit, bound) before
any prefill; a reply that would pass the limit is capped (finish_reason "length").
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvwake.daemon.model import memory
from testkit.daemon import Daemon, RpcError

TOKENS = list(range(20, 220))  # 200 tokens the tiny model knows


def test_apply_limits_sets_mlxs_memory_and_cache_limits():
    before, cached = mx.get_memory_limit(), mx.set_cache_limit(memory.DEFAULT_CACHE_BYTES)
    try:
        limits = memory.apply_limits(3 << 30, 256 << 20)
        assert (limits.memory_bytes, limits.cache_bytes) == (3 << 30, 256 << 20)
        assert mx.get_memory_limit() == 3 << 30
        assert mx.set_cache_limit(1 << 30) == 256 << 20  # set_cache_limit returns the one it replaces
        default = memory.apply_limits(None)
        assert default.memory_bytes == int(memory.device_memory() * memory.MEMORY_SHARE)
        assert default.cache_bytes == memory.DEFAULT_CACHE_BYTES
    finally:
        mx.set_memory_limit(before)
        mx.set_cache_limit(cached)


def test_session_tokens_leave_room_for_the_weights_and_a_prefills_scratch():
    limits = memory.Limits(memory_bytes=10_000, cache_bytes=0)
    assert memory.session_tokens(limits, weights_bytes=4_000, token_bytes=100) == 50  # 9000 usable - 4000 weights
    assert memory.session_tokens(limits, weights_bytes=20_000, token_bytes=100) == 0
    assert memory.session_tokens(limits, weights_bytes=0, token_bytes=0) is None  # nothing grows per token


def test_the_hot_budget_is_half_the_memory_left_for_kv():
    # Was a fixed size: a long session of a large model, larger than that, slept whenever it was idle at a
    # lifecycle pass, between an agent's turns, and its next turn restored it from the store (far slower
    # than continuing it). Now half of what the memory limit leaves beside the weights and
    # a prefill's scratch; the other half is room to wake or prefill while others stay hot.
    limits = memory.Limits(memory_bytes=10_000, cache_bytes=0)
    assert memory.hot_budget(limits, weights_bytes=4_000) == 2_500  # (9000 usable - 4000 weights) / 2
    assert memory.hot_budget(limits, weights_bytes=20_000) == 0  # nothing left: every idle session sleeps
    h100 = memory.Limits(memory_bytes=int(80e9 * memory.MEMORY_SHARE), cache_bytes=0)
    assert memory.hot_budget(h100, weights_bytes=16_000_000_000) > 75_000 * 128 * 1024 * 2  # two such sessions


def test_session_tokens_count_the_buffer_a_long_session_grows_to():
    # Past 16k tokens a buffer grows by a sixteenth of itself on CUDA (kv/capacity.py): a session at the limit
    # held up to 6% more than the limit's tokens, out of the prefill's scratch share. Now its buffer fits.
    from kvwake.daemon.kv import capacity

    was = capacity.installed()
    capacity.install()
    try:
        limits = memory.Limits(memory_bytes=int(75_000 * 100 / (1 - memory.WORKSPACE_SHARE)) + 1, cache_bytes=0)
        tokens = memory.session_tokens(limits, weights_bytes=0, token_bytes=100)
        assert tokens == 73_728 and capacity.capacity(tokens) <= 75_000 < capacity.capacity(tokens + 1)
        small = memory.Limits(memory_bytes=10_000, cache_bytes=0)
        assert memory.session_tokens(small, weights_bytes=4_000, token_bytes=100) == 50  # below 16k: as before
    finally:
        if not was:
            capacity.uninstall()


def test_max_context_refuses_longer_prompts_and_caps_replies(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir, extra=["--max-context", "150"]).start()
    try:
        with d.client() as rpc:
            memory_status = rpc.call("status")["memory"]
            assert memory_status["max_session_tokens"] == 150
            assert memory_status["mlx_cache_limit_bytes"] == memory.DEFAULT_CACHE_BYTES
            assert memory_status["mlx_memory_limit_bytes"] == int(memory.device_memory() * memory.MEMORY_SHARE)
            assert memory_status["kv_bytes_per_token"] > 0 and memory_status["weights_bytes"] > 0
            assert memory_status["mlx_peak_bytes"] >= memory_status["mlx_active_bytes"] >= memory_status["weights_bytes"]
            # no budget configured: the engine's, from the memory limit and the weights it measured
            assert memory_status["hot_budget_bytes"] == memory.hot_budget(
                memory.Limits(memory_status["mlx_memory_limit_bytes"], 0), memory_status["weights_bytes"])
            rpc.call("session.create", session_id="s")
            with pytest.raises(RpcError) as refused:
                rpc.call("session.append", session_id="s", tokens=TOKENS)
            assert refused.value.code == "CONTEXT_TOO_LONG"
            assert refused.value.data == {"tokens": 200, "limit": 150, "bound": "context"}
            assert rpc.call("session.info", session_id="s")["tokens"] == 0  # nothing prefilled
            rpc.call("session.append", session_id="s", tokens=TOKENS[:100])
            got = rpc.call("session.generate", session_id="s", max_tokens=1000, temperature=0)
            assert got["finish_reason"] == "length" and rpc.call("session.info", session_id="s")["tokens"] <= 150
    finally:
        d.stop()


@pytest.fixture(scope="module")
def measured(tmp_path_factory, model_dir) -> dict:
    """What a probe daemon measured of the tiny model (status' memory): its weights, its KV per token."""
    d = Daemon(tmp_path_factory.mktemp("probe"), model_dir).start()
    try:
        with d.client() as rpc:
            return rpc.call("status")["memory"]
    finally:
        d.stop()


def limit_for_tokens(measured: dict, tokens: float) -> int:
    """A memory limit that leaves room for the tiny model's weights and the KV of `tokens` tokens (after the
    prefill's scratch)."""
    return int((measured["weights_bytes"] + tokens * measured["kv_bytes_per_token"]) / (1 - memory.WORKSPACE_SHARE))


def test_a_session_whose_kv_would_not_fit_the_memory_limit_is_refused(tmp_path, model_dir, measured):
    limit = limit_for_tokens(measured, 120.5)  # ~120 tokens of KV
    (tmp_path / "none.toml").write_text(f"mlx_memory_bytes = {limit}\n")  # the config file testkit.daemon names
    d = Daemon(tmp_path, model_dir).start()
    try:
        with d.client() as rpc:
            status = rpc.call("status")["memory"]
            assert status["mlx_memory_limit_bytes"] == limit
            held = status["max_session_tokens"]
            assert 100 <= held <= 140, status  # the weights measured in this process differ by a few arrays
            rpc.call("session.create", session_id="big")
            with pytest.raises(RpcError) as refused:
                rpc.call("session.append", session_id="big", tokens=TOKENS)
            assert refused.value.code == "CONTEXT_TOO_LONG" and refused.value.data["bound"] == "memory"
            assert refused.value.data["limit"] == held and "memory limit" in refused.value.message
            rpc.call("session.append", session_id="big", tokens=TOKENS[:50])  # what fits still runs
    finally:
        d.stop()


@pytest.mark.parametrize("paged", [False, True], ids=["buffers", "pages"])
def test_a_long_prompt_beside_hot_sessions_sleeps_them_to_fit_the_memory_left_for_kv(tmp_path, model_dir, measured,
                                                                                      paged):
    # Room for the KV of ~700 tokens: a 200-token session (a 256-token buffer) and a 300-token one (512) do
    # not fit together, though each fits alone and the hot budget (half the room) is never looked at here.
    # Over pages (the default on CUDA) KV is counted by 16-token pages and a shared prefix once: those two fit
    # (the second maps the first's 200 tokens), so the second is 550 tokens of its own (13 + 35 pages: 768 tokens).
    limit = limit_for_tokens(measured, 700.5)
    (tmp_path / "none.toml").write_text(f"mlx_memory_bytes = {limit}\nlifecycle_interval_s = 3600\n")
    d = Daemon(tmp_path, model_dir, extra=["--tune", f"paged_kv={str(paged).lower()}"]).start()
    second = [(i * 7 + 3) % 200 + 20 for i in range(550)] if paged else TOKENS + TOKENS[:100]
    try:
        with d.client() as rpc:
            rpc.call("session.create", session_id="first")
            rpc.call("session.append", session_id="first", tokens=TOKENS)
            rpc.call("session.create", session_id="second")
            assert rpc.call("session.info", session_id="first")["state"] == "hot"
            rpc.call("session.append", session_id="second", tokens=second)
            assert rpc.call("session.info", session_id="first")["state"] == "asleep"
            assert rpc.call("session.info", session_id="second")["state"] == "hot"
            status = rpc.call("status")
            assert status["counters"]["room_sleeps"] == 1 and status["sessions"] == {"hot": 1, "asleep": 1}
            got = rpc.call("session.generate", session_id="first", max_tokens=4, temperature=0)  # wakes as it was
            assert len(got["tokens"]) == 4
    finally:
        d.stop()


def test_kv_bytes_per_token_plain_and_quantized(tmp_path):
    """Measured on the plain cache: what a prefilled session's KV holds per token; quantized KV counted from it
    (bits per value, a 16-bit scale and bias per group) without a quantized pass."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvwake.daemon.kv import cache_blocks

    from testkit.tinymodel import make_model_dir

    model, _ = load(str(make_model_dir(tmp_path / "wide-heads", num_attention_heads=2, num_key_value_heads=1)))
    cache = make_prompt_cache(model)
    model(mx.array([list(range(20, 60))], dtype=mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    plain = memory.kv_token_bytes(model)
    assert plain == cache_blocks.bytes_per_token(cache) > 0
    for bits, group in ((8, 32), (4, 32)):  # against a real quantized cache's bytes per token (head dim 32)
        quantized = [c.to_quantized(group_size=group, bits=bits) for c in make_prompt_cache(model)]
        # The prefill's own keys and values, quantized as a pass would (not by a quantized attention
        # pass: mlx-cuda has no kernel for such tiny shapes).
        for layer, q in zip(cache, quantized):
            q.update_and_fetch(layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :])
        mx.eval([c.state for c in quantized])
        assert memory.kv_token_bytes(model, kv_bits=bits, kv_group_size=group) == cache_blocks.bytes_per_token(quantized)
