"""Continuous persistence, on a real daemon: a never-slept session's full blocks survive kill -9 (at
random points, writes in flight), wake exactly, serve other sessions' prefixes, and make its sleep short."""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from testkit.daemon import Daemon, RawClient, RpcError
from testkit.tinymodel import make_model_dir

B = 16  # tokens per block (the test daemon's)
GREEDY = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny")


def small_chunks(root, **more) -> dict:
    """Config: prefill in 32-token chunks, so a prompt fills a block or two per chunk (many checkpoints)."""
    lines = ["prefill_step = 32", *(f"{k} = {v}" for k, v in more.items())]
    (root / "none.toml").write_text("\n".join(lines) + "\n")
    return {}


def persisted(c: RawClient, sid: str) -> int:
    return c.call("session.info", session_id=sid)["persisted_tokens"]


def wait_persisted(c: RawClient, sid: str, tokens: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := persisted(c, sid)) < tokens:
        assert time.monotonic() < deadline, f"{sid}: {n} tokens persisted after {timeout} s, {tokens} expected"
        time.sleep(0.02)
    return n


def idle(c: RawClient, timeout: float = 30.0) -> None:
    """Wait until no checkpoint is queued or running."""
    deadline = time.monotonic() + timeout
    while (p := c.call("status")["persistence"])["queued"] or p["running"]:
        assert time.monotonic() < deadline, f"persistence still busy after {timeout} s: {p}"
        time.sleep(0.02)


def tokens_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def same_continuation(c: RawClient, sid: str, tokens: list[int], ref: str) -> None:
    """The session continues exactly as a fresh session given the same tokens (which prefills them all)."""
    c.call("session.create", session_id=ref)
    c.call("session.append", session_id=ref, tokens=tokens)
    assert c.call("session.generate", session_id=sid, **GREEDY)["tokens"] == \
        c.call("session.generate", session_id=ref, **GREEDY)["tokens"]


def test_kill_9_at_random_points_keeps_every_persisted_block_of_a_never_slept_session(tmp_path, model_dir):
    small_chunks(tmp_path)
    d, rng = Daemon(tmp_path, model_dir).start(), random.Random(23)
    rounds, mid_write, fed_per_round = 5, 0, []
    for round_ in range(rounds):
        sid, fed = f"never-slept-{round_}", []
        with d.client() as c:
            c.call("session.create", session_id=sid)
            pieces = [tokens_of(rng, rng.randrange(20, 90)) for _ in range(40)]
            seen = {"persisted": 0}

            def feed(pieces=pieces, fed=fed, sid=sid) -> None:
                with RawClient(d.socket) as own:
                    try:
                        for piece in pieces:
                            own.call("session.append", session_id=sid, tokens=piece)
                            fed.extend(piece)
                    except (RpcError, OSError, ConnectionError, EOFError):
                        pass  # the daemon was killed under it

            writer = threading.Thread(target=feed)
            writer.start()
            while not fed and writer.is_alive():  # the kill's window opens once appends flow: a fresh daemon's
                time.sleep(0.005)  # first pass may wait for its kernels (CUDA) longer than the whole window
            kill_at = time.monotonic() + rng.uniform(0.05, 1.5)
            while time.monotonic() < kill_at:  # what the client can know is durable, just before the kill
                seen["persisted"] = persisted(c, sid)
                time.sleep(0.01)
            state = c.call("status")["persistence"]
            mid_write += state["queued"] > 0 or state["running"] or len(fed) // B * B > seen["persisted"]
        d.stop(signal.SIGKILL)
        writer.join()
        fed_per_round.append(len(fed))
        d.start()
        with d.client() as c:
            woke = c.call("session.wake", session_id=sid)
            assert woke["tokens"] >= seen["persisted"], f"round {round_}: {woke} lost persisted tokens {seen}"
            assert woke["blocks_from_disk"] + woke["blocks_from_memory"] == woke["tokens"] // B or \
                woke["tokens"] > persisted(c, sid)  # pending tokens beyond its blocks are prefilled on use
            info = c.call("session.info", session_id=sid)
            assert info["persisted_tokens"] >= seen["persisted"] and info["persisted_tokens"] % B == 0
            history = fed + [t for p in pieces for t in p][len(fed):]  # every piece the client sent, in order
            assert len(history) >= woke["tokens"]
            if woke["tokens"]:  # killed before its first block was persisted: nothing to continue
                same_continuation(c, sid, history[: woke["tokens"]], f"ref-{round_}")
    with d.client() as c:
        assert c.call("store.fsck")["ok"]
    d.stop()
    assert mid_write > 0, fed_per_round  # some kills landed while blocks were filled but not yet committed


def test_a_sleep_after_persistence_writes_only_the_tail_and_replaces_the_checkpoint(tmp_path, model_dir):
    small_chunks(tmp_path)
    d, rng = Daemon(tmp_path, model_dir).start(), random.Random(5)
    with d.client() as c:
        c.call("session.create", session_id="long")
        tokens = tokens_of(rng, 300)  # 18 full blocks and 12 tokens
        c.call("session.append", session_id="long", tokens=tokens)
        wait_persisted(c, "long", 288)
        idle(c)  # the counters follow the commit that persisted_tokens reads
        before = c.call("status")["persistence"]
        assert before["checkpoint_blocks"] == 18 and before["checkpoints"] >= 2
        slept = c.call("session.sleep", session_id="long")
        assert slept["new_blocks"] == 0 and slept["reused_blocks"] == 18, slept
        assert 0 < slept["written_bytes"] < before["checkpoint_bytes"] / 18  # the tail, less than a block
        info = c.call("session.info", session_id="long")
        assert info["head"] == slept["snapshot_id"] and info["persisted_tokens"] == 299
        assert info["snapshots"] == 2  # the new session's empty one and the sleep's: checkpoints were replaced
        assert c.call("status")["persistence"]["checkpoint_blocks"] == 18  # the sleep wrote none through it
        same_continuation(c, "long", tokens, "ref")
        assert c.call("store.fsck")["ok"]
    d.stop()


def test_a_never_slept_sessions_persisted_blocks_serve_another_sessions_prefix(tmp_path, model_dir):
    small_chunks(tmp_path)
    d, rng = Daemon(tmp_path, model_dir).start(), random.Random(7)
    shared = tokens_of(rng, 200)
    with d.client() as c:
        c.call("session.create", session_id="first")
        c.call("session.append", session_id="first", tokens=shared)
        wait_persisted(c, "first", 192)
    d.stop(signal.SIGKILL)  # never slept; nothing hot is left to copy a prefix from
    d.start()
    with d.client() as c:
        c.call("session.create", session_id="second")
        appended = c.call("session.append", session_id="second", tokens=shared + tokens_of(rng, 40))
        assert appended["reused"] == 192, appended  # every persisted block, from the store
        assert c.call("session.info", session_id="first")["state"] == "asleep"
    d.stop()


def test_persisted_blocks_serve_a_prefix_while_their_session_is_still_hot_and_busy(tmp_path, model_dir):
    # A hot idle session's prefix is copied in memory (manager._hot_prefix); a busy one's is not: the store's
    # blocks serve it, committed by persistence while the first session never slept.
    small_chunks(tmp_path)
    d, rng = Daemon(tmp_path, model_dir).start(), random.Random(9)
    shared = tokens_of(rng, 200)
    with d.client() as c, d.client() as other:  # c waits for the long generate, other does the rest
        other.call("session.create", session_id="busy")
        other.call("session.append", session_id="busy", tokens=shared)
        wait_persisted(other, "busy", 192)
        # Long enough to outlast what follows (asserted below: still decoding), not to hold up the test.
        long = c.send("session.generate", {"session_id": "busy", "max_tokens": 800, "temperature": 0.0})
        while other.call("session.info", session_id="busy")["busy"] is None:
            time.sleep(0.005)
        other.call("session.create", session_id="late")
        appended = other.call("session.append", session_id="late", tokens=shared + tokens_of(rng, 40))
        assert other.call("session.info", session_id="busy")["busy"] == "generate"  # still decoding meanwhile
        assert appended["reused"] == 192, appended
        assert other.call("status")["counters"]["prefix_copies"] == 0
        c.receive(long)
    d.stop()


def test_a_chat_session_killed_after_a_turn_wakes_with_that_turn_and_continues_exactly(tmp_path, model_dir):
    small_chunks(tmp_path)
    d = Daemon(tmp_path, model_dir).start()
    system = "You are a terse agent that uses tools. " * 3
    turn = {"max_tokens": 8, "temperature": 0.0}
    with d.client() as c:
        c.call("session.create", session_id="chat", system=system)
        first = c.call("session.chat", session_id="chat", messages=[{"role": "user", "content": "list files"}], **turn)
        total = c.call("session.info", session_id="chat")["tokens"]
        wait_persisted(c, "chat", total // B * B)
        idle(c)  # the turn's own checkpoint (offered before the reply was sent) is committed
    d.stop(signal.SIGKILL)
    d.start()
    with d.client() as c:
        info = c.call("session.info", session_id="chat")
        assert info["state"] == "asleep" and info["tokens"] == total  # the reply is there too, as pending tokens
        woke = c.call("session.wake", session_id="chat")
        assert woke["tokens"] == total
        assert c.call("session.info", session_id="chat")["messages"] == 3  # system, user, the assistant's reply
        c.call("session.create", session_id="twin", system=system)
        again = c.call("session.chat", session_id="twin", messages=[{"role": "user", "content": "list files"}], **turn)
        assert again["tokens"] == first["tokens"]
        follow = [{"role": "user", "content": "now open one"}]
        assert c.call("session.chat", session_id="chat", messages=follow, **turn)["tokens"] == \
            c.call("session.chat", session_id="twin", messages=follow, **turn)["tokens"]
    d.stop()


def test_a_checkpoints_engine_jobs_are_named_in_the_record_of_slow_work(tmp_path, model_dir):
    """Which of a checkpoint's engine-thread jobs ran when (its span's copy scheduled, then taken): what a
    decoding neighbour's long step is laid beside. All were "checkpoint.settled" before."""
    small_chunks(tmp_path)
    d = Daemon(tmp_path, model_dir, env={"KVWAKE_SLOW_JOB_MS": "0", "KVWAKE_SLOW_JOBS_KEPT": "5000"}).start()
    try:
        with d.client() as c:
            c.call("session.create", session_id="named")
            c.call("session.append", session_id="named", tokens=tokens_of(random.Random(5), 3 * B + 5))
            wait_persisted(c, "named", 3 * B)
            idle(c)
            named = {j["what"] for j in c.call("status")["engine_thread"]["slow"] if j["what"].startswith("checkpoint.")}
    finally:
        d.stop()
    assert {"checkpoint.token_bytes", "checkpoint.schedule_first", "checkpoint.capture_span"} <= named, named


def test_persistence_can_be_turned_off_and_kvwake_status_says_which(tmp_path, model_dir):
    import subprocess
    import sys

    def cli_status(d: Daemon) -> str:
        out = subprocess.run([sys.executable, "-m", "kvwake.client.cli", "--socket", str(d.socket), "status"],
                             capture_output=True, text=True, timeout=60, env=d.env)
        assert out.returncode == 0, out.stderr
        return next(line for line in out.stdout.splitlines() if line.lstrip().startswith("persistence"))

    rng = random.Random(3)
    for persist in (False, True):
        root = tmp_path / str(persist)
        root.mkdir()
        small_chunks(root, persist=str(persist).lower())
        d = Daemon(root, model_dir).start()
        with d.client() as c:
            c.call("session.create", session_id="s")
            c.call("session.append", session_id="s", tokens=tokens_of(rng, 100))
            if persist:
                wait_persisted(c, "s", 96)
                idle(c)
            state = c.call("status")["persistence"]
            assert state["enabled"] is persist
            assert c.call("session.info", session_id="s")["persisted_tokens"] == (96 if persist else 0)
        line = cli_status(d)
        if persist:
            assert state["state"] == "on" and state["checkpoint_blocks"] == 6, state
            assert f"on: {state['checkpoints']} checkpoints, 6 blocks" in line, line
        else:
            assert state["state"] == "off (setting persist = false)" and state["checkpoints"] == 0, state
            assert "off (setting persist = false)" in line, line
        d.stop()


def test_a_session_whose_whole_prompt_came_from_stored_blocks_is_persisted_too(tmp_path, model_dir):
    # Was: offered only after a prefill chunk, so a session whose prompt the prefix cache served whole
    # (nothing left to prefill) never advanced its head: kill -9 lost the conversation.
    small_chunks(tmp_path)
    d, rng = Daemon(tmp_path, model_dir).start(), random.Random(11)
    prompt = tokens_of(rng, 200)
    with d.client() as c:
        for sid in ("source", "copy"):
            c.call("session.create", session_id=sid)
        c.call("session.append", session_id="source", tokens=prompt)
        c.call("session.sleep", session_id="source")  # its blocks and its tail serve the same prompt whole
        appended = c.call("session.append", session_id="copy", tokens=prompt)
        assert appended["prefilled"] == 0, appended
        wait_persisted(c, "copy", 192, timeout=10)
        idle(c)
    d.stop(signal.SIGKILL)
    d.start()
    with d.client() as c:
        assert c.call("session.wake", session_id="copy")["tokens"] == 200
        same_continuation(c, "copy", prompt, "ref")
    d.stop()


def test_a_checkpoint_reads_a_cache_between_a_prefills_chunks_not_inside_one(tmp_path, model_dir, monkeypatch):
    # On CUDA a checkpoint's capture job landed between two slices of a prefill chunk (the chunk is
    # queued whole, then computed a few layers per job): reading the cache computed the chunk's remaining
    # layers in the capture's job, then the next slice waited for them on the GPU, a decoding neighbour's
    # worst gaps. Now the capture waits for the chunk's end.
    from kvwake.daemon.kv import pipeline
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.model.thread import EngineThread
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    store = Store(tmp_path / "store", block_tokens=B)
    thread = EngineThread()
    engine = thread.submit(lambda: Engine(store, tmp_path, model_dir, prefill_step=64, persist=False)).result()
    chunk_done_at_read = []
    real_defer = pipeline.defer_blocks

    def defer(ctx, cache, first, count, own=False):
        chunk_done_at_read.append(not session.computing)
        return real_defer(ctx, cache, first, count, own)
    monkeypatch.setattr(pipeline, "defer_blocks", defer)
    try:
        session = Session("s")
        thread.call(lambda: engine.append(session, tokens=list(range(3, 43))))  # 39 tokens computed: 2 blocks
        session.tokens += list(range(50, 90))
        monkeypatch.setattr(type(engine.decoder), "active", property(lambda self: True))  # a neighbour decodes
        engine.decoder.step_s = 1e-9  # slices of one layer
        chunk = thread.call(lambda: engine.planner.chunk(session, len(session.tokens) - 1))
        assert not chunk.done and session.computing
        result: list = []
        driver = threading.Thread(target=lambda: result.append(
            pipeline.checkpoint(engine.kv, session, thread.call, supersede=None)))
        driver.start()
        deadline = time.monotonic() + 30
        while not thread.call(lambda: session._settled):  # the capture is waiting for the chunk's end
            assert driver.is_alive() and time.monotonic() < deadline, "the checkpoint read the cache mid-chunk"
            time.sleep(0.01)
        while not chunk.done:
            thread.call(chunk.step)
        driver.join(30)
        assert result and result[0].n_tokens == 2 * B and chunk_done_at_read == [True]
        assert not session.computing and not session._settled
    finally:
        thread.call(engine.close)
        thread.stop()
        store.close()


def test_a_prefill_stopped_between_slices_drops_its_half_chunk_and_releases_what_waited(tmp_path, model_dir,
                                                                                      monkeypatch):
    # A checkpoint waiting for a chunk's end must not wait forever when the prefill stops between slices
    # (the runner of a slice's job raised before running it): the half-computed cache is dropped, as after a
    # failed slice, and the waiter runs.
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store

    store = Store(tmp_path / "store", block_tokens=B)
    engine = Engine(store, tmp_path, model_dir, prefill_step=64, persist=False)
    monkeypatch.setattr(type(engine.decoder), "active", property(lambda self: True))
    engine.decoder.step_s = 1e-9  # slices of one layer
    session, waited, steps = Session("s"), [], []

    def mlx(fn):
        if getattr(getattr(fn, "fn", fn), "__name__", "") == "step":  # a Packed step job
            steps.append(fn)
            if len(steps) == 1:
                waited.append(session.when_settled(lambda: session.cache))
            else:
                raise RuntimeError("the slice's job did not run")
        return fn()
    try:
        with pytest.raises(RuntimeError):
            engine.append(session, tokens=list(range(3, 90)), mlx=mlx)
        assert waited and waited[0].done() and waited[0].result() is None  # it ran, on a dropped cache
        assert not session.computing and session.cache is None and session.processed == 0
    finally:
        engine.close()
        store.close()
