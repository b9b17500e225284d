"""kvstate: an mlx-lm prompt cache goes to blocks + tail and comes back bit for bit.

Tiny random-weight models are built in-process from mlx-lm's own model
classes, one per cache kind: plain KV (llama bf16, qwen3 bf16), quantized KV
(llama, 8 and 4 bits), sliding window (gemma3_text: RotatingKVCache layers
mixed with a global KVCache, prompt longer than the window so the ring wraps),
recurrent hybrids (qwen3_next, lfm2: ArraysCache + KVCache; falcon_h1:
CacheList per layer; mamba2: ArraysCache only) and chunked attention (llama4:
ChunkedKVCache). qwen3_next and llama4 run in float32: their MoE layers use
GatherMM, which mlx 0.32 on CPU supports only in float32.

Prefix hits against a cold prefill, measured on this CPU with mlx 0.32.4:
bit-identical (max abs logit difference 0.0) for llama and qwen3, bf16 and
8-bit quantized KV. Against a prefill cut at the same place the result must
be bit-identical on any device (same state in, same ops); against a one-shot
cold prefill other backends may differ (GEMM blocking depends on row count),
so off-CPU only a bound is asserted.
"""

from __future__ import annotations

import functools
import json
import tracemalloc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import falcon_h1, gemma3_text, lfm2, llama, llama4, mamba2, qwen3, qwen3_next
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, RotatingKVCache, make_prompt_cache

from kvwake.daemon.kv import capacity as kvcapacity
from kvwake.daemon.kv import restore_buffers as kvfill
from kvwake.daemon.kv import cache_blocks as kvstate
from kvwake.daemon.kv.cache_blocks import NotCuttableError, StateMismatchError, UnsupportedCacheError
from kvwake.store import Store
from kvwake.store.format.codec import Tensor, decode, encode
from tests.capabilities import require_quantized_kv

B = 16  # tokens per block: 40 tokens = 2 full blocks + an 8-token tail
TOKENS = [(i * 37 + 11) % 256 for i in range(40)]
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)

ARCHS = {
    "llama": (llama, dict(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, **COMMON)),
    "llama-hd32": (llama, dict(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, head_dim=32, **COMMON)),
    "qwen3": (qwen3, dict(model_type="qwen3", num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=512,
                          head_dim=16, tie_word_embeddings=True, rope_theta=10000.0, **COMMON)),
    "gemma3": (gemma3_text, dict(model_type="gemma3_text", num_hidden_layers=3, head_dim=16, sliding_window=12,
                                 sliding_window_pattern=3, query_pre_attn_scalar=16, **COMMON)),
    "qwen3_next": (qwen3_next, dict(
        model_type="qwen3_next", num_hidden_layers=4, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64, mlp_only_layers=[],
        moe_intermediate_size=32, rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.5,
        max_position_embeddings=512, head_dim=16, full_attention_interval=2, **COMMON)),
    "lfm2": (lfm2, dict(
        model_type="lfm2", num_hidden_layers=3, max_position_embeddings=512, norm_eps=1e-5, conv_bias=False,
        conv_L_cache=3, block_dim=64, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False, block_ff_dim=128, layer_types=["conv", "full_attention", "conv"],
        **{k: v for k, v in COMMON.items() if k != "intermediate_size"})),
    "falcon_h1": (falcon_h1, dict(head_dim=16, mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16,
                                  mamba_n_heads=4, mamba_chunk_size=16, num_hidden_layers=2, **COMMON)),
    "mamba2": (mamba2, dict(
        model_type="mamba2", num_heads=4, head_dim=16, vocab_size=256, hidden_size=32, intermediate_size=64,
        state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
        use_conv_bias=True, tie_word_embeddings=True, time_step_limit=(0.0, float("inf")), time_step_rank="auto")),
    "llama4": (llama4, dict(model_type="llama4", text_config=dict(
        model_type="llama4_text", attention_bias=False, attention_chunk_size=16, head_dim=16,
        interleave_moe_layer_step=2, intermediate_size_mlp=128, max_position_embeddings=512,
        num_experts_per_tok=1, num_hidden_layers=4, num_local_experts=2, rms_norm_eps=1e-5, rope_scaling=None,
        rope_theta=10000.0, use_qk_norm=True, **COMMON))),
}
FLOAT32_ONLY = {"qwen3_next", "llama4"}  # MoE GatherMM: float32 only on CPU


@functools.cache
def model(arch: str):
    module, args = ARCHS[arch]
    mx.random.seed(0)
    m = module.Model(module.ModelArgs(**args))
    m.set_dtype(mx.float32 if arch in FLOAT32_ONLY else mx.bfloat16)
    mx.eval(m.parameters())
    return m


def fresh(m, kv_bits: int | None = None) -> list:
    if kv_bits:
        require_quantized_kv(m, kv_bits)
    cache = make_prompt_cache(m)
    return [c.to_quantized(group_size=32, bits=kv_bits) for c in cache] if kv_bits else cache


def run(m, cache: list, tokens: list[int], singles: int = 0) -> mx.array:
    """Prefill tokens in one call, the last `singles` of them one at a time (as generation does)."""
    cut = len(tokens) - singles
    logits = m(mx.array([tokens[:cut]]), cache=cache)
    for t in tokens[cut:]:
        logits = m(mx.array([[t]]), cache=cache)
    mx.eval(logits)
    return logits


def through_codec(arrays: dict[str, Tensor]) -> dict[str, Tensor]:
    return decode(encode(arrays).data)[0]


def sleep(cache: list, n: int) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
    """Every full block and the tail, each through the block codec (encode, then decode)."""
    blocks = [through_codec(kvstate.capture_block(cache, i, B)) for i in range(n // B)]
    return blocks, through_codec(kvstate.capture_tail(cache, n, B))


def assert_same_continuation(m, a: list, b: list, steps: int = 8) -> None:
    """Greedy-decode both caches: logits bit-identical at every step, tokens identical."""
    ta = tb = mx.array([[TOKENS[-1]]])
    for step in range(steps):
        la, lb = m(ta, cache=a), m(tb, cache=b)
        assert mx.array_equal(la, lb).item(), f"logits differ at step {step}"
        ta, tb = mx.argmax(la[:, -1:], axis=-1), mx.argmax(lb[:, -1:], axis=-1)
        assert ta.item() == tb.item()


WAKE_CASES = [("llama", None, 0), ("llama", None, 7), ("qwen3", None, 3), ("llama-hd32", 8, 5), ("llama-hd32", 4, 0),
              ("gemma3", None, 0), ("gemma3", None, 7), ("qwen3_next", None, 3), ("lfm2", None, 3),
              ("falcon_h1", None, 3), ("mamba2", None, 3), ("llama4", None, 3)]


@pytest.mark.parametrize("arch, kv_bits, singles", WAKE_CASES)
def test_wake_continues_bit_identically(arch, kv_bits, singles):
    m = model(arch)
    cache = fresh(m, kv_bits)
    run(m, cache, TOKENS, singles)
    blocks, tail = sleep(cache, len(TOKENS))
    woken = kvfill.restore_arrays(m, list(blocks), tail, len(TOKENS), B)
    assert [type(c) for c in woken] == [type(c) for c in cache]
    assert kvstate.layout(woken, model=m) == kvstate.layout(cache, model=m)
    assert_same_continuation(m, cache, woken)


@pytest.mark.parametrize("arch, kv_bits, singles", [("llama", None, 7), ("llama-hd32", 8, 5), ("llama-hd32", 4, 0),
                                                    ("gemma3", None, 7), ("qwen3_next", None, 3), ("lfm2", None, 3)])
def test_wake_continues_bit_identically_from_copies_stacked_as_on_cuda(arch, kv_bits, singles, monkeypatch):
    # On CUDA a capture copies, its tensors stacked one copy per dtype and shape (quantized KV: the packed
    # values and their scales apart); each block's arrays are views of those copies.
    monkeypatch.setattr(kvstate, "_discrete", lambda: True)
    m = model(arch)
    cache = fresh(m, kv_bits)
    run(m, cache, TOKENS, singles)
    deferred = kvstate.defer_blocks(cache, 0, len(TOKENS) // B, B)
    shapes = {(a.dtype, tuple(a.shape[1:])) for a in deferred.lazy}
    assert len(deferred.lazy) == len(shapes)  # one copy per dtype and shape
    blocks, tail = sleep(cache, len(TOKENS))
    woken = kvfill.restore_arrays(m, list(blocks), tail, len(TOKENS), B)
    assert_same_continuation(m, cache, woken)


@pytest.mark.parametrize("arch, kv_bits", [("llama", None), ("llama-hd32", 8), ("gemma3", None)])
def test_wake_after_uneven_prefill_chunks(arch, kv_bits):
    """40 then 300 tokens: mlx-lm grows the buffer to 552 rows, restore allocates 512; same logits."""
    m = model(arch)
    tokens = [(i * 53 + 7) % 256 for i in range(340)]
    cache = fresh(m, kv_bits)
    run(m, cache, tokens[:40])
    run(m, cache, tokens[40:])
    blocks, tail = sleep(cache, 340)
    woken = kvfill.restore_arrays(m, list(blocks), tail, 340, B)
    assert_same_continuation(m, cache, woken, steps=12)


def test_gemma3_ring_has_wrapped_and_stays_out_of_blocks():
    m = model("gemma3")
    cache = fresh(m)
    run(m, cache, TOKENS, singles=7)
    ring = cache[0]
    assert isinstance(ring, RotatingKVCache) and ring.offset == 40 and ring.keys.shape[2] == 12 and 0 < ring._idx < 12
    assert not kvstate.cuttable(cache)
    assert sorted(kvstate.capture_block(cache, 0, B)) == ["layers.2.keys", "layers.2.values"]
    assert {"layers.0.ring", "layers.0.keys", "layers.1.ring"} <= set(kvstate.capture_tail(cache, 40, B))


def test_a_changed_bit_changes_the_logits():
    """The exactness tests are not vacuous: one flipped bf16 bit in a block is visible."""
    m = model("llama")
    cache = fresh(m)
    run(m, cache, TOKENS)
    blocks, tail = sleep(cache, 40)
    keys = blocks[1]["layers.1.values"].array.copy()
    keys[0, 0, 3, 0] ^= 0x0100
    blocks[1]["layers.1.values"] = Tensor("BF16", keys)
    woken = kvfill.restore_arrays(m, list(blocks), tail, 40, B)
    token = mx.array([[TOKENS[-1]]])
    assert not mx.array_equal(m(token, cache=cache), m(token, cache=woken)).item()


def test_bf16_travels_as_bits():
    m = model("llama")
    cache = fresh(m)
    run(m, cache, TOKENS)
    block = kvstate.capture_block(cache, 1, B)
    t = block["layers.0.keys"]
    assert t.dtype == "BF16" and t.array.dtype == np.uint16 and t.array.shape == (1, 2, B, 16)
    expect = np.array(cache[0].keys[..., B : 2 * B, :].view(mx.uint16))
    assert np.array_equal(t.array, expect)


@pytest.mark.parametrize("arch, kv_bits", [("llama", None), ("qwen3", None), ("llama-hd32", 8)])
@pytest.mark.parametrize("k", [1, 2])
def test_prefix_restore_then_prefill_matches_cold_prefill(arch, kv_bits, k):
    m = model(arch)
    donor = fresh(m, kv_bits)  # another session that prefilled the whole prompt at once
    run(m, donor, TOKENS)
    blocks = [through_codec(kvstate.capture_block(donor, i, B)) for i in range(k)]
    warm = kvfill.restore_arrays(m, blocks, None, k * B, B)
    assert [c.offset for c in warm] == [k * B] * len(warm)
    warm_logits = m(mx.array([TOKENS[k * B :]]), cache=warm)
    cut = fresh(m, kv_bits)
    run(m, cut, TOKENS[: k * B])
    assert mx.array_equal(warm_logits, m(mx.array([TOKENS[k * B :]]), cache=cut)).item()
    cold_logits = m(mx.array([TOKENS]), cache=fresh(m, kv_bits))[:, k * B :]
    diff = mx.abs(warm_logits.astype(mx.float32) - cold_logits.astype(mx.float32)).max().item()
    assert diff == 0.0 if mx.default_device() == mx.cpu else diff < 0.05  # measured: 0.0 on CPU
    assert_same_continuation(m, warm, cut)


def test_round_trip_through_the_store(tmp_path):
    bundle = "ab" * 32
    m = model("gemma3")
    cache = fresh(m)
    run(m, cache, TOKENS, singles=5)
    with Store(tmp_path / "store", block_tokens=B) as store:
        store.register_bundle(bundle, {"kv_layout": kvstate.layout(cache, model=m)})
        with store.writer("s1", bundle, TOKENS) as w:
            for i in w.needed:
                w.add_block(i, kvstate.capture_block(cache, i, B))
            w.set_tail(kvstate.capture_tail(cache, 40, B))
            info = w.commit()
        record = store.snapshot(info.id, bundle=bundle)
        woken = kvfill.restore_arrays(m, list(store.iter_blocks(record)), store.read_tail(record), 40, B)
    assert_same_continuation(m, cache, woken)


def test_layout_is_json_deterministic_and_independent_of_tokens():
    m = model("falcon_h1")
    before = kvstate.layout(fresh(m), model=m)
    cache = fresh(m)
    run(m, cache, TOKENS, singles=2)
    assert kvstate.layout(cache, model=m) == before
    assert json.loads(json.dumps(before)) == before
    assert before[0]["kind"] == "cache_list" and not before[0]["cuttable"]
    assert before[0]["caches"][1] == {"kind": "kv", "cuttable": True, "kv_heads": 2, "k_head_dim": 16,
                                      "v_head_dim": 16, "dtype": "bfloat16"}
    # Without the model no shape can be known before prefill: the facts say so (None).
    assert kvstate.layout(cache)[0]["caches"][0] == {"kind": "arrays", "cuttable": False, "size": 2, "arrays": None}
    q = kvstate.layout(fresh(model("llama-hd32"), 8), model=model("llama-hd32"))[0]
    assert q == {"kind": "quantized_kv", "cuttable": True, "bits": 8, "group_size": 32, "kv_heads": 2,
                 "k_head_dim": 32, "v_head_dim": 32, "dtype": "bfloat16"}
    assert kvstate.cuttable(fresh(model("qwen3"))) and not kvstate.cuttable(fresh(model("mamba2")))


def test_mismatches_are_refused_with_facts():
    m = model("llama")
    cache = fresh(m)
    run(m, cache, TOKENS)
    blocks, tail = sleep(cache, 40)
    with pytest.raises(StateMismatchError, match="2 blocks given, 3 expected"):
        kvfill.restore_arrays(m, list(blocks), {**tail, "meta": Tensor.of(np.array([1, 48, B]))}, 48, B)
    with pytest.raises(StateMismatchError, match="tail meta"):
        kvfill.restore_arrays(m, list(blocks), tail, 41, B)
    narrow = {**blocks[1], "layers.0.keys": Tensor("BF16", blocks[1]["layers.0.keys"].array[:, :1].copy())}
    with pytest.raises(StateMismatchError, match=r"layers\.0\.keys: expected BF16\[1, 2, 16, 16\], found BF16\[1, 1, 16, 16\]"):
        kvfill.restore_arrays(m, list([blocks[0], narrow]), tail, 40, B)
    with pytest.raises(StateMismatchError, match="no place for"):
        kvfill.restore_arrays(m, list(blocks), {**tail, "layers.9.keys": tail["layers.0.keys"]}, 40, B)
    with pytest.raises(StateMismatchError, match=r"layers\.2: missing"):  # llama state into a model with rings
        kvfill.restore_arrays(model("gemma3"), list(blocks), tail, 40, B)
    with pytest.raises(StateMismatchError, match="tokens .16, 32. asked, the cache holds 8"):
        kvstate.capture_block(fresh_after(m, 8), 1, B)
    with pytest.raises(StateMismatchError, match="holds 40 tokens, capture asked for 39"):
        kvstate.capture_tail(cache, 39, B)


def fresh_after(m, n: int) -> list:
    cache = fresh(m)
    run(m, cache, TOKENS[:n])
    return cache


def test_prefix_restore_refuses_uncuttable_models_and_unknown_caches():
    with pytest.raises(NotCuttableError, match="rotating"):
        kvfill.restore_arrays(model("gemma3"), [], None, 0, B)
    with pytest.raises(NotCuttableError, match="arrays"):
        kvfill.restore_arrays(model("lfm2"), [], None, 0, B)

    class Mine(KVCache):
        pass

    with pytest.raises(UnsupportedCacheError, match="Mine"):
        kvstate.layout([Mine()])


class _Stub:
    """A stand-in model: make_prompt_cache calls its make_cache."""

    def __init__(self, *kinds: type) -> None:
        self.kinds = kinds

    def make_cache(self) -> list:
        return [kind() for kind in self.kinds]


@pytest.mark.parametrize("n", [0, 8, 32, 37])
def test_token_counts_at_block_edges_and_concatenate_cache(n):
    stub = _Stub(ConcatenateKVCache, KVCache)
    cache = stub.make_cache()
    mx.random.seed(n)
    for c in cache:
        for size in (n // 2, n - n // 2) if n else ():  # two updates: the concatenating path too
            k = mx.random.normal((1, 2, size, 8)).astype(mx.bfloat16)
            c.update_and_fetch(k, k + 1)
    blocks, tail = sleep(cache, n)
    assert len(blocks) == n // B and any(name.endswith(".keys") for name in tail) == bool(n % B)
    woken = kvfill.restore_arrays(stub, list(blocks), tail, n, B)
    assert [type(c) for c in woken] == [ConcatenateKVCache, KVCache] and [c.offset for c in woken] == [n, n]
    if n:
        # as its own growth allocates them (mlx-lm's 256, or off cuDNN's grid on CUDA: kv/capacity.py)
        assert woken[0].keys.shape[2] == n and woken[1].keys.shape[2] == kvcapacity.capacity(n)
        for a, b in zip(cache, woken):
            assert all(mx.array_equal(x, y).item() for x, y in zip(a.keys_and_values(), b.keys_and_values()))


def test_capture_copies_nothing_and_restore_allocates_only_the_cache():
    """On unified memory (this CPU) capture hands out views of the cache's own memory: no MLX
    memory, no numpy copies (was: a copy of every block). Restore fills buffers allocated
    once at their final size: MLX's peak is the cache it builds (was: + one block's slices)."""
    layers, heads, dim, n = 4, 8, 64, 2048
    block_tokens, block_bytes = 128, 4 * 2 * 8 * 128 * 64 * 2
    cache = [KVCache() for _ in range(layers)]
    mx.random.seed(1)
    for c in cache:
        for _ in range(n // 512):
            k = mx.random.normal((1, heads, 512, dim)).astype(mx.bfloat16)
            c.update_and_fetch(k, -k)
    mx.eval([c.keys for c in cache], [c.values for c in cache])
    assert kvstate.cache_nbytes(cache) == 16 * block_bytes * kvcapacity.capacity(n) // n  # buffers as grown

    mx.reset_peak_memory()
    base = mx.get_active_memory()
    tracemalloc.start()
    for i in range(n // block_tokens):
        block = kvstate.capture_block(cache, i, block_tokens)
        assert sum(t.array.nbytes for t in block.values()) == block_bytes
        if kvfill.unified_memory():  # views of the cache's own memory
            assert all(np.shares_memory(t.array, np.asarray(c.keys.view(mx.uint16)))
                       for c, t in zip(cache, (block[f"layers.{j}.keys"] for j in range(layers))))
        del block
    numpy_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    if kvfill.unified_memory():
        assert max(0, mx.get_peak_memory() - base) < block_bytes // 4
        assert numpy_peak < block_bytes // 16
    else:  # a discrete GPU: one block's device copy and its transfer to the host at a time, and the blocks
        # before's copies while CUDA frees them asynchronously (more under a suite's parallel workers), never
        # the cache's 16
        assert max(0, mx.get_peak_memory() - base) <= 6 * block_bytes + 4096

    blocks = [kvstate.capture_block(cache, i, block_tokens) for i in range(n // block_tokens)]
    tail = kvstate.capture_tail(cache, n, block_tokens)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    woken = kvfill.restore_arrays(_Stub(*[KVCache] * layers), list(blocks), tail, n, block_tokens)
    if kvfill.restore_mode() == "direct":
        assert mx.get_peak_memory() - base <= kvstate.cache_nbytes(woken) + 4096  # + scalars
    assert all(mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
               for a, b in zip(cache, woken))
