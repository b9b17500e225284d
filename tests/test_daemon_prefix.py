"""A real daemon: a second session sharing a prompt of any length with a slept one reuses all of it."""

from __future__ import annotations

import sqlite3

import pytest

from testkit.daemon import Daemon, freed

B = 16
SHARED = [(i * 29 + 7) % 200 + 20 for i in range(40)]  # 2.5 blocks
TORN = [t + 1 for t in SHARED]  # another prompt of 2.5 blocks: no block of SHARED's serves it


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model_dir):
    """One daemon for the tests that share it, each with prompts of its own (no other test's blocks serve it)."""
    d = Daemon(tmp_path_factory.mktemp("daemon"), model_dir, block_tokens=B).start()
    yield d
    assert d.stop() == 0


def tail_file(daemon: Daemon, session_id: str) -> str:
    db = sqlite3.connect(daemon.data_dir / "store" / "index.sqlite")
    try:
        (rel,) = db.execute("SELECT s.tail_file FROM snapshots s JOIN sessions x ON x.head = s.id WHERE x.id = ?",
                            (session_id,)).fetchone()
    finally:
        db.close()
    return rel


def test_a_second_session_reuses_a_shared_prompt_of_two_and_a_half_blocks(daemon):
    with daemon.client() as c:
        c.call("session.create", session_id="a")
        c.call("session.append", session_id="a", tokens=SHARED + [30, 31, 32, 33, 34])
        c.call("session.sleep", session_id="a")  # 44 tokens in its cache: two blocks and a 12-token tail
        c.call("session.create", session_id="b")
        before = c.call("stats")["tokens"]["reused"]
        got = c.call("session.append", session_id="b", tokens=SHARED + [5, 6, 7])
        assert got["reused"] == 40 and got["prefilled"] == 2
        assert c.call("stats")["tokens"]["reused"] - before == 40


def test_chat_sessions_with_one_system_prompt_reuse_the_rendered_common_prefix(daemon):
    system = "Plan, then call one tool at a time. "  # 36 bytes: the tiny tokenizer has a token per byte
    with daemon.client() as c:
        for sid in ("first", "second"):
            c.call("session.create", session_id=sid, system=system)
        c.call("session.chat", session_id="first", messages=[{"role": "user", "content": "task one"}], max_tokens=4)
        c.call("session.sleep", session_id="first")
        out = c.call("session.chat", session_id="second", messages=[{"role": "user", "content": "task two"}],
                     max_tokens=4)
    # <|im_start|> "system\n" SYSTEM <|im_end|> "\n" <|im_start|> "user\n" "task " are shared: 56 tokens
    shared = 1 + len("system\n") + len(system) + 1 + 1 + 1 + len("user\n") + len("task ")
    assert shared % B and out["usage"]["reused_tokens"] == out["append"]["reused"] == shared


def test_a_corrupt_tail_is_prefilled_instead(daemon):
    with daemon.client() as c:
        c.call("session.create", session_id="torn")
        c.call("session.append", session_id="torn", tokens=TORN + [30, 31, 32, 33, 34])
        c.call("session.sleep", session_id="torn")
        path = daemon.data_dir / "store" / tail_file(daemon, "torn")
        path.write_bytes(path.read_bytes()[:-9])
        c.call("session.create", session_id="after-torn")
        got = c.call("session.append", session_id="after-torn", tokens=TORN + [5, 6, 7])
        assert got["reused"] == 32 and got["prefilled"] == 10  # the whole blocks only
        generated = c.call("session.generate", session_id="after-torn", max_tokens=3)
        assert generated["finish_reason"] in ("length", "stop")
    assert "prefix block unusable" in daemon.log.read_text()
    assert daemon.log_problems() == []


@pytest.mark.parametrize("paged", [False, True], ids=["buffers", "pages"])
def test_a_hot_session_shares_its_prompt_without_sleeping(tmp_path, model_dir, paged):
    # Persistence off: with it, the deleted sessions' persisted blocks would serve "cold" from the store
    # (tests/test_persist.py), and it would not be the from-scratch prefill compared with here. Over pages too
    # (the default on CUDA).
    daemon = Daemon(tmp_path, model_dir, block_tokens=B,
                    extra=["--no-persist", "--tune", f"paged_kv={str(paged).lower()}"]).start()
    with daemon.client() as c:
        c.call("session.create", session_id="a")
        c.call("session.append", session_id="a", tokens=SHARED + [30, 31, 32])  # hot, never slept
        c.call("session.create", session_id="b")
        got = c.call("session.append", session_id="b", tokens=SHARED + [5, 6, 7])
        assert got["reused"] == 40 and got["prefilled"] == 2
        assert c.call("status")["counters"]["prefix_copies"] == 1
        copied = c.call("session.generate", session_id="b", max_tokens=8)["tokens"]
        for sid in ("a", "b"):
            c.call("session.delete", session_id=sid)
        freed(c)  # a delete frees its KV after it replies: over pages a prompt before that maps the pages still there
        c.call("session.create", session_id="cold")  # nothing hot, nothing stored: prefilled from scratch
        cold = c.call("session.append", session_id="cold", tokens=SHARED + [5, 6, 7])
        assert cold["reused"] == 0
        assert c.call("session.generate", session_id="cold", max_tokens=8)["tokens"] == copied
    daemon.stop()
