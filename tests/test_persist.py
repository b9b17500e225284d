"""Continuous persistence, on a real daemon: a never-slept session's full blocks survive kill -9 (at
random points, writes in flight), wake exactly, serve other sessions' prefixes, and make its sleep short."""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from tests.daemon import Daemon, RawClient, RpcError
from tests.tinymodel import make_model_dir

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
    rounds, mid_write = 5, 0
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
            kill_at = time.monotonic() + rng.uniform(0.05, 1.5)
            while time.monotonic() < kill_at:  # what the client can know is durable, just before the kill
                seen["persisted"] = persisted(c, sid)
                time.sleep(0.01)
            state = c.call("status")["persistence"]
            mid_write += state["queued"] > 0 or len(fed) // B * B > seen["persisted"]
        d.stop(signal.SIGKILL)
        writer.join()
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
            same_continuation(c, sid, history[: woke["tokens"]], f"ref-{round_}")
    with d.client() as c:
        assert c.call("store.fsck")["ok"]
    d.stop()
    assert mid_write > 0  # some kills landed while blocks were filled but not yet committed
