"""Stateless requests find their session by chain key: hot, asleep, after a restart, among thousands;
and session.list answers a page at a time, filtered."""

from __future__ import annotations

import json
import os

import openai
import pytest
from click.testing import CliRunner

from kvwake.client import Client, openai_config
from kvwake.client.cli import main
from kvwake.store import Store
from testkit.daemon import Daemon, RpcError

SYSTEM = "You are a careful agent. Answer briefly and name your sources. " * 4


def client_for(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(**openai_config(d.socket), max_retries=0, timeout=120)


def chat(api: openai.OpenAI, messages: list[dict], **options):
    return api.chat.completions.create(model="any", messages=messages, **{"max_tokens": 6, "temperature": 0, **options})


def kv(reply) -> dict:
    return reply.model_extra["kvwake"]


def turn(messages: list[dict], reply, question: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": question}]


def test_a_conversation_is_continued_hot_asleep_woken_and_after_a_restart(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    api = client_for(d)
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    first = chat(api, base)
    sid = kv(first)["session_id"]
    assert kv(first)["match"] == "new"
    conv = turn(base, first, "second question")
    second = chat(api, conv)  # hot: compared from memory
    assert (kv(second)["session_id"], kv(second)["match"]) == (sid, "continued")
    with d.client() as rpc:
        rpc.call("session.sleep", session_id=sid)
    conv = turn(conv, second, "third question")
    third = chat(api, conv)  # asleep: found by the chain keys of its head
    assert (kv(third)["session_id"], kv(third)["match"]) == (sid, "continued")
    assert third.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens
    # A retry of the second question branches: the session's last prompt is not inside it.
    retry = chat(api, turn(base, first, "second question, reworded"))
    assert kv(retry)["match"] == "branched" and kv(retry)["session_id"] != sid and kv(retry)["shared_tokens"] > 0
    # Raw completions never continue a chat session, whatever they share.
    assert api.completions.create(model="any", prompt=SYSTEM, max_tokens=2).model_extra["kvwake"]["match"] == "new"
    with d.client() as rpc:  # slept, then woken over RPC: hot, though no request made it so
        rpc.call("session.sleep", session_id=sid)
        chat(api, [{"role": "user", "content": "something else"}])
        rpc.call("session.wake", session_id=sid)
    conv = turn(conv, third, "fourth question")
    fourth = chat(api, conv)
    assert (kv(fourth)["session_id"], kv(fourth)["match"]) == (sid, "continued")
    assert d.stop() == 0
    d.start()
    conv = turn(conv, fourth, "fifth question")
    fifth = chat(client_for(d), conv)
    assert (kv(fifth)["session_id"], kv(fifth)["match"]) == (sid, "continued")
    assert fifth.usage.prompt_tokens_details.cached_tokens >= fourth.usage.prompt_tokens
    assert d.stop() == 0 and d.log_problems() == []


def test_among_thousands_of_stored_conversations_the_right_one_continues(tmp_path, model_dir, monkeypatch):
    # Made cheaply: 2,000 other agents that asked the same first question, as forks of one stored
    # conversation (their blocks shared, their KV real), written into the store with the daemon stopped:
    # the store's writer, as a fork writes, from the tail read once; unsynced, as what is asserted is the answer.
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    api = client_for(d)
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    first = chat(api, base)
    assert d.stop() == 0
    with Store(d.data_dir / "store", block_tokens=16) as store, monkeypatch.context() as unsynced:
        store.index.db.execute("PRAGMA synchronous=OFF")
        unsynced.setattr(os, "fsync", lambda fd: None)
        head = store.snapshot(store.latest_snapshot(kv(first)["session_id"]))
        tail = store.read_tail(head) if head.tail else None
        for i in range(2000):
            with store.writer(f"http-other-{i:05d}", head.bundle, head.token_ids, parent=head.id,
                              metadata=head.metadata) as fork:
                if tail is not None:
                    fork.set_tail(tail)
                fork.commit()
            store.ensure_session(f"http-other-{i:05d}", {"origin": "http"})
    d.start()
    api = client_for(d)
    tied = {kv(first)["session_id"]} | {f"http-other-{i:05d}" for i in range(2000)}
    conv = turn(base, first, "second question")
    second = chat(api, conv)  # all 2,001 hold the same conversation: one of them goes on
    assert kv(second)["match"] == "continued" and kv(second)["session_id"] in tied
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    third = chat(api, turn(conv, second, "third question"))  # now the only one that deep
    assert (kv(third)["session_id"], kv(third)["match"]) == (kv(second)["session_id"], "continued")
    retry = chat(api, turn(base, first, "second question, reworded"))  # the deepest one's last prompt is not in it
    assert kv(retry)["match"] == "branched" and kv(retry)["session_id"] not in tied
    other = chat(api, [base[0], {"role": "user", "content": "a new thread"}])  # the shared prompt, then new
    assert kv(other)["match"] == "branched" and kv(other)["shared_tokens"] > 0
    with d.client() as rpc:
        assert rpc.call("status")["sessions"]["asleep"] >= 2000
        listed, after = [], None
        while True:
            page = rpc.call("session.list", origin="http", limit=300, **({"after": after} if after else {}))
            assert len(page["sessions"]) <= 300
            listed += page["sessions"]
            if (after := page["next"]) is None:
                break
        ids = [s["session_id"] for s in listed]
        assert ids == sorted(ids) and len(ids) == len(set(ids)) == 2003 and {s["origin"] for s in listed} == {"http"}
        assert tied <= set(ids)
    assert d.stop() == 0 and d.log_problems() == []


def test_session_list_pages_and_filters(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()
    with d.client() as rpc:
        for i in range(7):
            rpc.call("session.create", session_id=f"p{i}", metadata={"origin": "http" if i % 2 else "agent"})
        rpc.call("session.sleep", session_id="p3")
        rpc.call("session.sleep", session_id="p4")
        first = rpc.call("session.list", limit=3)
        assert [s["session_id"] for s in first["sessions"]] == ["p0", "p1", "p2"] and first["next"] == "p2"
        rest = rpc.call("session.list", limit=10, after="p2")
        assert [s["session_id"] for s in rest["sessions"]] == ["p3", "p4", "p5", "p6"] and rest["next"] is None
        http = rpc.call("session.list", origin="http")["sessions"]
        assert [(s["session_id"], s["origin"]) for s in http] == [("p1", "http"), ("p3", "http"), ("p5", "http")]
        asleep = rpc.call("session.list", state="asleep", limit=1)
        assert [s["session_id"] for s in asleep["sessions"]] == ["p3"] and asleep["next"] == "p3"
        asleep = rpc.call("session.list", state="asleep", limit=1, after="p3")
        assert [(s["session_id"], s["state"]) for s in asleep["sessions"]] == [("p4", "asleep")]
        hot = rpc.call("session.list", state="hot", origin="agent")["sessions"]
        assert [s["session_id"] for s in hot] == ["p0", "p2", "p6"]
        assert len(rpc.call("session.list")["sessions"]) == 7  # no params: every session, as before
    with Client(d.socket) as client:  # the Python client and `kvwake sessions` page the same way
        page = client.session_page(limit=2, origin="http")
        assert [x["session_id"] for x in page["sessions"]] == ["p1", "p3"] and page["next"] == "p3"
    listed = CliRunner().invoke(main, ["--socket", str(d.socket), "sessions", "--origin", "http", "--state", "hot",
                                       "--json"])
    assert listed.exit_code == 0, listed.output
    assert [x["session_id"] for x in json.loads(listed.output)] == ["p1", "p5"]
    limited = CliRunner().invoke(main, ["--socket", str(d.socket), "sessions", "list", "--limit", "4", "--json"])
    assert [x["session_id"] for x in json.loads(limited.output)] == ["p0", "p1", "p2", "p3"]
    with d.client() as rpc:
        for bad in ({"limit": 0}, {"limit": 1001}, {"state": "warm"}, {"origin": 3}, {"after": 5}, {"page": 1}):
            with pytest.raises(RpcError) as err:
                rpc.call("session.list", **bad)
            assert err.value.code == "INVALID_PARAMS"
    assert d.stop() == 0 and d.log_problems() == []
