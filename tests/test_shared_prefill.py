"""A shared prompt prefilled once: appends that start while another prefills the same prompt wait for it and
take a copy of its cache (sessions/shared_prefill.py), in-process (real engine thread) and in a real daemon."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from kvwake.client.aio import AsyncClient
from kvwake.errors import CancelledError
from testkit.daemon import Daemon
from tests.test_manager import manager, model_dir  # noqa: F401 - the in-process manager, no persistence

SHARED = [(i * 37 + 11) % 200 + 20 for i in range(300)]  # a system prompt of 300 tokens
OWN = {f"agent{i}": [5 + i, 6, 7 + i, 8] for i in range(4)}


def hold_the_leader(manager, monkeypatch, leader: str) -> threading.Event:
    """The leader's apply waits for the returned event (the others are sure to start while it prefills)."""
    go, real = threading.Event(), manager.engine.apply

    def apply(session, *args, **kwargs):
        if session.id == leader:
            assert go.wait(30)
        return real(session, *args, **kwargs)

    monkeypatch.setattr(manager.engine, "apply", apply)
    return go


async def start_together(manager, monkeypatch, leader_cancelled=None) -> dict[str, dict]:
    """agent0 leads; agent1-3 start while it prefills; returns each append's counts."""
    go, results = hold_the_leader(manager, monkeypatch, "agent0"), {}
    for sid in OWN:
        await manager.create(sid)

    async def append(sid: str, cancelled=None) -> None:
        results[sid] = await manager.append(sid, cancelled, tokens=SHARED + OWN[sid])

    await lead_then_wait(manager, go, lambda: append("agent0", leader_cancelled),
                         [lambda sid=sid: append(sid) for sid in list(OWN)[1:]])
    return results


async def lead_then_wait(manager, go: threading.Event, lead, others: list) -> None:
    """lead() starts and registers a flight; the others start and all wait on it; then the leader goes on
    (`go`); returns once every call ended."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(lead)
        while len(manager.shared) == 0:
            await anyio.sleep(0.005)
        for other in others:
            tg.start_soon(other)
        while sum(len(f.waiters) for f in manager.shared._flights) < len(others):
            await anyio.sleep(0.005)
        go.set()


async def test_appends_starting_together_prefill_the_shared_prompt_once(manager, monkeypatch):
    got = await start_together(manager, monkeypatch)
    assert got["agent0"]["reused"] == 0 and got["agent0"]["prefilled"] == len(SHARED) + 3
    for sid in ("agent1", "agent2", "agent3"):  # the shared prompt taken, their own part prefilled
        assert (got[sid]["reused"], got[sid]["prefilled"]) == (len(SHARED), 3), (sid, got[sid])
    assert manager.counters["prefix_waits"] == 3 and len(manager.shared) == 0
    # Exact: a waiter's cache generates what the same tokens prefilled alone do.
    from kvwake.daemon.model.generation import GenerateParams
    params = GenerateParams(max_tokens=8)
    taken = (await manager.generate("agent2", params, None, lambda: False))["tokens"]
    monkeypatch.undo()
    for sid in OWN:  # none hot to copy from: "cold" prefills the same tokens from scratch
        await manager.delete(sid)
    await manager.released()  # their KV freed (in the background): over pages "cold" would map what is still held
    await manager.create("cold")
    assert (await manager.append("cold", tokens=SHARED + OWN["agent2"]))["reused"] == 0
    assert (await manager.generate("cold", params, None, lambda: False))["tokens"] == taken


async def test_a_leader_whose_client_left_still_prefills_for_those_waiting(manager, monkeypatch):
    got = await start_together(manager, monkeypatch, leader_cancelled=lambda: True)
    for sid in ("agent1", "agent2", "agent3"):
        assert got[sid]["reused"] == len(SHARED), (sid, got[sid])
    assert got["agent0"]["prefilled"] == len(SHARED) + 3


async def test_a_leader_whose_client_left_with_no_one_waiting_stops(manager):
    await manager.create("alone")
    with pytest.raises(CancelledError):
        await manager.append("alone", lambda: True, tokens=SHARED + [5])
    assert len(manager.shared) == 0


async def test_a_failed_leader_hands_out_nothing_and_the_waiters_prefill_themselves(manager, monkeypatch):
    go, real = hold_the_leader(manager, monkeypatch, "agent0"), manager.engine.apply

    def failing(session, *args, **kwargs):
        if session.id == "agent0":
            assert go.wait(30)
            raise RuntimeError("the leader's prefill failed")
        return real(session, *args, **kwargs)

    monkeypatch.setattr(manager.engine, "apply", failing)
    for sid in ("agent0", "agent1"):
        await manager.create(sid)
    results: dict[str, object] = {}

    async def append(sid: str) -> None:
        try:
            results[sid] = await manager.append(sid, tokens=SHARED + OWN[sid])
        except RuntimeError as exc:
            results[sid] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(append, "agent0")
        while len(manager.shared) == 0:
            await anyio.sleep(0.005)
        tg.start_soon(append, "agent1")
        while not any(f.waiters for f in manager.shared._flights):
            await anyio.sleep(0.005)
        go.set()
    assert isinstance(results["agent0"], RuntimeError)
    assert results["agent1"]["reused"] == 0 and results["agent1"]["prefilled"] == len(SHARED) + 3
    assert len(manager.shared) == 0


def test_a_real_daemon_prefills_a_prompt_shared_by_agents_starting_together_once(tmp_path, model_dir):
    shared = [(i * 37 + 11) % 200 + 20 for i in range(3000)]  # long enough that the others start meanwhile
    daemon = Daemon(tmp_path, model_dir, block_tokens=16, extra=["--no-persist"]).start()
    results: dict[str, dict] = {}

    async def agent(sid: str) -> None:
        async with AsyncClient(daemon.socket) as c:
            await c.create_session(sid)
            results[sid] = await c.append(sid, tokens=shared + OWN[sid])

    async def fleet() -> None:
        async with anyio.create_task_group() as tg:
            for sid in OWN:
                tg.start_soon(agent, sid)

    try:
        anyio.run(fleet)
        with daemon.client() as c:
            waits = c.call("status")["counters"]["prefix_waits"]
    finally:
        daemon.stop()
    computed = sum(r["prefilled"] for r in results.values())
    # Each agent either waited for the shared prompt or copied it from an idle one: prefilled once in all.
    assert waits >= 1 and computed == len(shared) + 4 * 3, (waits, results)


async def test_a_new_session_is_made_while_the_engine_thread_is_busy(manager):
    # Was: a new session's first (empty) snapshot queued an engine job, so every new conversation's match
    # waited for the job running then (a fleet's first round behind a warm-up job: docs/benchmarks.md, "fleet").
    busy, release = threading.Event(), threading.Event()
    job = manager.thread.submit(lambda: busy.set() or release.wait(8))
    assert busy.wait(10)
    started = time.perf_counter()
    try:
        await manager.create("new-while-busy")
        took = time.perf_counter() - started
    finally:
        release.set()
        job.result(30)
    assert took < 4, f"the create waited {took:.1f} s for the engine thread's job"
    assert manager.entry("new-while-busy").session is not None
