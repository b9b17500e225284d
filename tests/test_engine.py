"""Engine on a tiny random-weight model folder: exact sleep/wake, prefix reuse, chat, generation."""

from __future__ import annotations

import errno
import os

import mlx.core as mx
import pytest

from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session_state import Session
from kvwake.errors import BundleMismatchError, InvalidParamsError, StorageFullError
from kvwake.store import Store
from tests.capabilities import require_quantized_kv
from testkit.tinymodel import NO_SYSTEM, make_model_dir

SYSTEM = "You are a careful agent. Follow the tool manual. " * 3
GREEDY = GenerateParams(max_tokens=12)




@pytest.fixture
def engine(model_dir, tmp_path):
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, model_dir)
    yield e
    e.close()
    store.close()


@pytest.fixture
def unpaged_engine(model_dir, tmp_path):
    """`engine` with its KV out of pages whatever the default: for what a wake reads from the store beside a hot
    session holding the same blocks, which a paged engine maps instead (docs/decisions.md, "Paged KV in the
    fleet, again")."""
    from kvwake.daemon.config import Tuning

    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, model_dir, tuning=Tuning(paged_kv=False))
    yield e
    e.close()
    store.close()


def chat(engine, session, text, params=GREEDY):
    engine.append(session, messages=[{"role": "user", "content": text}])
    return engine.generate(session, params)


def next_logits(engine, session) -> mx.array:
    """Logits for the token after the session's pending input (consumes the pending tokens)."""
    out = engine.model(mx.array(session.pending, dtype=mx.uint32)[None], cache=session.cache)
    return out[0, -1]


def twins(engine, sleep_between: bool):
    a, b = Session("never-slept"), Session("slept")
    for s in (a, b):
        s.messages = [{"role": "system", "content": SYSTEM}]
        s.mode = "chat"
    first = [chat(engine, s, "List three tools.").tokens for s in (a, b)]
    assert first[0] == first[1]
    if sleep_between:
        engine.sleep(b)
        assert b.cache is None
        b, info = engine.wake("slept")
        assert info["blocks_from_disk"] + info["blocks_from_memory"] == len(b.tokens) // 16
    return a, b


def test_wake_continues_token_for_token_and_logits_bit_identical(unpaged_engine):
    engine = unpaged_engine
    a, b = twins(engine, sleep_between=True)
    assert (a.tokens, a.processed, a.messages) == (b.tokens, b.processed, b.messages)
    for s in (a, b):
        engine.append(s, messages=[{"role": "user", "content": "Now pick one."}])
    assert mx.array_equal(next_logits(engine, a), next_logits(engine, b))
    a2, b2 = twins(engine, sleep_between=True)
    assert chat(engine, a2, "Continue.").tokens == chat(engine, b2, "Continue.").tokens


def test_sleep_reports_sizes_and_second_sleep_reuses_blocks(engine):
    s = Session("s")
    engine.append(s, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])
    first = engine.sleep(s)
    assert first["tokens"] == s.processed and first["new_blocks"] == s.processed // 16
    assert first["stored_bytes"] < first["raw_bytes"]
    s, _ = engine.wake("s")
    chat(engine, s, "more")
    second = engine.sleep(s)
    assert second["reused_blocks"] >= first["new_blocks"] - 1


def test_prefix_cache_serves_a_second_session_and_matches_cold_prefill(engine, model_dir, tmp_path):
    first = Session("first")
    engine.append(first, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}])
    engine.sleep(first)
    second = Session("second")
    got = engine.append(second, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "b"}])
    assert got["reused"] >= 16 and got["reused"] + got["prefilled"] == got["tokens"] - 1
    warm = engine.generate(second, GREEDY)
    cold_engine = Engine(Store(tmp_path / "cold", block_tokens=16), tmp_path, model_dir)
    cold = Session("cold")
    got_cold = cold_engine.append(cold, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "b"}])
    assert got_cold["reused"] == 0
    assert cold_engine.generate(cold, GREEDY).tokens == warm.tokens
    cold_engine.close()


def test_ram_tier_keeps_shared_prefixes_and_wakes_use_it(unpaged_engine, monkeypatch):
    engine = unpaged_engine
    # Decoded blocks are kept in RAM when a prefix hit reads them (shared prompts are what the
    # tier is for), not on every wake (that would cost each wake a second copy of its KV). Where
    # restores stage (a GPU) a hit's blocks join on the device and are not kept (test_pipeline.py).
    from tests.test_pipeline import restores_as

    restores_as(monkeypatch, "direct", engine)
    first = Session("first")
    engine.append(first, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}])
    engine.sleep(first)
    _, woken = engine.wake("first")
    assert woken["blocks_from_disk"] > 0 and woken["blocks_from_memory"] == 0 and len(engine.ram_tier) == 0
    counts = dict(engine.counters)
    engine.append(Session("second"), messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "b"}])
    shared = engine.counters["blocks_disk"] - counts["blocks_disk"]
    assert shared > 0 and len(engine.ram_tier) == shared
    engine.append(Session("third"), messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "c"}])
    assert engine.counters["blocks_ram"] - counts["blocks_ram"] == shared
    _, again = engine.wake("first")
    assert again["blocks_from_memory"] == shared and again["blocks_from_disk"] == woken["blocks_from_disk"] - shared


def test_streamed_pieces_join_to_the_decode_of_all_generated_tokens(engine):
    s = Session("s")
    events: list[dict] = []
    engine.append(s, text="Once upon a time")
    result = engine.generate(s, GenerateParams(max_tokens=30), on_event=events.append)
    pieces = [e["text"] for e in events]
    assert all(set(e) == {"text"} for e in events)  # this tokenizer has no tool-call format: all content
    generated = [t for t in result.tokens if t not in engine.tokenizer.eos_token_ids]
    assert "".join(pieces) == result.text == engine.tokenizer.decode(generated)
    assert result.finish_reason in ("stop", "length") and result.usage["generated_tokens"] == len(result.tokens)


def test_stop_strings_cut_the_text_and_streaming_agrees(engine):
    s = Session("s")
    engine.append(s, text="abc")
    full = engine.generate(s, GenerateParams(max_tokens=20)).text
    stop = full[5:7]
    assert stop and full.find(stop) >= 0
    s = Session("s2")
    engine.append(s, text="abc")
    events: list[dict] = []
    result = engine.generate(s, GenerateParams(max_tokens=20, stop=(stop,)), on_event=events.append)
    assert result.finish_reason == "stop" and result.text == full[: full.find(stop)]
    assert "".join(e["text"] for e in events) == result.text == result.content


def test_sampling_with_a_seed_is_reproducible(engine):
    params = GenerateParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01,
                            repetition_penalty=1.3, seed=7)
    runs = []
    for name in ("x", "y"):
        s = Session(name)
        engine.append(s, text="The weather today")
        runs.append(engine.generate(s, params).tokens)
    assert runs[0] == runs[1]


def test_chat_divergence_trims_to_the_common_prefix(engine):
    s = Session("s")
    s.messages, s.mode = [{"role": "system", "content": SYSTEM}], "chat"
    chat(engine, s, "hi", GenerateParams(max_tokens=3))  # cut short: the rendered reply differs from the tokens
    got = engine.append(s, messages=[{"role": "user", "content": "again"}])
    assert got["prefilled"] < got["tokens"] - 16 and got["reused"] == 0


def test_template_without_system_role_folds_the_system_text(tmp_path):
    folder = make_model_dir(tmp_path / "nosys", template=NO_SYSTEM)
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, folder)
    s = Session("s")
    e.append(s, messages=[{"role": "system", "content": "RULES"}, {"role": "user", "content": "hi"}])
    text = e.tokenizer.decode(s.tokens)
    assert e.template.folds_system and "RULES\n\nhi" in text and "system" not in text
    e.close()


def test_mixing_raw_and_chat_input_is_refused(engine):
    s = Session("s")
    engine.append(s, text="raw")
    with pytest.raises(InvalidParamsError, match="raw input"):
        engine.append(s, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(InvalidParamsError, match="exactly one"):
        engine.append(s, text="a", tokens=[1])
    with pytest.raises(InvalidParamsError, match="tokens must be"):
        engine.append(s, tokens=[10**9])


def test_snapshot_of_another_model_is_refused_with_the_differences(engine, tmp_path):
    s = Session("s")
    engine.append(s, text="hello there, general")
    engine.sleep(s)
    other_dir = make_model_dir(tmp_path / "other", seed=1)
    other = Engine(engine.store, tmp_path, other_dir)
    with pytest.raises(BundleMismatchError) as err:
        other.wake("s")
    assert "model.safetensors" in err.value.message and err.value.data["snapshot_bundle"] == engine.bundle.hash
    engine.wake("s")  # the snapshot itself is intact
    other.close()


def test_a_failed_sleep_leaves_the_session_hot(engine, monkeypatch):
    s = Session("s")
    engine.append(s, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(StorageFullError):
        engine.sleep(s)
    monkeypatch.setattr(os, "write", real)
    assert s.cache is not None and s.head is None
    assert engine.store.snapshots() == [] and engine.store.gc().orphans_removed == 0
    assert engine.sleep(s)["snapshot_id"]


def test_quantized_kv_sleeps_and_wakes_exactly(tmp_path):
    # mlx quantizes in groups of 32, 64 or 128: give this model 32-wide heads.
    folder = make_model_dir(tmp_path / "wide-heads", num_attention_heads=2, num_key_value_heads=1)
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, folder, kv_bits=8, kv_group_size=32)
    require_quantized_kv(e.model, 8, tokens=len(SYSTEM))
    a, b = Session("a"), Session("b")
    for s in (a, b):
        e.append(s, text=SYSTEM)
    assert type(a.cache[0]).__name__ == "QuantizedKVCache"
    e.sleep(b)
    b, _ = e.wake("b")
    assert type(b.cache[0]).__name__ == "QuantizedKVCache"
    assert mx.array_equal(next_logits(e, a), next_logits(e, b))
    e.close()


def test_an_engine_counts_its_own_weights_not_what_else_the_process_holds(model_dir, tmp_path):
    # A second model loaded beside a first (issue 53) counted the first's weights and KV as its own, and its KV
    # room and longest session with them.
    from mlx.utils import tree_flatten

    beside = mx.zeros((4 << 20,), mx.float32)  # 16 MiB held by something else in the process (another model)
    mx.eval(beside)
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, model_dir)
    try:
        assert e.weights_bytes == sum(v.nbytes for _, v in tree_flatten(e.model.parameters())) < beside.nbytes
    finally:
        e.close()
        store.close()
