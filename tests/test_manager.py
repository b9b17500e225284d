"""The daemon's session manager in-process (real engine thread, real store), for failure paths."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import time

import anyio
import pytest

from kvwake.daemon.config import Settings, Tuning
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.provider import ModelProvider
from kvwake.daemon.sessions.manager import SessionManager
from kvwake.daemon.model.thread import EngineThread
from kvwake.errors import InvalidParamsError, StorageFullError
from kvwake.store import Store
from testkit.tinymodel import make_model_dir

SYSTEM = "You are a careful agent. Follow the tool manual. " * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny")


def managed(model_dir, tmp_path, tuning: Tuning = Tuning()):
    """A session manager over the tiny model on a fresh 16-token-block store, closed after the yield."""
    store = Store(tmp_path / "store", block_tokens=16)
    thread = EngineThread()
    engine = thread.submit(lambda: Engine(store, tmp_path, model_dir, tuning=tuning)).result()
    # as serve does: generate calls decode between engine jobs
    yield SessionManager(ModelProvider.of(engine, thread), Settings(socket=tmp_path / "s.sock", data_dir=tmp_path))
    thread.stop()
    engine.close()
    store.close()


@pytest.fixture
def manager(model_dir, tmp_path):
    yield from managed(model_dir, tmp_path)


@pytest.fixture(params=[False, True], ids=["buffers", "pages"])
def either(model_dir, tmp_path, request):
    """A manager whose engine keeps KV in per-session buffers, then one whose engine keeps it in pages (the
    default on CUDA for a plain-attention model: the budget's and the room's counts hold both ways)."""
    yield from managed(model_dir, tmp_path, Tuning(paged_kv=request.param))


async def test_a_full_disk_during_sleep_is_storage_full_and_the_session_stays_hot(manager, monkeypatch):
    # Was: the block writes' task group wrapped StorageFullError in an ExceptionGroup: INTERNAL for clients.
    await manager.create("s", SYSTEM)
    await manager.append("s", messages=[{"role": "user", "content": "hi"}])
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(StorageFullError):
        await manager.sleep("s")
    monkeypatch.setattr(os, "write", real)
    entry = manager.entry("s")
    assert entry.session is not None and entry.session.cache is not None and entry.busy is None
    assert manager.counters["sleep_failures"] == 1
    assert (await manager.sleep("s"))["snapshot_id"]


async def test_metadata_json_cannot_hold_is_refused_at_create(manager):
    # Was: accepted (INTERNAL from the store), the session existed hot and could never sleep.
    with pytest.raises(InvalidParamsError, match="plain JSON"):
        await manager.create("m", None, {"blob": b"\x00"})
    assert "m" not in manager.entries


async def test_a_session_lent_for_a_prefix_copy_is_waited_for_not_busy(manager):
    # Was: while another session's first append copied this one's prefix (a claim held across one
    # engine job), a call on it failed at once with BUSY.
    await manager.create("source", SYSTEM)
    await manager.append("source", messages=[{"role": "user", "content": "hi"}])
    lent, released = anyio.Event(), anyio.Event()

    async def copy_holder() -> None:
        async with manager.claim("source", "copy"):
            lent.set()
            await anyio.sleep(0.2)
        released.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(copy_holder)
        await lent.wait()
        got = await manager.append("source", messages=[{"role": "user", "content": "again"}])
        assert released.is_set() and got["prefilled"] > 0


async def test_an_http_request_renders_its_prompt_once(manager, monkeypatch):
    # Was: twice for a stateless request: once to pick its session, again in the append.
    from kvwake.daemon.fronts.http import Api
    from kvwake.daemon.fronts.openai_shapes import ChatRequest

    renders = []
    template = manager.engine.template
    real = template.render
    monkeypatch.setattr(template, "render", lambda *a, **k: renders.append(a) or real(*a, **k))
    api = Api(manager)
    body = {"model": "m", "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
    for named in (None, "named", None):  # a new stateless session, a named one, the stateless one continued
        renders.clear()
        session, task = await api._start(ChatRequest.parse(body, named), None, lambda: False)
        result = await task
        assert len(renders) == 1, (session, len(renders))
        assert result["tokens"] and session["session_id"] in manager.entries
    assert session["match"] == "continued"


async def test_a_prompt_is_rendered_off_the_engine_thread_while_another_session_decodes(manager, monkeypatch):
    # Was: rendered in an engine job (a long text's encode is many decode steps), so every
    # decoding session waited for the template and the tokenizer. Here the render waits for the talker.
    from kvwake.daemon.model.generation import GenerateParams

    await manager.create("talker", SYSTEM)
    await manager.append("talker", messages=[{"role": "user", "content": "hi"}])
    await manager.create("reader", SYSTEM)
    rendering, talked, threads, waited = threading.Event(), threading.Event(), [], []
    template = manager.engine.template
    real = template.render

    def render(*a, **k):
        threads.append(threading.current_thread())
        rendering.set()
        waited.append(talked.wait(timeout=10))  # on the engine thread the talker could not step meanwhile
        return real(*a, **k)

    monkeypatch.setattr(template, "render", render)

    async def talk() -> None:
        await anyio.to_thread.run_sync(rendering.wait, 10)
        result = await manager.generate("talker", GenerateParams(max_tokens=4), None, lambda: False)
        assert len(result["tokens"]) == 4
        talked.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(talk)
        got = await manager.append("reader", messages=[{"role": "user", "content": "a long tool result"}])
    assert waited == [True], "the talker could not decode while the reader's prompt was rendered"
    assert threads and manager.thread._thread not in threads
    assert got["prefilled"] > 0


async def test_prompts_rendered_at_once_on_worker_threads_are_each_their_own(manager):
    # Renders run on worker threads now, many at once; the prompter's kept pieces are shared. From a cold
    # start (none of these texts seen), each must get what a renderer of its own gives it, and the
    # whole-encode check of the first real prompt must run once (a racing countdown would go below 0 and
    # check every prompt from then on).
    from kvwake.daemon.model.chat import ChatTemplate
    from kvwake.daemon.model.prompt import Prompter

    prompter = manager.engine.prompter
    own = Prompter(prompter.tokenizer, prompter.vocab_size, prompter.model_name)
    own.template = ChatTemplate(prompter.tokenizer)  # pieces of its own (a Prompter takes its tokenizer's template)
    prompter.at_once = threading.BoundedSemaphore(4)  # a machine of 16 cores
    inputs = [{"messages": [{"role": "system", "content": f"{SYSTEM} Desk {i}."},
                            {"role": "user", "content": f"turn {i} " * i}]} for i in range(1, 13)]
    alone = [own.render(**x).target for x in inputs]
    pieces = prompter.template.pieces
    encoded, verify = pieces.stats["pieces_encoded"], pieces._verify
    together = [None] * len(inputs)

    async def one(i: int) -> None:
        together[i] = (await manager.render(inputs[i])).target

    async with anyio.create_task_group() as tg:
        for i in range(len(inputs)):
            tg.start_soon(one, i)
    assert together == alone
    assert pieces.stats["pieces_encoded"] > encoded and pieces.on  # the cold path ran, pieced
    assert pieces._verify == max(0, verify - len(inputs))


async def test_one_prompts_encoding_does_not_hold_up_anothers(manager, monkeypatch):
    # Was: the prompter rendered one input at a time, so an agent's first long render (a new long
    # conversation, with the first prompt's whole-encode check) queued every other request's render
    # behind it. Now several render at once (a quarter of the cores, or the tuning knob renders_at_once).
    # Here one render's encoding waits until another's ends.
    pieces = manager.engine.template.pieces
    backend, entered, release = pieces.backend, threading.Event(), threading.Event()

    class Held:
        def encode_batch(self, texts, **options):
            if any("SLOW" in t for t in texts):
                entered.set()
                release.wait(30)
            return backend.encode_batch(texts, **options)

        def __getattr__(self, name):
            return getattr(backend, name)

    monkeypatch.setattr(pieces, "backend", Held())
    monkeypatch.setattr(manager.engine.prompter, "at_once", threading.BoundedSemaphore(2))  # a machine of 8 cores
    slow = {"messages": [{"role": "system", "content": f"{SYSTEM} SLOW"}, {"role": "user", "content": "a"}]}
    quick = {"messages": [{"role": "system", "content": f"{SYSTEM} quick"}, {"role": "user", "content": "b"}]}
    done: dict[str, list[int]] = {}
    released_before_quick: list[bool] = []

    async def render(name: str, inputs: dict) -> None:
        done[name] = (await manager.render(inputs)).target

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(render, "slow", slow)
            assert await anyio.to_thread.run_sync(entered.wait, 10)
            began = time.monotonic()
            await render("quick", quick)  # behind a lock, it would wait the 30 s the slow one's encoding waits
            released_before_quick.append(release.is_set())
            release.set()
            assert time.monotonic() - began < 5
    finally:
        release.set()
    assert released_before_quick == [False] and set(done) == {"slow", "quick"}
    monkeypatch.setattr(pieces, "backend", backend)
    assert done["slow"] == manager.engine.render(**slow).target
    assert done["quick"] == manager.engine.render(**quick).target


async def test_a_stateless_request_whose_session_is_taken_after_a_prefix_copy_is_matched_again(manager):
    # Was: a 409 BUSY. The request's session was lent to another session's prefix copy when its claim
    # came; the claim waited, another request took the session as the copy ended, and the late BUSY
    # was not one the front re-matched (it only looked right after starting the generation).
    from kvwake.daemon.fronts.http import Api
    from kvwake.daemon.fronts.openai_shapes import ChatRequest

    api = Api(manager)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    session, task = await api._start(ChatRequest.parse({"messages": first, "max_tokens": 2}, None), None,
                                     lambda: False)
    reply = (await task)["text"]
    turn = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
    real_find, lent = api.matcher.find, []

    async def take(entry):
        await anyio.sleep(0.05)
        entry.busy = "chat"  # the copy ended and another request claimed the session first
        await anyio.sleep(0.3)
        entry.busy = None

    async with anyio.create_task_group() as tg:
        async def find(target, mode, *hint):
            match = await real_find(target, mode, *hint)
            if match.how == "continued" and not lent:  # lent for a copy between the match and the claim
                lent.append(manager.entry(match.session_id))
                lent[0].busy = "copy"
                tg.start_soon(take, lent[0])
            return match

        api.matcher.find = find
        again, task = await api._start(ChatRequest.parse({"messages": turn, "max_tokens": 2}, None), None,
                                       lambda: False)
        result = await task
    assert lent and lent[0].id == session["session_id"]
    assert result["tokens"] and again["session_id"] != session["session_id"] and again["match"] == "new"


async def test_every_calls_streamed_output_of_a_step_reaches_the_loop_in_one_hop(manager):
    # Was: one call_soon_threadsafe per row per token (a batch of 32 woke the loop 32 times a step).
    import asyncio

    from kvwake.daemon.model.generation import GenerateParams

    loop, names = asyncio.get_running_loop(), [f"a{i}" for i in range(4)]
    for i, name in enumerate(names):
        await manager.create(name)
        await manager.append(name, text=f"agent {i} lists the tools it needs")
    pieces: dict[str, list[str]] = {name: [] for name in names}

    def on_event(name):
        return lambda event: manager.post(loop, pieces[name].append, event.get("text", ""))

    hops, steps = manager.thread.hops, manager.engine.decoder.counters["decode_steps"]
    results = await asyncio.gather(*(manager.generate(name, GenerateParams(max_tokens=40), on_event(name),
                                                      lambda: False) for name in names))
    events = sum(len(p) for p in pieces.values())
    assert all("".join(pieces[name]) == r["text"] for name, r in zip(names, results))  # all of it, in order
    hops, steps = manager.thread.hops - hops, manager.engine.decoder.counters["decode_steps"] - steps
    assert hops <= steps + 4 and events > 1.5 * hops, (events, hops, steps)  # a hop per step, not per row


def freed_where(session) -> list[str]:
    """The names of the threads each of the session's cache layers will be freed on (filled as they go)."""
    import threading
    import weakref

    where: list[str] = []
    for layer in session.cache:
        weakref.finalize(layer, lambda: where.append(threading.current_thread().name))
    return where


async def test_a_deleted_hot_sessions_kv_is_freed_on_the_engine_thread(manager):
    # Was: the session's cache went with its entry, on the event loop's thread (MLX memory given back off
    # the engine thread, and a stall of every connection while a big cache is unmapped).
    await manager.create("d", SYSTEM)
    await manager.append("d", messages=[{"role": "user", "content": "hi"}])
    where = freed_where(manager.entry("d").session)
    await manager.delete("d")
    await manager.released()
    assert where == ["kvwake-engine"] * 2, where  # the tiny llama's two layers


async def test_a_hot_session_woken_from_another_snapshot_frees_its_kv_on_the_engine_thread(manager):
    await manager.create("w", SYSTEM)
    await manager.append("w", messages=[{"role": "user", "content": "hi"}])
    first = (await manager.sleep("w", free=False))["snapshot_id"]
    await manager.append("w", messages=[{"role": "user", "content": "and more"}])
    where = freed_where(manager.entry("w").session)
    await manager.wake("w", snapshot_id=first)
    await manager.released()
    assert where == ["kvwake-engine"] * 2, where
    assert manager.entry("w").session.head == first


async def test_a_sleeping_sessions_kv_is_freed_a_few_layers_per_engine_job(manager, monkeypatch):
    from kvwake.daemon.kv import pipeline

    jobs: list[int] = []
    real = pipeline._free_layers
    monkeypatch.setattr(pipeline, "RELEASE_JOB_S", 0.0)  # at least one layer a job: here exactly one
    monkeypatch.setattr(pipeline, "_free_layers", lambda layers, s: (jobs.append(len(layers)), real(layers, s)))
    await manager.create("s", SYSTEM)
    await manager.append("s", messages=[{"role": "user", "content": "hi"}])
    where = freed_where(manager.entry("s").session)
    await manager.sleep("s")
    await manager.released()
    assert jobs == [2, 1] and where == ["kvwake-engine"] * 2, (jobs, where)  # two jobs, one layer each
    assert manager.entry("s").session is None


async def test_a_delete_the_store_refuses_keeps_the_session_whole(manager, monkeypatch):
    # Was: the KV was freed before the store's delete, so when the store refused, the
    # session stayed known and hot without its KV: its next sleep failed, or (persisting) committed a
    # snapshot no wake could restore.
    import sqlite3

    await manager.create("k", SYSTEM)
    await manager.append("k", messages=[{"role": "user", "content": "hi"}])
    session = manager.entry("k").session
    processed = session.processed

    def locked(session_id):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(manager.store, "delete_session", locked)
    with pytest.raises(sqlite3.OperationalError):
        await manager.delete("k")
    monkeypatch.undo()
    assert manager.entry("k").session is session and session.cache is not None and session.processed == processed
    await manager.sleep("k")
    await manager.wake("k")
    assert manager.entry("k").session.processed == processed
    from kvwake.daemon.model.generation import GenerateParams

    assert (await manager.generate("k", GenerateParams(max_tokens=3), None, lambda: False))["tokens"]


async def test_a_session_without_the_kv_of_its_processed_tokens_is_not_slept(manager):
    # A snapshot of processed tokens without their KV could not be woken: the sleep refuses it, names the
    # session, and the session's head stays the last good snapshot.
    from kvwake.errors import InternalError

    await manager.create("n", SYSTEM)
    await manager.append("n", messages=[{"role": "user", "content": "hi"}])
    session = manager.entry("n").session
    head = session.head
    session.cache = None  # what a bug would leave
    with pytest.raises(InternalError, match="session n: .* tokens processed but no cache"):
        await manager.sleep("n")
    assert manager.store.session("n")["head"] == head


async def test_a_sleep_replies_once_committed_and_its_kv_is_freed_after(either, monkeypatch):
    # Was: the reply waited for every layer's freeing job, each queued behind a neighbour's decode step (one
    # step per layer beside a decoding session). Now the reply goes at the commit; the bytes being freed
    # count in hot_bytes (and status) until they are gone. Paged, the pool counts the session's pages until
    # its table is freed: they were counted twice meanwhile (the pool's and the freeing's).
    manager = either
    import threading
    import time

    from kvwake.daemon.kv import pipeline
    from kvwake.daemon.sessions import reports

    go = threading.Event()
    real = pipeline._free_layers
    monkeypatch.setattr(pipeline, "_free_layers", lambda layers, s: (go.wait(10), real(layers, s)))
    await manager.create("f", SYSTEM)
    await manager.append("f", messages=[{"role": "user", "content": "hi"}])
    session = manager.entry("f").session
    nbytes, unpaged = manager.engine.cache_bytes(session), manager.engine.unpaged_bytes(session)
    assert unpaged == (0 if manager.engine.pages is not None else nbytes)
    where = freed_where(session)
    started = time.monotonic()
    info = await manager.sleep("f")
    assert time.monotonic() - started < 5, "the sleep waited for its KV's freeing"
    assert info["snapshot_id"] and manager.entry("f").session is None
    assert manager.freeing_bytes() == unpaged and manager.hot_bytes() == nbytes > 0 and where == []
    # what status says meanwhile: one session freeing (its bytes 0 over pages, so a wait reads the count)
    assert (await reports.status(manager))["memory"]["freeing_sessions"] == 1
    go.set()
    await manager.released()
    assert manager.freeing_bytes() == 0 and manager.hot_bytes() == 0
    assert (await reports.status(manager))["memory"]["freeing_sessions"] == 0
    assert where == ["kvwake-engine"] * 2, where
    await manager.wake("f")
    assert manager.entry("f").session.processed == session.processed


async def test_an_auto_sleep_over_the_budget_waits_for_the_kv_it_frees(either):
    # enforce_limits looks at hot_bytes again after each sleep: the slept session's KV must be gone by then,
    # or one session over the budget would put every other one to sleep too. (Each session's turn its own:
    # paged, sessions of the same tokens share every page, and a sleep of one of them frees none.)
    manager = either
    for name in ("a", "b", "c"):
        await manager.create(name, SYSTEM)
        await manager.append(name, messages=[{"role": "user", "content": f"hi, I am {name}"}])
    manager.settings = dataclasses.replace(manager.settings, hot_budget_bytes=manager.hot_bytes() - 1)  # one over
    assert await manager.enforce_limits() == 1
    assert manager.freeing_bytes() == 0 and len(manager.entries.hot) == 2


async def test_with_no_budget_configured_the_engines_own_decides_what_sleeps(either):
    manager = either
    for name in ("a", "b"):
        await manager.create(name, SYSTEM)
        await manager.append(name, messages=[{"role": "user", "content": f"hi, I am {name}"}])
    manager.settings = dataclasses.replace(manager.settings, hot_budget_bytes=None)
    manager.engine.hot_budget_bytes = manager.hot_bytes()  # both fit
    assert manager.hot_budget() == manager.hot_bytes() and await manager.enforce_limits() == 0
    manager.engine.hot_budget_bytes = manager.hot_bytes() - 1  # one over: the older sleeps
    assert await manager.enforce_limits() == 1 and list(manager.entries.hot) == ["b"]
    manager.settings = dataclasses.replace(manager.settings, hot_budget_bytes=1 << 40)  # a configured one wins
    assert manager.hot_budget() == 1 << 40


async def test_a_wake_that_would_not_fit_the_room_for_kv_sleeps_the_least_recently_used_first(either):
    # The budget lets hot sessions hold half the room for KV and one session may take all of it: a wake
    # beside a full budget must make room first, or MLX goes past its limit (on CUDA it spills to the host).
    manager = either
    tokens = [(i * 7) % 200 + 20 for i in range(600)]
    await manager.create("big")
    await manager.append("big", tokens=tokens)
    snapshot = (await manager.sleep("big"))["snapshot_id"]
    await manager.released()
    for name in ("a", "b"):
        await manager.create(name, SYSTEM)
        await manager.append(name, messages=[{"role": "user", "content": f"hi, I am {name}"}])
    engine = manager.engine  # what big's wake adds: its buffer, or paged, its pages (none of them resident)
    big = engine.kv_bytes(600) if engine.pages is None else engine.wake_bytes(engine.record(snapshot))
    manager.engine.kv_room_bytes = manager.hot_bytes() + big  # both stay: it fits
    await manager.wake("big")
    assert set(manager.entries.hot) == {"a", "b", "big"} and manager.counters["room_sleeps"] == 0
    await manager.sleep("big")
    await manager.released()
    manager.engine.kv_room_bytes = manager.hot_bytes() + big - 1  # one byte short: the older one sleeps
    await manager.wake("big")
    assert set(manager.entries.hot) == {"b", "big"} and manager.counters["room_sleeps"] == 1
    assert manager.hot_bytes() <= manager.engine.kv_room_bytes


async def test_an_append_of_text_makes_room_once_its_tokens_are_known(either):
    manager = either
    # text (and messages) over RPC are tokenized by the append itself: the room is made then, before the prefill
    await manager.create("a", SYSTEM)
    await manager.append("a", messages=[{"role": "user", "content": "hi"}])
    text = " ".join(f"note {i}" for i in range(45))
    # less than the text's own tokens take (more than 256): neither their 512-token buffer nor their pages fit
    manager.engine.kv_room_bytes = manager.hot_bytes() + manager.engine.kv_bytes(256) - 1
    await manager.create("long")
    got = await manager.append("long", text=text)
    assert 256 < got["tokens"] <= 512, got  # what the room was sized for
    assert set(manager.entries.hot) == {"long"} and manager.counters["room_sleeps"] == 1


async def test_status_names_the_engines_step_gaps_and_a_sleep_its_phases(manager):
    # step_gaps is the engine's side of a streaming client's token gaps (bench/batching.py reads it)
    from kvwake.daemon.model.generation import GenerateParams

    await manager.create("g", SYSTEM)
    await manager.append("g", messages=[{"role": "user", "content": "hi"}])
    no_eos = tuple((t, -100.0) for t in manager.engine.tokenizer.eos_token_ids)
    await manager.generate("g", GenerateParams(max_tokens=12, logit_bias=no_eos), None, lambda: False)
    gaps = manager.thread.timing()["step_gaps"]
    assert gaps["count"] >= 8 and 0 < gaps["p50_ms"] <= gaps["p99_ms"] <= gaps["max_ms"], gaps  # a gap per step
    info = await manager.sleep("g")
    assert list(info["phases_ms"]) == ["settle", "open", "blocks", "tail", "written", "commit"], info
    assert sum(info["phases_ms"].values()) <= info["ms"] + 1, info
