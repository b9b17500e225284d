"""Batched decoding in the engine's decoder (tiny llama, CPU): calls join and leave between steps,
match the same calls decoded alone, and hand back plain caches that sleep and wake exactly."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvwake.daemon.model.decode_calls import batch_mode
from kvwake.daemon.model.decoder import Decoder
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams, RowsSampler, make_sampler
from kvwake.daemon.session_state import Session
from kvwake.errors import CancelledError
from kvwake.daemon.model.thread import EngineThread
from kvwake.store import Store
from tests.capabilities import require_quantized_kv
from testkit.tinymodel import make_model_dir

PROMPTS = ["short", "a somewhat longer prompt about tools " * 3, "x" * 150, "The weather today is"]


def batched_engine(model_dir, tmp_path, **options):
    """The batched engine of these tests over a fresh 16-token-block store, closed with it after the yield."""
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, model_dir, max_batch=8, **options)
    yield e
    e.close()
    store.close()


@pytest.fixture
def engine(model_dir, tmp_path):
    yield from batched_engine(model_dir, tmp_path)


@pytest.fixture
def twin(model_dir, tmp_path):
    """`engine` again, on a store of its own, for references: over pages (CUDA's default for llama) a session of a
    prompt a hot session holds maps its pages and prefills only the tail, a prefix hit, which on CUDA is held to a
    bound, not to bits (tests/test_prefix.py); on the twin it prefills cold."""
    yield from batched_engine(model_dir, tmp_path / "twin")


@pytest.fixture
def merging(model_dir, tmp_path):
    """`engine` with its KV out of pages whatever the default: for a merged batch's own ways (a plain cache back
    to each session, a long row leaving for its padding, the caches scheduled ahead of the pass), which a batch
    over pages does not have (docs/decisions.md, "Paged KV in the fleet, again")."""
    from kvwake.daemon.config import Tuning

    yield from batched_engine(model_dir, tmp_path, tuning=Tuning(paged_kv=False))


def session(engine: Engine, name: str, text: str) -> Session:
    s = Session(name)
    engine.append(s, text=text)
    return s


def run_together(engine: Engine, calls: list, join_at: dict[int, int] | None = None) -> None:
    """Step the decoder until every call ends; call i joins before step join_at[i] (default 0)."""
    join_at = join_at or {}
    waiting = dict(enumerate(calls))
    step = 0
    while waiting or engine.decoder.active:
        for i in [i for i in waiting if join_at.get(i, 0) <= step]:
            engine.decoder.join(waiting.pop(i))
        engine.decoder.step()
        step += 1


def solo_tokens(engine: Engine, name: str, text: str, params: GenerateParams) -> list[int]:
    return engine.generate(session(engine, name, text), params).tokens


def test_a_plain_kv_model_decodes_batched_and_quantized_kv_alone(engine, model_dir, tmp_path):
    assert engine.decode_mode == "batched"
    assert batch_mode(engine.make_cache(), None, 1)[0] == "solo"
    wide = make_model_dir(tmp_path / "wide-heads", num_attention_heads=2, num_key_value_heads=1)  # 32-wide groups
    store = Store(tmp_path / "q", block_tokens=16)
    q = Engine(store, tmp_path, wide, kv_bits=8, kv_group_size=32, max_batch=8)
    try:
        require_quantized_kv(q.model, 8, tokens=32)
        assert q.decode_mode == "solo" and "quantized" in q.decode_reason
        s = session(q, "q", "hello there")
        assert len(q.generate(s, GenerateParams(max_tokens=5)).tokens) == 5
    finally:
        q.close()
        store.close()


def test_a_model_whose_rope_takes_one_offset_decodes_its_calls_alone(tmp_path):
    # Was: "batched", and a batch's step (two calls at once; on CUDA the warm-up of every batch size, so the
    # engine did not start) raised in mlx-lm's DynamicNTKScalingRoPE, which takes an int offset, not the rows'.
    ntk = make_model_dir(tmp_path / "ntk", rope_scaling={"type": "dynamic", "factor": 2.0})
    for e in batched_engine(ntk, tmp_path):
        assert e.decode_mode == "solo" and "DynamicNTKScalingRoPE" in e.decode_reason
        assert e.decoder.warm() == []  # no batch to build kernels for
        params = GenerateParams(max_tokens=6)
        alone = [solo_tokens(e, f"alone{i}", p, params) for i, p in enumerate(PROMPTS[:2])]
        calls = [e.start_call(session(e, f"b{i}", p), params) for i, p in enumerate(PROMPTS[:2])]
        run_together(e, calls)  # taking turns, one token each
        assert [c.future.result().tokens for c in calls] == alone


# gpt_bigcode's positions: numpy's arange from its first layer's offset, a Python int (mlx-lm 0.32)
BIGCODE = dict(model_type="gpt_bigcode", n_embd=64, n_layer=2, n_inner=128, n_head=4, n_positions=1024,
               layer_norm_epsilon=1e-5, multi_query=True, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)


def test_a_model_whose_batched_pass_cannot_be_built_decodes_its_calls_alone(tmp_path):
    # Was: "batched" (its caches are plain KV, its RoPE none of ONE_OFFSET_ROPES), and two calls at once raised
    # in the model's own use of the batch's row offsets.
    bigcode = make_model_dir(tmp_path / "bigcode", **BIGCODE)
    for e in batched_engine(bigcode, tmp_path):
        assert e.decode_mode == "solo" and "batched pass" in e.decode_reason, e.decode_reason
        params = GenerateParams(max_tokens=6)
        alone = [solo_tokens(e, f"alone{i}", p, params) for i, p in enumerate(PROMPTS[:2])]
        calls = [e.start_call(session(e, f"b{i}", p), params) for i, p in enumerate(PROMPTS[:2])]
        run_together(e, calls)
        assert [c.future.result().tokens for c in calls] == alone


def test_a_packable_models_batched_pass_is_not_built_at_its_start(tmp_path, monkeypatch):
    """Models whose packs take each row's offset are batched without the build (Python at a load's end, where
    another model's steps wait for the GIL); another kind is built once."""
    from kvwake.daemon.model import decode_calls

    built = []
    monkeypatch.setattr(decode_calls, "_batched_pass_refused", lambda model, cache: built.append(model) and None)
    # no warm-up: on CUDA it runs a batched pass, which bigcode (told batchable here) cannot
    for e in batched_engine(make_model_dir(tmp_path / "llama"), tmp_path, warm=False):
        assert e.decode_mode == "batched" and built == []
    for e in batched_engine(make_model_dir(tmp_path / "bigcode", **BIGCODE), tmp_path / "b", warm=False):
        assert len(built) == 1


def test_batched_calls_match_the_same_calls_decoded_alone(engine):
    params = GenerateParams(max_tokens=24)
    alone = [solo_tokens(engine, f"alone{i}", p, params) for i, p in enumerate(PROMPTS)]
    sessions = [session(engine, f"b{i}", p) for i, p in enumerate(PROMPTS)]
    calls = [engine.start_call(s, params) for s in sessions]
    run_together(engine, calls, join_at={1: 3, 2: 3, 3: 10})  # joining mid-flight, at different steps
    assert [c.future.result().tokens for c in calls] == alone
    assert engine.decoder.counters["max_batch_seen"] == 4
    assert engine.decoder.counters["decode_tokens"] > engine.decoder.counters["decode_steps"]


def test_after_a_batched_call_the_session_holds_a_plain_cache_that_sleeps_and_wakes_exactly(merging):
    engine = merging
    sessions = [session(engine, f"s{i}", p) for i, p in enumerate(PROMPTS[:3])]
    calls = [engine.start_call(s, GenerateParams(max_tokens=n)) for s, n in zip(sessions, (5, 17, 9))]
    run_together(engine, calls)
    for s in sessions:
        assert all(type(c) is KVCache for c in s.cache)
        assert s.processed == len(s.tokens) == s.cache[0].offset
    s = sessions[1]
    engine.append(s, text=" and then")
    before = [(mx.array(c.keys[..., : c.offset, :]), mx.array(c.values[..., : c.offset, :])) for c in s.cache]
    engine.sleep(s)
    woken, _ = engine.wake("s1")
    assert woken.tokens == s.tokens and woken.processed == s.processed
    for (k, v), c in zip(before, woken.cache):
        assert mx.array_equal(k, c.keys[..., : c.offset, :]).item()
        assert mx.array_equal(v, c.values[..., : c.offset, :]).item()
    follow = engine.generate(woken, GenerateParams(max_tokens=8))
    assert len(follow.tokens) == 8


def test_stop_strings_max_tokens_eos_and_cancellation_end_only_their_own_call(engine, twin):
    probe = session(twin, "probe", PROMPTS[1])  # references on the twin: no hit between them and the calls
    full = twin.generate(probe, GenerateParams(max_tokens=20)).text
    stop = full[6:8]
    assert stop and full.find(stop) >= 0
    events: list[dict] = []
    flags = {"cancel": False}
    specs = [(PROMPTS[1], GenerateParams(max_tokens=20, stop=(stop,)), events.append, None),
             (PROMPTS[0], GenerateParams(max_tokens=3), None, None),
             (PROMPTS[2], GenerateParams(max_tokens=200), None, lambda: flags["cancel"]),
             (PROMPTS[3], GenerateParams(max_tokens=30), None, None)]
    calls = [engine.start_call(session(engine, f"c{i}", p), params, on_event, stop_fn)
             for i, (p, params, on_event, stop_fn) in enumerate(specs)]
    for c in calls:
        engine.decoder.join(c)
    for _ in range(12):
        engine.decoder.step()
    flags["cancel"] = True
    run_together(engine, [])
    results = [c.future.result() for c in calls]
    assert results[0].finish_reason == "stop" and results[0].text == full[: full.find(stop)]
    assert "".join(e["text"] for e in events) == results[0].text
    assert results[1].finish_reason == "length" and len(results[1].tokens) == 3
    assert results[2].finish_reason == "cancelled" and 12 <= len(results[2].tokens) < 200
    assert results[3].tokens == solo_tokens(twin, "alone3", PROMPTS[3], GenerateParams(max_tokens=30))
    for c, r in zip(calls, results):  # every generated token is in the session and its cache
        assert c.session.tokens[-len(r.tokens):] == r.tokens and c.session.cache[0].offset == len(c.session.tokens)


def test_a_seeded_call_samples_the_same_tokens_beside_other_sampling_calls(engine):
    seeded = GenerateParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=40, repetition_penalty=1.2, seed=11)
    alone = solo_tokens(engine, "alone", PROMPTS[3], seeded)
    others = [engine.start_call(session(engine, f"o{i}", p), GenerateParams(max_tokens=16, temperature=1.0))
              for i, p in enumerate(PROMPTS[:3])]
    mine = engine.start_call(session(engine, "mine", PROMPTS[3]), seeded)
    run_together(engine, [*others, mine], join_at={3: 2})
    assert mine.future.result().tokens == alone


def test_sampling_rows_sample_in_one_op_and_each_draws_what_it_draws_alone(engine):
    """Seeded calls at temperatures of their own (and a greedy one) batched: one sampling op a step
    (RowsSampler), and each call's tokens are the ones it samples alone, and the ones row-by-row
    sampling gives."""
    params = [GenerateParams(max_tokens=12, temperature=t, seed=20 + i) for i, t in enumerate((1.0, 0.7, 0.0, 1.3))]
    alone = [solo_tokens(engine, f"rows-alone{i}", PROMPTS[i], p) for i, p in enumerate(params)]
    got = {}
    for together in (True, False):
        engine.decoder.rows_sampling = together
        before = engine.decoder.counters["rows_sampled_together"]
        calls = [engine.start_call(session(engine, f"rows{together}{i}", PROMPTS[i]), p) for i, p in enumerate(params)]
        run_together(engine, calls)
        got[together] = [c.future.result().tokens for c in calls]
        assert (engine.decoder.counters["rows_sampled_together"] > before) == together
    engine.decoder.rows_sampling = True
    assert got[True] == got[False] == alone


def test_sampling_rows_keep_one_key_array_while_the_batch_keeps_its_rows_and_draw_as_each_row_alone():
    """RowsSampler leaves the keys it split as one array; a step over the same rows splits that array again
    (no per-row slice, no stack), a row's own key is read out of it only when asked for, and every draw is
    the one each row's sampler makes alone, also when the rows change order."""
    logprobs = mx.random.normal((3, 50), key=mx.random.key(5))
    params = [GenerateParams(temperature=t, seed=30 + i) for i, t in enumerate((1.0, 0.6, 1.4))]
    rows = [make_sampler(p) for p in params]
    own = [make_sampler(p) for p in params]  # the same calls, each sampling alone
    # a step over the rows of the step before takes its keys whole; a new order stacks the rows' own keys
    steps = [([0, 1, 2], False), ([0, 1, 2], True), ([0, 1, 2], True), ([2, 0, 1], False), ([2, 0, 1], True)]
    for order, carries in steps:
        batch = RowsSampler([rows[i] for i in order])
        assert (batch._carried_keys([True] * 3) is not None) == carries, (order, carries)
        assert batch(logprobs[mx.array(order)]).tolist() == [own[i](logprobs[i : i + 1]).item() for i in order]
        assert len({id(rows[i]._carried[0]) for i in order}) == 1  # the rows' keys left as one array
    assert mx.array_equal(rows[1].key, own[1].key)  # read out of the batch's keys when asked for
    assert rows[1]._carried is None


def test_sampling_rows_that_come_and_go_each_draw_what_they_draw_alone(engine, monkeypatch):
    """Six seeded rows in a batch of eight slots: one joins a dead slot while the others stay at their rows
    (the batch's size unchanged, so only the joiner's own key tells the keys must be stacked again), one
    leaves, another takes its slot. Each call's tokens are the ones it samples alone, and the keys were both
    carried over and stacked again on the way (a check of the first keyed row alone passed a test of
    rows that stay in place)."""
    seen = {"carried": 0, "stacked": 0}
    carried_keys = RowsSampler._carried_keys

    def counted(self, keyed):
        keys = carried_keys(self, keyed)
        seen["carried" if keys is not None else "stacked"] += 1
        return keys
    monkeypatch.setattr(RowsSampler, "_carried_keys", counted)
    spec = [(30, 1.0), (5, 0.8), (30, 1.2), (30, 0.9), (30, 1.1), (30, 0.6), (20, 1.0), (15, 1.4)]
    params = [GenerateParams(max_tokens=m, temperature=t, seed=70 + i) for i, (m, t) in enumerate(spec)]
    texts = [PROMPTS[i % 4] + str(i) for i in range(len(spec))]
    alone = [solo_tokens(engine, f"come-alone{i}", text, p) for i, (text, p) in enumerate(zip(texts, params))]
    before = engine.decoder.counters["rows_sampled_together"]
    calls = [engine.start_call(session(engine, f"come{i}", text), p) for i, (text, p) in enumerate(zip(texts, params))]
    run_together(engine, calls, join_at={6: 3, 7: 7})
    assert engine.decoder.counters["rows_sampled_together"] > before
    assert [c.future.result().tokens for c in calls] == alone
    assert seen["carried"] > 0 and seen["stacked"] >= 3, seen  # the first step, each join


def test_no_more_than_max_batch_calls_decode_at_once_and_the_rest_wait_their_turn(engine, tmp_path, model_dir):
    store = Store(tmp_path / "two", block_tokens=16)
    e = Engine(store, tmp_path, model_dir, max_batch=2)
    try:
        calls = [e.start_call(session(e, f"w{i}", p), GenerateParams(max_tokens=6)) for i, p in enumerate(PROMPTS)]
        run_together(e, calls)
        assert e.decoder.counters["max_batch_seen"] == 2
        assert all(len(c.future.result().tokens) == 6 for c in calls)
    finally:
        e.close()
        store.close()


def test_a_failing_decode_step_fails_its_calls_and_the_engine_thread_goes_on(engine, monkeypatch):
    thread = EngineThread()
    try:
        thread.attach(engine.decoder, engine.planner)
        call = thread.submit(lambda: engine.start_call(session(engine, "f", PROMPTS[0]),
                                                        GenerateParams(max_tokens=50))).result()
        boom = RuntimeError("injected: the batched forward pass failed")
        monkeypatch.setattr(Decoder, "_step_batch", lambda self: (_ for _ in ()).throw(boom))
        thread.submit(lambda: engine.decoder.join(call)).result()
        with pytest.raises(RuntimeError, match="injected"):
            call.future.result(timeout=30)
        assert call.session.cache is None  # rebuilt from its tokens on next use
        monkeypatch.undo()
        again = thread.submit(lambda: engine.generate(call.session, GenerateParams(max_tokens=4))).result(30)
        assert len(again.tokens) == 4
    finally:
        thread.stop()


def test_the_engine_thread_says_where_its_time_went_and_names_the_slow_jobs(engine):
    thread = EngineThread()
    try:
        thread.attach(engine.decoder, engine.planner)
        calls = thread.submit(lambda: [engine.start_call(session(engine, f"t{i}", PROMPTS[i]),
                                                         GenerateParams(max_tokens=24)) for i in range(2)]).result()

        def slow_job() -> None:  # what a decoding neighbour waits for, by name
            time.sleep(0.08)

        thread.submit(lambda: [engine.decoder.join(c) for c in calls]).result()
        thread.submit(slow_job).result()
        assert all(len(c.future.result(timeout=60).tokens) == 24 for c in calls)
        timing, spent = thread.timing(), engine.decoder.status()
        assert timing["steps"] >= 24 and timing["step_s"] > 0 and timing["jobs"] >= 3
        slow = [j for j in timing["slow"] if j["what"].endswith("slow_job")]
        assert slow and slow[0]["ms"] >= 80 and abs(slow[0]["at"] - time.time()) < 60, timing["slow"]
        assert slow[0]["what"] == "test_the_engine_thread_says_where_its_time_went_and_names_the_slow_jobs.slow_job"
        assert 0 < spent["batch_next_s"] <= timing["step_s"] and 0 < spent["batch_outputs_s"] <= timing["step_s"]
    finally:
        thread.stop()


def test_calls_that_come_together_join_in_one_merge_through_quick_jobs_not_one_a_step(engine):
    """16 calls arriving at once used to join over 16 steps (one job a step); quick jobs run together."""
    thread = EngineThread()
    try:
        thread.attach(engine.decoder, engine.planner)
        busy = thread.submit(lambda: engine.start_call(session(engine, "busy", PROMPTS[0]),
                                                       GenerateParams(max_tokens=200))).result()
        calls = thread.submit(lambda: [engine.start_call(session(engine, f"q{i}", PROMPTS[i % 4]),
                                                         GenerateParams(max_tokens=12)) for i in range(6)]).result()
        thread.submit(lambda: engine.decoder.join(busy)).result()
        merges = engine.decoder.counters["merges"]
        gate, running = threading.Event(), threading.Event()
        blocked = thread.submit(lambda: (running.set(), gate.wait()))  # the thread is busy while the calls come
        assert running.wait(30)
        seen: list[int] = []

        def join(call) -> None:
            seen.append(engine.decoder.counters["decode_steps"])
            engine.decoder.join(call)

        joins = [thread.submit(lambda c=c: join(c), quick=True) for c in calls]
        late = thread.submit(lambda: engine.decoder.counters["decode_steps"])  # a plain job, queued after them
        gate.set()
        blocked.result(timeout=30)
        for j in joins:
            j.result(timeout=30)
        assert len(set(seen)) == 1, f"the quick joins ran at steps {seen}"
        # a plain job queued after them waits one step at most: their wake-ups are not a turn each
        assert seen[0] <= late.result(timeout=30) <= seen[0] + 1
        assert all(len(c.future.result(timeout=60).tokens) == 12 for c in calls)
        assert engine.decoder.counters["merges"] == merges + 1  # the lone call and the six, in one merge
        assert engine.decoder.counters["max_batch_seen"] == 7
        busy.future.result(timeout=120)
    finally:
        thread.stop()


def test_a_turns_cache_cut_back_and_its_first_chunk_are_one_engine_job(engine):
    """While calls decode every engine job waits for a step: a turn's input is in the cache after one job,
    not after a job that only cut the cache back to the common prefix."""
    s = session(engine, "turn", PROMPTS[1])
    after_each: list[tuple[int, int]] = []

    def mlx(fn):  # the engine thread's runner, recording what each job left
        out = fn()
        after_each.append((s.processed, len(s.tokens)))
        return out

    engine.append(s, text=PROMPTS[3], mlx=mlx)
    assert after_each[0] == (len(s.tokens) - 1, len(s.tokens)), after_each


def test_a_turn_whose_client_left_before_its_first_chunk_prefills_nothing(engine):
    s = session(engine, "left", PROMPTS[1])
    kept = s.processed
    with pytest.raises(CancelledError) as err:
        engine.append(s, text=PROMPTS[3], should_stop=lambda: True)
    assert err.value.data["prefilled"] == 0 and s.processed <= kept and not s.computing


def test_a_checkpoints_look_at_a_session_is_a_quick_job(engine):
    """The look (its blocks' tokens, its state) reads Python objects only: it does not wait for a step."""
    from kvwake.daemon.kv import pipeline

    s = session(engine, "look", "x" * 40)
    quick: list[bool] = []

    def mlx(fn):
        quick.append(getattr(fn, "engine_quick", False))
        return fn()

    info = pipeline.checkpoint(engine.kv, s, mlx, supersede=None)
    assert info is not None and info.n_tokens == len(s.tokens) // 16 * 16 > 0
    assert quick[0] is True and not all(quick), quick  # the look, then the captures (MLX work: in turn)


def test_a_slow_step_that_admitted_calls_says_how_many_and_how_long_their_merge_took(engine, monkeypatch):
    thread = EngineThread(slow_job_ms=0.0)  # every job and step recorded
    try:
        thread.attach(engine.decoder, engine.planner)
        calls = thread.submit(lambda: [engine.start_call(session(engine, f"m{i}", PROMPTS[i]),
                                                         GenerateParams(max_tokens=6)) for i in range(3)]).result()
        thread.submit(lambda: [engine.decoder.join(c) for c in calls]).result()
        assert all(len(c.future.result(timeout=60).tokens) == 6 for c in calls)
        steps = [j["what"] for j in thread.timing()["slow"] if j["what"].startswith("decode step")]
        admitting = [w for w in steps if "admitting" in w]
        assert len(admitting) == 1 and admitting[0].startswith("decode step admitting 3 calls ("), steps
        assert "decode step" in steps  # the others, plain
        assert engine.decoder.status()["admit_s"] > 0
    finally:
        thread.stop()


def test_a_quick_job_queued_at_a_stop_fails_with_cancelled_error_not_a_hang(engine):
    thread = EngineThread()
    gate, running = threading.Event(), threading.Event()
    blocked = thread.submit(lambda: (running.set(), gate.wait()))
    assert running.wait(30)
    thread.scheduler.stop()  # the stop, queued while the thread is busy
    quick = thread.submit(lambda: "ran", quick=True)
    gate.set()
    blocked.result(timeout=30)
    with pytest.raises(CancelledError):
        quick.result(timeout=30)
    thread.stop()


def test_idle_jobs_run_when_nothing_waits_one_at_a_time_and_never_while_a_call_decodes(engine, caplog):
    thread = EngineThread()
    order: list[str] = []
    try:
        thread.attach(engine.decoder, engine.planner)
        call = thread.submit(lambda: engine.start_call(session(engine, "busy", PROMPTS[0]),
                                                       GenerateParams(max_tokens=40))).result()

        def first() -> None:  # a request that comes while an idle job runs waits for it, then goes first
            order.append(f"idle1 decoding={engine.decoder.active}")
            thread.submit(lambda: order.append("job"))

        def boom() -> None:
            raise RuntimeError("injected: an idle job failed")

        def joined() -> None:
            engine.decoder.join(call)
            for fn in (first, boom, lambda: order.append("idle2"), lambda: order.append("idle3")):
                thread.idle(fn)
        thread.submit(joined).result()
        assert len(call.future.result(timeout=60).tokens) == 40
        deadline = time.monotonic() + 30
        while len(order) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == ["idle1 decoding=False", "job", "idle2", "idle3"], order
        assert any("idle job failed" in r.getMessage() for r in caplog.records)
        assert thread.submit(lambda: "alive").result(timeout=10) == "alive"
    finally:
        thread.stop()


def test_a_lone_call_decodes_alone_and_moves_into_the_batch_when_company_comes(engine):
    params = GenerateParams(max_tokens=4)
    alone = [solo_tokens(engine, f"alone{i}", p, params) for i, p in enumerate(PROMPTS[:2])]
    first = engine.start_call(session(engine, "first", PROMPTS[0]), params)
    engine.decoder.join(first)
    for _ in range(3):
        engine.decoder.step()
    assert first.solo is not None and engine.decoder.batch is None  # alone: a plain forward pass
    second = engine.start_call(session(engine, "second", PROMPTS[1]), params)
    run_together(engine, [second])  # the first's 4th token is handed over as it moves: its call ends there
    assert [first.future.result().tokens, second.future.result().tokens] == alone
    s = first.session
    assert s.cache[0].offset == len(s.tokens) and s.tokens[-4:] == alone[0]


class Passes:
    """The model, recording each forward pass's batch size."""

    def __init__(self, model) -> None:
        self.model, self.sizes = model, []

    def __call__(self, inputs, cache=None):
        self.sizes.append(inputs.shape[0])
        return self.model(inputs, cache=cache)


def test_calls_arriving_together_join_in_one_merge_with_no_pass_of_their_own(engine):
    # Was: each joining call took a one-row forward pass of its own (mlx-lm's GenerationBatch constructor),
    # then joined: passes of 1, 1, 1, 1 rows before the first of 4.
    params = GenerateParams(max_tokens=12)
    alone = [solo_tokens(engine, f"alone{i}", p, params) for i, p in enumerate(PROMPTS)]
    calls = [engine.start_call(session(engine, f"m{i}", p), params) for i, p in enumerate(PROMPTS)]
    engine.decoder.model = passes = Passes(engine.decoder.model)
    run_together(engine, calls)
    got = [c.future.result().tokens for c in calls]
    assert got == alone
    # One pass feeds the four prompts' last tokens, then one pass per token; rows only leave.
    assert passes.sizes[0] == 4 and len(passes.sizes) == 1 + max(len(t) for t in got)
    assert passes.sizes == sorted(passes.sizes, reverse=True)


def test_a_long_call_among_short_ones_decodes_alone_and_pads_no_short_row(merging, monkeypatch):
    engine = merging
    from kvwake.daemon.model import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "PAD_SLACK", 64)
    params = GenerateParams(max_tokens=8)
    texts = ["word " * 120, "hi", "ok then", "short"]
    alone = [solo_tokens(engine, f"alone{i}", t, params) for i, t in enumerate(texts)]
    sessions = [session(engine, f"p{i}", t) for i, t in enumerate(texts)]
    long_tokens = sessions[0].processed
    calls = [engine.start_call(s, params) for s in sessions]
    for call in calls:
        engine.decoder.join(call)
    engine.decoder.step()
    batch = engine.decoder.batch
    assert calls[0].solo is not None and len(engine.decoder.rows) == 3  # the long one decodes alone
    padded = batch.prompt_cache[0].size()  # the batch's KV length: its longest short row (+ the step)
    assert long_tokens > 500 and padded < 32, (long_tokens, padded)
    run_together(engine, [])
    assert [c.future.result().tokens for c in calls] == alone


def test_rows_live_in_slots_and_a_leaving_calls_slot_goes_to_the_next_call(engine):
    from kvwake.daemon.model.batch_rows import SLOTS

    texts = ["The weather today is", "a somewhat longer prompt about tools", "x" * 40, "tell me", "short"]
    limits = [3, 16, 16, 16, 16]
    no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
    params = [GenerateParams(max_tokens=n, logit_bias=no_eos) for n in limits]
    alone = [engine.generate(session(engine, f"alone{i}", t), p).tokens for i, (t, p) in enumerate(zip(texts, params))]
    calls = [engine.start_call(session(engine, f"s{i}", t), p) for i, (t, p) in enumerate(zip(texts, params))]
    engine.decoder.model = passes = Passes(engine.decoder.model)
    run_together(engine, calls, join_at={4: 6})  # the first leaves after step 3; the fifth joins at step 6
    assert [c.future.result().tokens for c in calls] == alone
    # Four rows, then the fifth call in the first's slot (no batch of 5), then one when three leave at once.
    assert set(passes.sizes) <= set(SLOTS) and passes.sizes == [4] * 17 + [1] * 6, passes.sizes
    assert passes.sizes[-1] == 1 and engine.decoder.batch is None and not engine.decoder.dead


def test_each_slot_size_is_warmed_on_dead_rows_without_a_call(engine):
    engine.decoder.model = passes = Passes(engine.decoder.model)
    assert engine.decoder.warm() == [2, 4, 8]  # max_batch 8
    assert passes.sizes == [2, 2, 4, 4, 8, 8] and not engine.decoder.active and engine.decoder.batch is None
    params = GenerateParams(max_tokens=6)
    alone = solo_tokens(engine, "alone", PROMPTS[0], params)
    assert solo_tokens(engine, "after", PROMPTS[0], params) == alone


def test_the_warm_up_is_short_jobs_the_daemon_runs_after_it_answers(engine, monkeypatch):
    # Was one step of the engine's construction on CUDA (each slot size's kernels, then the attention
    # paths' costs at every key length): seconds before the daemon listened. Now jobs for the engine
    # thread, one per size and per key length; until the last, short chunks take the plain path.
    from kvwake.daemon.model import attention

    from tests.test_pipeline import restores_as

    monkeypatch.setattr(attention, "on_cuda", lambda: True)
    monkeypatch.setattr(attention, "_measured", {})  # the process's first measure (a later one is a job: its table)
    restores_as(monkeypatch, "staged", engine)
    engine.planner.plain_prefill, engine.context_length, engine.planner.paths = True, 4096, None
    engine.decoder.model = passes = Passes(engine.decoder.model)
    jobs = engine.warm_jobs()
    # sizes; decode; a wake's staging; the plain path's classes of shape within the context; keys 1k, 4k
    plain = attention.plain_warm_shapes(engine.prefill_step, 4096)
    assert plain and all(q + k <= 4096 for q, k in plain)
    assert len(jobs) == 3 + len(attention.decode_warm_capacities()) + 1 + len(plain) + 2
    assert engine._warm_staging in jobs
    for job in jobs[:-1]:
        job()
    assert passes.sizes[:6] == [2, 2, 4, 4, 8, 8] and engine.planner.paths is None
    jobs[-1]()
    assert [row[0] for row in engine.planner.paths.table] == [1024, 4096] and engine.decoder.batch is None


def test_the_plain_path_is_not_warmed_at_a_shape_whose_cache_would_take_half_the_room_for_kv(engine, monkeypatch):
    # The warm-up runs after the daemon answers, beside live sessions: a shape whose cache alone would take
    # more than half of what the limits leave for KV is skipped
    from kvwake.daemon.model import attention

    monkeypatch.setattr(attention, "on_cuda", lambda: True)
    engine.planner.plain_prefill, engine.context_length, engine.planner.paths = True, 32768, None
    small = min(engine.kv_bytes(q + k) for q, k in attention.plain_warm_shapes(engine.prefill_step, 32768))
    plain = [job for job in engine.warm_jobs() if "warm_plain" in getattr(job, "__code__", type(job)).co_names]
    assert len(plain) == len(attention.plain_warm_shapes(engine.prefill_step, 32768)) == 4
    engine.kv_room_bytes = 2 * small
    plain = [job for job in engine.warm_jobs() if "warm_plain" in getattr(job, "__code__", type(job)).co_names]
    assert len(plain) == 1


def test_a_lone_sessions_decode_is_warmed_at_whole_capacities_and_the_model_is_left_as_it_was(engine, monkeypatch):
    # On CUDA a lone session's decode step over a buffer of a multiple of 256 tokens builds a cuDNN graph
    # per capacity (a long build: a decoding neighbour's p99 beside a prefill; docs/decisions.md, "Many agents at
    # once (issue 24)").
    import mlx_lm.models.llama as llama

    from kvwake.daemon.model import attention

    params = GenerateParams(max_tokens=6)
    before = solo_tokens(engine, "before", PROMPTS[0], params)
    fused, seen = llama.scaled_dot_product_attention, []

    def spy(queries, keys, values, cache, scale, mask, sinks=None):
        seen.append((queries.shape[2], keys.shape[2], cache.keys.shape[2]))
        return fused(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", spy)
    assert attention.warm_decode(engine.model, 512)
    monkeypatch.undo()
    # one query over a whole 512-token buffer (a slice of all of it), in every layer
    assert seen[-len(engine.make_cache()):] == [(1, 512, 512)] * len(engine.make_cache()), seen
    assert solo_tokens(engine, "after", PROMPTS[0], params) == before


def test_a_one_token_session_takes_a_dead_slot_and_decodes_as_alone(engine):
    no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
    params = [GenerateParams(max_tokens=n, logit_bias=no_eos) for n in (2, 12, 12, 12, 8)]
    inputs = [[40, 41, 42], [50, 51, 52, 53], [60, 61], [70, 71, 72, 73, 74], [99]]  # the last: one token, no KV

    def fresh(name, tokens):
        s = Session(name)
        engine.append(s, tokens=tokens)
        return s

    alone = [engine.generate(fresh(f"alone{i}", t), p).tokens for i, (t, p) in enumerate(zip(inputs, params))]
    calls = [engine.start_call(fresh(f"o{i}", t), p) for i, (t, p) in enumerate(zip(inputs, params))]
    engine.decoder.model = passes = Passes(engine.decoder.model)
    run_together(engine, calls, join_at={4: 5})  # the first leaves after step 2: the fifth takes its slot
    assert [c.future.result().tokens for c in calls] == alone
    assert passes.sizes[:13] == [4] * 13, passes.sizes


def test_a_long_row_already_batched_goes_on_alone_when_short_calls_join(engine, monkeypatch):
    from kvwake.daemon.model import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "PAD_SLACK", 64)
    no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
    params = GenerateParams(max_tokens=10, logit_bias=no_eos)
    texts = ["word " * 40, "a short one"] + [f"agent {i}" for i in range(5)]  # 200 tokens, then short ones
    alone = [solo_tokens(engine, f"alone{i}", t, params) for i, t in enumerate(texts)]
    calls = [engine.start_call(session(engine, f"e{i}", t), params) for i, t in enumerate(texts)]
    run_together(engine, calls[:2] + calls[2:], join_at={i: 3 for i in range(2, 7)})  # two batch, five join
    assert [c.future.result().tokens for c in calls] == alone
    assert engine.decoder.counters["max_batch_seen"] == 7


def test_the_long_row_leaves_the_batch_at_the_join_and_the_batch_is_cut_to_the_short_rows(merging, monkeypatch):
    engine = merging
    from kvwake.daemon.model import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "PAD_SLACK", 64)
    no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
    params = GenerateParams(max_tokens=10, logit_bias=no_eos)
    texts = ["word " * 40, "a short one"] + [f"agent {i}" for i in range(5)]
    calls = [engine.start_call(session(engine, f"f{i}", t), params) for i, t in enumerate(texts)]
    for call in calls[:2]:
        engine.decoder.join(call)
    engine.decoder.step()
    assert engine.decoder.batch.prompt_cache[0].size() >= 199  # batched together: the long one's length
    for call in calls[2:]:
        engine.decoder.join(call)
    engine.decoder.step()
    assert calls[0].solo is not None and len(engine.decoder.rows) == 6
    assert engine.decoder.batch.prompt_cache[0].size() < 20  # the short rows' length, not the long one's
    run_together(engine, [])


def test_status_counts_merges_slot_reuses_and_compactions(engine):
    no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
    params = [GenerateParams(max_tokens=n, logit_bias=no_eos) for n in (3, 10, 10, 10, 6)]
    calls = [engine.start_call(session(engine, f"c{i}", t), p) for i, (t, p) in enumerate(zip(PROMPTS + ["hi"], params))]
    before = dict(engine.decoder.counters)
    run_together(engine, calls, join_at={4: 6})
    status = engine.decoder.status()
    assert status["merges"] - before["merges"] == 1 and status["slot_reuses"] - before["slot_reuses"] == 1
    assert status["compactions"] > before["compactions"] and status["batch_rows"] == status["dead_rows"] == 0


def test_a_failed_jobs_exception_reaches_its_waiter_without_the_jobs_locals():
    # A job's exception travels to its waiter's thread with a traceback whose frames held the job's locals
    # (caches, MLX arrays): freed there, MLX memory went back to MLX from a thread that is not the engine
    # thread while the engine thread ran MLX. The engine thread now clears those frames before handing over.
    import gc
    import weakref

    from kvwake.daemon.model.thread import EngineThread

    class Held:  # stands for an MLX array a job made
        pass

    refs = []

    def job():
        held = Held()
        refs.append(weakref.ref(held))
        try:
            raise KeyError("inner")
        except KeyError:
            raise ValueError("the job failed") from None  # a chained context too: its frames are cleared as well

    thread = EngineThread()
    try:
        with pytest.raises(ValueError, match="the job failed") as caught:
            thread.call(job)
        gc.disable()  # only reference counts: nothing collected behind the test's back
        try:
            assert refs[0]() is None, "the job's local is still alive, held by its exception's frames"
        finally:
            gc.enable()
        assert "job" in "".join(__import__("traceback").format_tb(caught.value.__traceback__))  # lines kept
    finally:
        thread.stop()


def test_clearing_an_exceptions_frames_leaves_a_suspended_generator_running():
    # An exception caught inside a generator that then suspends has that live frame in its traceback;
    # clearing it would close the generator (Python 3.11/3.12). Its frames are left alone.
    from kvwake.daemon.jobs import unframed

    caught = []

    def numbers():
        try:
            raise KeyError("caught inside")
        except KeyError as exc:
            caught.append(exc)
        yield 1
        yield 2

    gen = numbers()
    assert next(gen) == 1  # suspended, its frame in caught[0]'s traceback
    unframed(caught[0])
    assert next(gen) == 2


def test_a_finished_jobs_closure_and_result_are_freed_on_the_engine_thread_without_a_next_job():
    # Was: the engine thread kept its last job (closure and future) while it waited for the next, so what
    # the job held (a deleted session, a prefill chunk's cache layers) lived on, on an idle daemon, until
    # another request came, and was freed then, all at once.
    import threading
    import weakref

    from kvwake.daemon.model.thread import EngineThread

    class Held:  # stands for a session's cache
        pass

    freed_on: list[str] = []
    gone = threading.Event()
    thread = EngineThread()
    try:
        held, go = Held(), threading.Event()
        weakref.finalize(held, lambda: (freed_on.append(threading.current_thread().name), gone.set()))
        done = thread.submit(lambda held=held: go.wait())  # its closure holds it; only its closure, once
        del held
        go.set()
        done.result()
        assert gone.wait(5), "the finished job still holds it"
        assert freed_on == ["kvwake-engine"]
    finally:
        thread.stop()


def test_rows_that_join_or_stay_have_their_caches_scheduled_ahead_of_the_pass_and_decode_as_alone(
        merging, monkeypatch):
    """batch_rows.schedule: after a merge, a placement into a dead slot and a compaction, the batch's caches are
    scheduled as work of their own before the next pass (inside it they cost about twice as much), and every
    call gives what it gives alone."""
    import mlx.core as mx

    from kvwake.daemon.model import batch_rows

    engine = merging

    scheduled: list[str] = []

    class Recording:
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def async_eval(*args):
            flat = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])]
            scheduled.append("caches" if flat and all(isinstance(a, tuple) for a in flat) else "tokens")
            mx.async_eval(*args)

    monkeypatch.setattr(batch_rows, "mx", Recording())
    no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
    params = [GenerateParams(max_tokens=n, logit_bias=no_eos) for n in (3, 10, 10, 10, 6)]
    texts = PROMPTS + ["hi"]
    alone = [engine.generate(session(engine, f"alone{i}", t), p).tokens for i, (t, p) in enumerate(zip(texts, params))]
    calls = [engine.start_call(session(engine, f"c{i}", t), p) for i, (t, p) in enumerate(zip(texts, params))]
    before = dict(engine.decoder.counters)
    run_together(engine, calls, join_at={4: 6})  # a merge, a slot reused, then compactions as rows leave
    assert [c.future.result().tokens for c in calls] == alone
    status = engine.decoder.status()
    schedules = (status["merges"] - before["merges"]) + (status["slot_reuses"] - before["slot_reuses"]) + \
        (status["compactions"] - before["compactions"])
    assert scheduled.count("tokens") >= 3 and schedules >= 3
    assert scheduled.count("caches") == scheduled.count("tokens"), scheduled
