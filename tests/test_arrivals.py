"""Turns on their way to the engine (sessions/conversations.py with model/scheduler/steps.py): a front's turn
arrives when it is prepared and lands when its first prefill job is queued or it fails; a turn's first job
waits, while nothing decodes, for the turns prepared with it, so they prefill as one pack (in process: real
engine, real engine thread)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvwake.daemon.config import Tuning
from kvwake.daemon.model.generation import GenerateParams
from kvwake.errors import BusyError
from tests.test_manager import SYSTEM, managed, model_dir  # noqa: F401 - fixtures


@pytest.fixture
def manager(model_dir, tmp_path):  # noqa: F811
    """Turns that pack (the GPU's default: model/packing.py `wanted`): what arrivals gather for."""
    yield from managed(model_dir, tmp_path, Tuning(pack_prefill=True))


def chat(i: int) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"agent {i} reports the tests it ran and what failed " * 3}]}


async def _generate(manager, session_id: str, prepared) -> dict:
    return await manager.generate(session_id, prepared.params, None, lambda: False, prepared)


async def test_turns_prepared_together_prefill_as_one_pack(manager):
    """Was: the first turn's prefill job was taken the moment it was queued (a pack of one), and the turn
    queued after it ran alone too."""
    scheduler, counters = manager.thread.scheduler, manager.engine.counters
    assert manager.engine.planner.pack_prefill and scheduler.gather_s > 0  # packs gather
    params, replies = GenerateParams(max_tokens=2), []
    for i in range(2):  # each session's first turn, one after the other: both keep their caches
        await manager.create(f"s{i}", SYSTEM)
        replies.append((await _generate(manager, f"s{i}", await manager.prepare(chat(i), params)))["text"])
    scheduler.gather_s = 5.0  # long enough that only the second turn's landing lets the first go
    nexts = [{"messages": chat(i)["messages"] + [{"role": "assistant", "content": replies[i]},
                                                 {"role": "user", "content": "now run them again " * 4}]}
             for i in range(2)]
    prepared = [await manager.prepare(nexts[i], params) for i in range(2)]
    assert scheduler.arriving() == 2
    before, holds = (counters["prefill_packs"], counters["prefill_packed_chunks"]), scheduler.holds.summary()["count"]
    started = time.monotonic()
    first = asyncio.ensure_future(_generate(manager, "s0", prepared[0]))
    await asyncio.sleep(0.2)  # its first job is queued and held: the other turn is still on its way
    assert not first.done() and scheduler.arriving() == 1
    second = asyncio.ensure_future(_generate(manager, "s1", prepared[1]))
    assert all(r["tokens"] for r in await asyncio.gather(first, second))
    assert time.monotonic() - started < 5.0  # let go by the landing, not by the gathering time
    assert (counters["prefill_packs"] - before[0], counters["prefill_packed_chunks"] - before[1]) == (1, 2)
    assert scheduler.arriving() == 0 and scheduler.holds.summary()["count"] == holds + 1


async def test_a_turn_waiting_for_anothers_shared_prefill_does_not_hold_it(manager):
    """Two new conversations with one system prompt: the second waits for the first's prefill of it (a
    flight) and is set aside meanwhile. Was: counted as arriving, it held the first's prefill, the one it
    waited for, for the whole gathering time."""
    scheduler, params = manager.thread.scheduler, GenerateParams(max_tokens=2)
    scheduler.gather_s = 5.0
    waits = manager.counters["prefix_waits"]
    for i in range(2):
        await manager.create(f"s{i}", SYSTEM)
    prepared = [await manager.prepare(chat(i), params) for i in range(2)]
    started = time.monotonic()
    results = await asyncio.gather(*(_generate(manager, f"s{i}", prepared[i]) for i in range(2)))
    assert all(r["tokens"] for r in results) and manager.counters["prefix_waits"] == waits + 1
    assert time.monotonic() - started < 5.0
    assert scheduler.arriving() == 0


async def test_a_turn_that_fails_is_no_longer_arriving(manager, monkeypatch):
    scheduler, params = manager.thread.scheduler, GenerateParams(max_tokens=2)
    real = manager.engine.render
    monkeypatch.setattr(manager.engine, "render", lambda **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        await manager.prepare(chat(0), params)  # its render failed
    assert scheduler.arriving() == 0
    monkeypatch.setattr(manager.engine, "render", real)
    await manager.create("s", SYSTEM)
    prepared = await manager.prepare(chat(0), params)
    async with manager.claim("s", "append"):  # the session is busy: the generate fails before any job
        with pytest.raises(BusyError):
            await manager.generate("s", params, None, lambda: False, prepared)
    assert scheduler.arriving() == 0
    dropped = await manager.prepare(chat(1), params)
    dropped.land()  # a front that starts no generation for it (sessions/matching.py failed)
    assert scheduler.arriving() == 0
