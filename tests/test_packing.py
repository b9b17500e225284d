"""Turns that come at once prefill in one forward pass (model/packing.py): each session's cache ends as its
own prefill would leave it (bit for bit on the CPU), the engine thread runs the pack as one job in the first
turn's place, and a failure reaches the turns it belongs to."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from kvwake.daemon.config import Tuning
from kvwake.daemon.jobs import Packed
from kvwake.daemon.model import attention, packing
from kvwake.daemon.model.scheduler import slices as prefillslices
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.scheduler import pack_groups
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.model.thread import EngineThread
from kvwake.daemon.session_state import Session
from tests.test_batching import batched_engine, session
from tests.test_prefill_slices import LayersOnly

HISTORIES = ["the first agent read the tests " * 3, "a short one", "x" * 90, "the weather in the harbour " * 5]
TURNS = [" now fix the failing test", " next", " and then a longer message about the module and its tools " * 3,
         "!"]
PACKS = Tuning(pack_prefill=True, prefill_threads=1)  # one pass, the GPU's way (model/packing.py); model/parallel_rows.py apart


@pytest.fixture
def engine(model_dir, tmp_path):
    """The batched engine of test_batching, packing the turns that come at once."""
    yield from batched_engine(model_dir, tmp_path, tuning=PACKS)


@pytest.fixture
def twin(model_dir, tmp_path):
    """`engine` again, on a store of its own: the same turns prefilled on it reach none of the other's prefixes.
    Over pages (CUDA's default for llama) a second session of a history on one engine maps the first's pages and
    prefills only the tail, a prefix hit, which on CUDA is held to a bound, not to bits (tests/test_prefix.py)."""
    yield from batched_engine(model_dir, tmp_path / "twin", tuning=PACKS)


def held(cache: list) -> list[mx.array]:
    """Every layer's keys and values up to its offset (a ring's whole buffer, with where it stands): what
    the cache stands for."""
    out = []
    for layer in cache:
        if hasattr(layer, "max_size"):
            out += [layer.keys, layer.values, mx.array([layer.offset, layer._idx])]
        else:
            out += [a[..., : layer.offset, :] for a in (layer.keys, layer.values)]
    return out


def same(a: list, b: list) -> bool:
    return all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(held(a), held(b), strict=True))


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    from testkit.tinymodel import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("packing") / "gemma3_text", arch="gemma3_text")


@pytest.fixture(scope="module")
def gemma_wrapped_dir(tmp_path_factory):
    """Gemma 3's 4B, 12B and 27B checkpoints: mlx-lm's gemma3, a multimodal wrapper around a gemma3_text model."""
    from testkit.tinymodel import ARCHS, make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("packing") / "gemma3", arch="gemma3_text", model_type="gemma3",
                          text_config=dict(ARCHS["gemma3_text"]))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gemma3"])
def test_a_packed_pass_leaves_each_cache_as_its_own_prefill_would(arch, model_dir, gemma_dir, gemma_wrapped_dir):
    """gemma3_text (window 8, every history past it): each ring's chunk attends under its window's array mask,
    a one-token row under none, beside the global layers' plain KV. gemma3: the same through its wrapper (was:
    not packed, and no attention path swapped, its module being the wrapper's)."""
    model, tokenizer = load(str({"llama": model_dir, "gemma3_text": gemma_dir, "gemma3": gemma_wrapped_dir}[arch]))
    assert packing.packable_model(model)
    assert attention.attention_module(model) is not None
    histories = [tokenizer.encode(h) for h in HISTORIES]
    news = [tokenizer.encode(t) for t in TURNS]
    assert len(news[3]) == 1  # a one-token row among longer ones
    if arch != "llama":
        window = attention.text_model(model).args.sliding_window
        assert any(len(n) > window for n in news) and any(1 < len(n) < window for n in news)
    for path in (lambda fused: fused, lambda fused: attention.plain_attention(fused)):
        alone, packed = [], []
        for history, new in zip(histories, news):
            for out in (alone, packed):
                cache = make_prompt_cache(model)
                model(mx.array(history)[None], cache=cache)
                mx.eval([c.state for c in cache])
                out.append(cache)
            with attention.swapped(model, path):
                model(mx.array(new)[None], cache=alone[-1])
            mx.eval([c.state for c in alone[-1]])
        packing.forward(model, list(zip(news, packed)), [path] * len(news))
        mx.eval([c.state for cache in packed for c in cache])
        for i, (a, b) in enumerate(zip(alone, packed)):
            assert [c.offset for c in a] == [c.offset for c in b]
            assert same(a, b), f"row {i}: the packed pass's keys or values differ from its own prefill's"


def test_packed_jobs_queued_by_their_turn_run_as_one_pack_in_the_first_ones_place():
    thread = EngineThread()
    order: list[str] = []

    def pack(jobs: list[Packed]) -> list:
        order.append("pack " + " ".join(job.args[0] for job in jobs))
        return [ValueError(job.args[0]) if job.args[0] == "bad" else job.args[0].upper() for job in jobs]

    try:
        gate, running = threading.Event(), threading.Event()
        blocked = thread.submit(lambda: (running.set(), gate.wait()))
        assert running.wait(30)
        a = thread.submit(Packed(lambda: None, pack, ("a",)))
        plain = thread.submit(lambda: order.append("plain"))
        b = thread.submit(Packed(lambda: None, pack, ("b",)))
        bad = thread.submit(Packed(lambda: None, pack, ("bad",)))
        gate.set()
        blocked.result(30)
        assert (a.result(30), b.result(30)) == ("A", "B")
        with pytest.raises(ValueError, match="bad"):
            bad.result(30)  # its own item: the others got theirs
        plain.result(30)
        assert order == ["pack a b bad", "plain"]  # one pack, where the first was queued

        def broken(jobs: list[Packed]) -> list:
            raise RuntimeError("the pack failed")

        assert thread.submit(Packed(lambda: None, broken)).exception(30).args == ("the pack failed",)
        short = thread.submit(Packed(lambda: None, lambda jobs: [], ("x",)))  # a pack's bug: no items
        assert "a pack of 1 jobs gave 0 results" in str(short.exception(30))
        assert thread.submit(lambda: "alive").result(30) == "alive"  # the engine thread goes on
        assert Packed(lambda: None, pack, ("alone",))() == "ALONE"  # called directly: a pack of one
    finally:
        thread.stop()


def turns_at_once(engine: Engine, thread: EngineThread, sessions: list[Session], texts: list[str]) -> None:
    """Each session's append from its own thread while the engine thread is held, released once all wait."""
    gate, running = threading.Event(), threading.Event()
    blocked = thread.submit(lambda: (running.set(), gate.wait()))
    assert running.wait(30)
    errors: list[BaseException] = []

    def append(s: Session, text: str) -> None:
        try:
            engine.append(s, text=text, mlx=thread.call)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=append, args=(s, t)) for s, t in zip(sessions, texts)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 30
    while thread.scheduler.waiting()[1] < len(sessions) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    blocked.result(30)
    for w in workers:
        w.join(60)
    assert not errors, errors


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced beside decoding"])
def test_turns_that_come_at_once_prefill_in_one_pass_and_continue_as_each_alone(engine, twin, monkeypatch, sliced):
    if sliced:  # a call decodes (as far as the prefill sees): slices of one layer, a step job each
        monkeypatch.setattr(type(engine.decoder), "active", property(lambda self: True))
        engine.decoder.step_s = twin.decoder.step_s = 1e-9
    assert engine.planner.pack_prefill
    alone = [session(twin, f"alone{i}", h) for i, h in enumerate(HISTORIES)]  # on the twin: no hit of theirs here
    for s, t in zip(alone, TURNS):
        twin.append(s, text=t)  # `direct`: a pack of one, the lone path
    packs, chunks = engine.counters["prefill_packs"], engine.counters["prefill_packed_chunks"]
    together = [session(engine, f"together{i}", h) for i, h in enumerate(HISTORIES)]
    lengths = [len(engine.plan(s, text=t).target) - 1 - s.processed for s, t in zip(together, TURNS)]
    assert len(pack_groups(list(enumerate(lengths)))) == 2, lengths  # the short two, the long two: padding bounded
    thread = EngineThread()
    try:
        turns_at_once(engine, thread, together, TURNS)
    finally:
        thread.stop()
    assert engine.counters["prefill_packs"] == packs + 2
    assert engine.counters["prefill_packed_chunks"] == chunks + len(TURNS)
    monkeypatch.undo()
    for a, b in zip(alone, together):
        assert (a.processed, a.tokens) == (b.processed, b.tokens) and not b.computing
        assert same(a.cache, b.cache), f"{b.id}: its cache differs from the same turn prefilled alone"
        params = GenerateParams(max_tokens=8)
        assert twin.generate(a, params).tokens == engine.generate(b, params).tokens


def test_a_sliding_window_models_turns_pack_stop_at_their_restore_points_and_continue_as_each_alone(gemma_dir,
                                                                                                  tmp_path):
    """Gemma 3's turns that come at once pack (rings and plain layers in one pass), each row's chunk ending at its
    own restore point's boundary where it has one. Two engines on two stores, so that neither prefix reaches the
    other: the same turns prefilled one at a time on the first, at once on the second."""
    from kvwake.store import Store

    made = []
    for name in ("alone", "together"):
        store = Store(tmp_path / name, block_tokens=16)
        made.append((store, Engine(store, tmp_path / f"{name}-state", gemma_dir, max_batch=8, tuning=PACKS)))
    (_, first), (_, second) = made
    try:
        assert second.planner.pack_prefill and second.points.enabled
        alone = [session(first, f"s{i}", h) for i, h in enumerate(HISTORIES)]
        taken_before = first.points.counters["points_taken"]
        for s, t in zip(alone, TURNS):
            first.append(s, text=t)
        together = [session(second, f"s{i}", h) for i, h in enumerate(HISTORIES)]
        points = second.points.counters["points_taken"]
        thread = EngineThread()
        try:
            turns_at_once(second, thread, together, TURNS)
        finally:
            thread.stop()
        assert second.counters["prefill_packs"] >= 2, second.counters  # the short two, the long two
        assert first.counters["prefill_packs"] == 0
        for a, b in zip(alone, together):
            assert (a.processed, a.tokens) == (b.processed, b.tokens) and not b.computing
            assert same(a.cache, b.cache), f"{b.id}: its cache differs from the same turn prefilled alone"
            params = GenerateParams(max_tokens=8)
            assert first.generate(a, params).tokens == second.generate(b, params).tokens
        # the turns' points, taken where their rows stopped, as the lone turns' were
        taken = second.points.counters["points_taken"] - points
        assert taken > 0 and taken == first.points.counters["points_taken"] - taken_before
    finally:
        for store, e in made:
            e.close()
            store.close()


def test_a_turn_that_fits_no_pack_goes_alone_beside_it(engine):
    long_turn = " a long tool result with many lines of output" * 40  # its first chunk: ~400 tokens
    texts = [TURNS[1], TURNS[3], long_turn]  # 5 and 1 tokens: the long one would pad them past twice their work
    alone = [session(engine, f"alone{i}", HISTORIES[i]) for i in range(3)]
    for s, t in zip(alone, texts):
        engine.append(s, text=t)
    together = [session(engine, f"together{i}", HISTORIES[i]) for i in range(3)]
    packs, chunks = engine.counters["prefill_packs"], engine.counters["prefill_packed_chunks"]
    thread = EngineThread()
    try:
        turns_at_once(engine, thread, together, texts)
    finally:
        thread.stop()
    assert (engine.counters["prefill_packs"], engine.counters["prefill_packed_chunks"]) == (packs + 1, chunks + 2)
    for a, b in zip(alone, together):
        assert a.processed == b.processed and same(a.cache, b.cache)


@pytest.fixture
def engine512(model_dir, tmp_path):
    """The CPU's chunk size on every backend (CUDA's 2048 would take these prompts in one chunk)."""
    yield from batched_engine(model_dir, tmp_path, prefill_step=512, tuning=PACKS)


def test_long_prompts_chunks_queued_together_are_packed_chunk_by_chunk(engine512):
    engine = engine512
    prompts = ["the archive holds notes and plans " * 40, "tool output, line after line " * 45]
    alone = [session(engine, f"alone{i}", p) for i, p in enumerate(prompts)]
    together = []
    for i, p in enumerate(prompts):
        s = Session(f"together{i}")
        plan = engine.plan(s, text=p)
        engine._adopt(s, plan, (None, 0))
        together.append(s)
    upto = [len(s.tokens) - 1 for s in together]
    assert all(n > 2 * engine.prefill_step for n in upto)  # three chunks or more each
    packs = engine.counters["prefill_packs"]
    while any(s.processed < n for s, n in zip(together, upto)):
        jobs = [Packed(engine.planner.chunk, engine.planner.next_chunks, (s, n)) for s, n in zip(together, upto)
                if s.processed < n]
        chunks = engine.planner.next_chunks(jobs)
        assert len(jobs) == 1 or len({id(c) for c in chunks}) == 1  # both sessions' chunks in one pass
    assert engine.counters["prefill_packs"] >= packs + 2
    for a, b in zip(alone, together):
        assert a.processed == b.processed and same(a.cache, b.cache)


def test_one_turns_failing_check_or_missing_cache_fails_that_turn_alone(engine):
    """A turn's should_stop that raises, or a prefill whose cache is gone, is that turn's item; the pack's
    other turns go on (each raised for the whole pack before)."""
    sessions = [session(engine, f"s{i}", h) for i, h in enumerate(HISTORIES[:4])]
    plans = [engine.plan(s, text=t) for s, t in zip(sessions, TURNS)]

    def broken() -> bool:
        raise ConnectionError("the client's check failed")

    stops = [None, broken, lambda: False, broken]
    uptos = [len(p.target) - 1 for p in plans[:3]] + [0]  # the last has nothing to prefill: its check unasked
    jobs = [Packed(engine._adopt_and_start, engine._start_turns, (s, p, (None, 0), upto, stop))
            for s, p, upto, stop in zip(sessions, plans, uptos, stops)]
    packs = engine.counters["prefill_packs"]
    items = engine._start_turns(jobs)
    assert isinstance(items[1], ConnectionError)
    assert all(isinstance(item, tuple) and item[1] is not None for item in (items[0], items[2]))
    assert items[0][1] is items[2][1] and engine.counters["prefill_packs"] == packs + 1  # the two left: one pack
    assert isinstance(items[3], tuple) and items[3][1] is None
    longer = session(engine, "longer", "the archive holds notes and plans " * 40)
    upto = len(longer.tokens) + 40
    longer.tokens = longer.tokens + longer.tokens[:40]
    lost = session(engine, "lost", HISTORIES[0])
    lost.cache = None  # a failed pass dropped it
    chunks = engine.planner.next_chunks([Packed(engine.planner.chunk, engine.planner.next_chunks, (s, n))
                                  for s, n in ((longer, upto), (lost, len(lost.tokens) + 5))])
    assert isinstance(chunks[0], prefillslices.Chunk) and "lost: its cache was dropped" in str(chunks[1])


def test_a_failed_slice_of_a_packed_chunk_drops_every_sessions_cache_and_fails_each_step():
    class Layer:
        state = property(lambda self: mx.array([1]))

    class Failing(Layer):
        @property
        def state(self):
            raise RuntimeError("slice failed")

    class Fake:
        def __init__(self, layers: list) -> None:
            self.id, self.cache, self.processed, self.computing, self.settled = "s", layers, 0, False, 0

        def settle(self, later) -> None:
            self.settled += 1
            self.computing = False

    one, two = Fake([Layer(), Layer()]), Fake([Layer(), Failing()])
    chunk = prefillslices.Chunk(one, 5, prefillslices.Slicer(), target_s=1.0, kind="packed@3", more=[(two, 7)],
                                padded=14)
    assert one.computing and two.computing and chunk.start_of(two) == 0
    chunk.step()  # layer 0 (one layer: no cost measured yet)
    assert "in 2 sessions" in chunk.trace()
    with pytest.raises(RuntimeError, match="slice failed"):
        chunk.step()
    for s in (one, two):
        assert s.cache is None and s.processed == 0 and s.settled == 1 and not s.computing
    with pytest.raises(RuntimeError, match="slice failed"):  # another caller's step: the same failure
        chunk.step_job()
    chunk.abandon()  # nothing more to drop
    assert one.settled == two.settled == 1


def test_a_packed_chunk_sizes_its_slices_from_its_own_slices_not_the_kinds_earlier_ones():
    """Every pack is its own shapes: sized from an earlier pack's cost, a pack's first slice can take several
    times its target. A pack starts at one layer, measured, whatever the slicer knows."""
    shared = prefillslices.Slicer()
    shared.observe(1e-12, 1, 10, "packed@3")  # an earlier pack of this kind: nearly free
    lone = prefillslices.Chunk(LayersOnly(), 5, shared, target_s=1.0, kind="packed@3")
    lone.step()
    assert lone.last == (0, 6)  # a lone chunk uses its kind's cost: all six layers in one slice
    known = shared.layer_token_s["packed@3"]
    chunk = prefillslices.Chunk(LayersOnly(), 5, shared, target_s=1.0, kind="packed@3", more=[(LayersOnly(), 7)],
                                padded=14)
    chunk.step()
    assert chunk.last == (0, 1)  # layer 0: no attention, nothing measured
    chunk.step()
    assert chunk.last == (1, 1)  # measured: its own cost from here
    chunk.step()
    assert chunk.done and shared.layer_token_s["packed@3"] == known  # the shared costs untouched


def test_packs_bound_their_padding_and_a_turn_that_fits_none_prefills_alone():
    assert pack_groups([("a", 10), ("b", 12), ("c", 200), ("d", 9)]) == [["d", "a", "b"]]  # c: 4 x 200 > 2 x 231
    assert pack_groups([("a", 100), ("b", 5), ("c", 5)]) == [["b", "c"]]  # 3 x 100 would be 2.7 x 110
    assert pack_groups([("a", 100), ("b", 60), ("c", 70), ("d", 300), ("e", 250)]) == [["b", "c", "a"], ["e", "d"]]
    assert pack_groups([("a", 10)]) == []


@pytest.mark.parametrize("running,steps", [(2, 2), (1, 4), (4, 1)])
def test_a_packed_chunks_slices_share_their_time_by_the_sessions_on_each_side(engine, monkeypatch, running, steps):
    monkeypatch.setattr(type(engine.decoder), "active", property(lambda self: True))
    monkeypatch.setattr(type(engine.decoder), "running", property(lambda self: running))
    engine.decoder.step_s = 0.01
    rows = []
    for i, (history, turn) in enumerate(zip(HISTORIES, TURNS)):
        s = session(engine, f"s{i}", history)
        plan = engine.plan(s, text=turn)
        engine._adopt(s, plan, (None, 0))
        rows.append((s, len(plan.target) - 1))
    chunk = engine.planner._pack_chunk(rows)  # 4 turns waiting beside `running` decoding calls: 4 / running steps
    assert chunk.target_s == pytest.approx(0.01 * engine.planner.slice_of_step * steps)


def test_a_packed_pass_that_fails_as_it_is_built_drops_every_sessions_cache_and_fails_each_turn(engine, monkeypatch):
    together = [session(engine, f"s{i}", h) for i, h in enumerate(HISTORIES[:2])]  # their turns: one pack

    def broken(model, rows, paths):
        rows[0][1][0].offset += 5  # a layer fed before the failure
        raise RuntimeError("forward failed")

    monkeypatch.setattr(packing, "forward", broken)
    jobs = []
    for s, t in zip(together, TURNS):
        plan = engine.plan(s, text=t)
        jobs.append(Packed(engine._adopt_and_start, engine._start_turns, (s, plan, (None, 0), len(plan.target) - 1, None)))
    errors = engine._start_turns(jobs)
    assert len(errors) == 2 and all(isinstance(e, RuntimeError) and "forward failed" in str(e) for e in errors), errors
    assert all(s.cache is None and s.processed == 0 for s in together)
    monkeypatch.undo()
    for s in together:  # usable again: the next append rebuilds from the tokens
        assert engine.append(s, text=" again")["prefilled"] > 0 and s.cache is not None


def test_a_model_whose_rope_scales_by_a_single_offset_is_not_packed(tmp_path):
    from testkit.tinymodel import make_model_dir

    model, _ = load(str(make_model_dir(tmp_path / "ntk", rope_scaling={"type": "dynamic", "factor": 2.0})))
    assert type(model.layers[0].self_attn.rope).__name__ == "DynamicNTKScalingRoPE"
    assert not packing.packable_model(model)  # it takes its base from an int offset: an array offset raises


def test_with_packing_off_a_turns_jobs_are_plain_ones(engine, monkeypatch):
    engine.planner.pack_prefill = False
    s = session(engine, "off", HISTORIES[0])
    kinds: list[str] = []

    def mlx(fn):
        kinds.append(type(fn).__name__)
        return fn()

    engine.append(s, text=TURNS[2], mlx=mlx)
    assert kinds[0] == "function", kinds  # the turn's first job: a plain one (packed, it would pull others forward)


def test_turns_pack_where_a_gpu_computes_and_go_one_at_a_time_on_the_cpu():
    """A pack of n turns costs about one pass on a GPU and what its tokens cost on the CPU (docs/decisions.md,
    "Turns one at a time where a pass costs its tokens"): the knob, when set, decides."""
    assert packing.wanted(True) and not packing.wanted(False)
    assert packing.wanted() == (mx.default_device() != mx.cpu)


# prefill_threads is the CPU's (model/parallel_rows.py `threads_wanted`): where a GPU computes, a pack is one pass
ON_CPU = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="prefill_threads runs a pack's rows apart on the "
                            "CPU only: MLX computes on a GPU here")


class ThreadsSeen:
    """The model, recording the thread of every call; each call waits (30 s at most) until a second thread's is
    in too: two rows of a pack run at once, or the wait breaks."""

    def __init__(self, model) -> None:
        self.model, self.threads, self.together = model, [], threading.Barrier(2, timeout=30)

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        self.together.wait()
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture
def apart(model_dir, tmp_path):
    """An engine whose packs run their rows apart on two threads (model/parallel_rows.py: prefill_threads = 2)."""
    yield from batched_engine(model_dir, tmp_path, tuning=Tuning(prefill_threads=2))


@ON_CPU
def test_turns_that_come_at_once_on_the_cpu_run_apart_on_threads_and_continue_bit_exact_as_each_alone(apart):
    # On the CPU a pass keeps one core busy, so a pack in one pass cost what its turns cost one at a time: its
    # rows apart on threads of their own cost the longest row where cores suffice.
    engine = apart
    assert engine.planner.pack_prefill and not engine.planner.one_at_a_time and engine.prefill_rows.threads == 2
    alone = [session(engine, f"alone{i}", h) for i, h in enumerate(HISTORIES)]
    for s, t in zip(alone, TURNS):
        engine.append(s, text=t)
    packs = engine.counters["prefill_packs"]
    together = [session(engine, f"together{i}", h) for i, h in enumerate(HISTORIES)]
    seen = engine.planner.model = ThreadsSeen(engine.planner.model)
    thread = EngineThread()
    try:
        turns_at_once(engine, thread, together, TURNS)
    finally:
        thread.stop()
    engine.planner.model = seen.model
    assert engine.counters["prefill_packs"] == packs + 2  # the short two, the long two
    # every pack's two rows at once (the barrier), one on a worker and one on the engine thread
    assert len(seen.threads) == 4 and sum(name.startswith("kvwake-rows") for name in seen.threads) == 2, seen.threads
    for a, b in zip(alone, together):
        assert (a.processed, a.tokens) == (b.processed, b.tokens) and not b.computing
        assert same(a.cache, b.cache), f"{b.id}: its cache differs from the same turn prefilled alone"
        params = GenerateParams(max_tokens=8)
        assert engine.generate(a, params).tokens == engine.generate(b, params).tokens


@ON_CPU
def test_a_row_that_fails_apart_drops_every_sessions_cache_once_the_others_are_done_and_fails_each_turn(apart):
    engine = apart
    together = [session(engine, f"s{i}", h) for i, h in enumerate(HISTORIES[:2])]  # their turns: one pack
    model, failing = engine.planner.model, together[1].cache

    def broken(tokens, cache):
        if cache is failing:
            raise RuntimeError("row failed")
        return model(tokens, cache=cache)

    engine.planner.model = broken
    jobs = []
    for s, t in zip(together, TURNS):
        plan = engine.plan(s, text=t)
        jobs.append(Packed(engine._adopt_and_start, engine._start_turns, (s, plan, (None, 0), len(plan.target) - 1, None)))
    try:
        errors = engine._start_turns(jobs)
    finally:
        engine.planner.model = model
    assert len(errors) == 2 and all(isinstance(e, RuntimeError) and "row failed" in str(e) for e in errors), errors
    assert all(s.cache is None and s.processed == 0 for s in together)
    for s in together:  # usable again: the next append rebuilds from the tokens
        assert engine.append(s, text=" again")["prefilled"] > 0 and s.cache is not None


@ON_CPU
def test_the_cpu_packs_apart_with_prefill_threads_and_takes_turns_one_at_a_time_by_default(model_dir, tmp_path):
    from kvwake.daemon.model import parallel_rows

    assert parallel_rows.threads_wanted() == 1 and parallel_rows.threads_wanted(3) == 3  # MLX on the CPU here
    for tuning, packed in ((Tuning(), False), (Tuning(pack_prefill=False, prefill_threads=2), False),
                           (Tuning(prefill_threads=2), True), (Tuning(pack_prefill=True, prefill_threads=1), True)):
        for engine in batched_engine(model_dir, tmp_path / str(id(tuning)), tuning=tuning):
            assert engine.planner.pack_prefill is packed and engine.planner.one_at_a_time is not packed
            assert (engine.prefill_rows is not None) == (packed and tuning.prefill_threads != 1), tuning
            if engine.prefill_rows is not None:  # its threads start at its first pack, not with the engine
                assert engine.prefill_rows._workers == []


def test_turns_stay_one_at_a_time_with_prefill_threads_for_a_model_that_cannot_pack(tmp_path):
    # Was: prefill_threads turned the CPU's turn order to the GPU's (as they come) before asking whether the
    # model packs; a model that cannot (a rotary embedding with one offset) lost its one-at-a-time turns.
    from testkit.tinymodel import make_model_dir

    unpackable = make_model_dir(tmp_path / "ntk", rope_scaling={"type": "dynamic", "factor": 2.0})
    for engine in batched_engine(unpackable, tmp_path, tuning=Tuning(prefill_threads=2)):
        assert not engine.planner.pack_prefill and engine.prefill_rows is None
        assert engine.planner.one_at_a_time is (mx.default_device() == mx.cpu)  # a GPU keeps turns as they come


def test_parallel_rows_run_every_row_once_closed_and_carry_a_rows_error(model_dir):
    # Was: a run after close queued rows for workers that had gone, and waited for them for good.
    from kvwake.daemon.model import parallel_rows

    model, _ = load(str(model_dir))
    device = mx.default_device()
    rows = parallel_rows.ParallelRows(3, "kvwake-rows-test")
    caches = [make_prompt_cache(model) for _ in range(4)]
    rows.run(model, [([5, 6, 7, i + 1], c) for i, c in enumerate(caches)])
    assert [c[0].offset for c in caches] == [4] * 4 and len(rows._workers) == 2
    # Was: each worker's `with mx.stream(cpu stream)` set MLX's default device, the process's: the CPU while a
    # worker lived, and after two ended in another order than they began, for good (on CUDA, later tests'
    # kernels then ran on the CPU)
    assert mx.default_device() == device
    rows.close()
    assert rows._workers == [] and not any(t.name.startswith("kvwake-rows-test") for t in threading.enumerate())
    assert mx.default_device() == device
    later = [make_prompt_cache(model) for _ in range(2)]
    done = threading.Thread(target=rows.run, args=(model, [([1, 2], c) for c in later]))
    done.start()
    done.join(30)
    assert not done.is_alive() and [c[0].offset for c in later] == [2, 2]  # fed by the caller alone
    assert not any(t.name.startswith("kvwake-rows-test") for t in threading.enumerate())  # no worker started again

    def failing(tokens, cache):
        if cache is caches[1]:
            raise ValueError("row 1")
        return model(tokens, cache=cache)

    again = parallel_rows.ParallelRows(2)
    with pytest.raises(ValueError, match="row 1"):
        again.run(failing, [([9], c) for c in caches])
    assert caches[0][0].offset == caches[2][0].offset == caches[3][0].offset == 5  # the others all fed
    again.close()


def test_a_real_daemon_with_prefill_threads_packs_turns_that_come_at_once_and_answers_as_one_at_a_time(
        model_dir, tmp_path):
    from testkit.daemon import Daemon

    # a gather long enough for four turns released together to land on a loaded machine (fresh connections and
    # renders on two shared cores); the turns wait for the others only while some are still on their way
    d = Daemon(tmp_path, model_dir, extra=["--tune", "prefill_threads=2", "--tune", "pack_gather_ms=2000"]).start()
    try:
        with d.client() as c:
            for group in ("together", "alone"):
                for i, h in enumerate(HISTORIES):
                    c.call("session.create", session_id=f"{group}{i}")
                    c.call("session.append", session_id=f"{group}{i}", text=h)
            assert c.call("status")["tuning"]["prefill_threads"] == 2
            for i, t in enumerate(TURNS):  # one after another
                c.call("session.append", session_id=f"alone{i}", text=t)
            packs = c.call("status")["counters"]["prefill_packs"]
        errors: list[BaseException] = []
        connected = threading.Barrier(len(TURNS))  # connections made first: the turns then come within the gather

        def turn(i: int) -> None:
            try:
                with d.client() as own:
                    connected.wait(60)
                    own.call("session.append", session_id=f"together{i}", text=TURNS[i])
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        workers = [threading.Thread(target=turn, args=(i,)) for i in range(len(TURNS))]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert not errors, errors
        with d.client() as c:
            assert c.call("status")["counters"]["prefill_packs"] > packs  # they came at once: packed
            for i in range(len(TURNS)):  # and each continues as the same turn prefilled alone
                a, b = (c.call("session.generate", session_id=f"{g}{i}", max_tokens=8, temperature=0)["tokens"]
                        for g in ("alone", "together"))
                assert a == b, (i, a, b)
    finally:
        d.stop()
