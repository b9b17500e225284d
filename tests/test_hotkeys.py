"""The hot sessions' chain-key index (sessions/hotkeys.py): the longest shared prefix among many hot
sessions without comparing each, kept right as sessions are claimed, change, sleep and go; and their KV
bytes (Entries.kv_bytes), measured once per claim."""

from __future__ import annotations

import random

from kvwake.daemon.session_state import Session, common_prefix
from kvwake.daemon.sessions.entries import Entries, Entry
from kvwake.daemon.sessions.hotkeys import BLOCK, shared_from

SYSTEM = [random.Random(1).randrange(300, 900) for _ in range(9 * BLOCK + 17)]


def hot(entries: Entries, sid: str, tokens: list[int]) -> Entry:
    entries[sid] = Entry(sid, session=Session(sid, tokens=list(tokens), processed=len(tokens)))
    return entries[sid]


def best(entries: Entries, target: list[int], stop: bool = True) -> tuple[int, set[str], int]:
    """(the longest shared prefix, the sessions sharing it, how many sessions were compared)."""
    top, who, compared = 0, set(), 0
    for known, level in entries.keys.levels(target):
        for e in level:
            compared += 1
            n = shared_from(e.session.tokens, target, known)
            top, who = (n, {e.id}) if n > top else (top, who | {e.id} if n == top else who)
        if stop:
            break  # the first level holds the best (no lineage to skip)
    return top, who, compared


def brute(entries: Entries, target: list[int]) -> tuple[int, set[str]]:
    shared = {sid: common_prefix(e.session.tokens, target) for sid, e in entries.hot.items() if not e.busy}
    top = max(shared.values(), default=0)
    return top, {sid for sid, n in shared.items() if n == top}


def test_one_of_hundreds_over_a_shared_prompt_is_found_comparing_few():
    entries, rng = Entries(), random.Random(2)
    convs = {f"c{i}": SYSTEM + [rng.randrange(40, 120) for _ in range(rng.randrange(20, 3 * BLOCK))]
             for i in range(300)}
    for sid, tokens in convs.items():
        hot(entries, sid, tokens)
    target = convs["c7"] + [5, 6, 7]  # conversation 7's next turn
    top, who, compared = best(entries, target)
    assert (top, who) == (len(convs["c7"]), {"c7"}) == (brute(entries, target)[0], brute(entries, target)[1])
    assert compared < 10  # not the 300: only those holding the deepest key conversation 7 holds
    # A new conversation over the shared prompt: every one shares it, and they are all compared past it only.
    fresh = SYSTEM + [1, 2, 3]
    assert best(entries, fresh)[:2] == brute(entries, fresh)


def test_a_claimed_session_is_left_out_and_its_new_tokens_count_once_released():
    entries = Entries()
    a, b = hot(entries, "a", SYSTEM + [1] * 200), hot(entries, "b", SYSTEM + [2] * 50)
    target = SYSTEM + [2] * 300
    assert best(entries, target)[:2] == (len(SYSTEM) + 50, {"b"})
    b.busy = "append"  # claimed: not a candidate, and its tokens may change
    assert "b" not in best(entries, target, stop=False)[1]
    b.session.tokens = SYSTEM + [2] * 290
    assert best(entries, target)[:2] == (len(SYSTEM), {"a"})
    b.busy = None
    assert best(entries, target)[:2] == (len(SYSTEM) + 290, {"b"})
    a.session = None  # asleep: gone from the index
    assert "a" not in best(entries, SYSTEM + [1] * 200, stop=False)[1]
    a.session = Session("a", tokens=SYSTEM + [1] * 200)  # woken: back
    assert best(entries, SYSTEM + [1] * 200)[:2] == (len(SYSTEM) + 200, {"a"})
    del entries["a"]
    entries.pop("b")
    assert list(entries.keys.levels(target)) == [] and len(entries.keys) == 0


def test_the_levels_agree_with_comparing_every_session():
    rng = random.Random(3)
    for _ in range(30):
        entries, pool = Entries(), []
        for i in range(rng.randrange(1, 40)):  # prompts that branch off each other at random points
            base = rng.choice(pool) if pool and rng.random() < 0.7 else SYSTEM
            tokens = base[: rng.randrange(0, len(base) + 1)] + [rng.randrange(0, 50) for _ in range(rng.randrange(0, 300))]
            pool.append(tokens)
            hot(entries, f"s{i}", tokens)
            if rng.random() < 0.2:
                entries[f"s{i}"].busy = "chat"
        target = rng.choice(pool)[: rng.randrange(0, 2000)] + [rng.randrange(0, 50) for _ in range(rng.randrange(0, 99))]
        assert best(entries, target)[:2] == brute(entries, target), target[:5]
        # Walking every level compares each idle session exactly once.
        assert best(entries, target, stop=False)[2] == sum(1 for e in entries.hot.values() if not e.busy)


def test_hot_bytes_are_measured_once_per_claim_and_follow_every_change():
    entries, sizes, measured = Entries(), {}, []

    def measure(session: Session) -> int:
        measured.append(session.id)
        return sizes[session.id]

    for i in range(50):
        sizes[f"s{i}"] = 100 + i
        hot(entries, f"s{i}", [1, 2, 3])
    assert entries.kv_bytes.total(measure) == sum(sizes.values()) and len(measured) == 50
    measured.clear()
    assert entries.kv_bytes.total(measure) == sum(sizes.values()) and measured == []  # idle: not measured again
    e = entries["s3"]
    e.busy = "chat"
    sizes["s3"] = 10_000  # grows while claimed: counted at every sum meanwhile
    assert entries.kv_bytes.total(measure) == sum(sizes.values()) and measured == ["s3"]
    sizes["s3"] = 20_000
    e.busy = None
    assert entries.kv_bytes.total(measure) == sum(sizes.values())
    e.session = None  # asleep
    del sizes["s3"]
    entries.pop("s4")
    del sizes["s4"]
    assert entries.kv_bytes.total(measure) == sum(sizes.values())
    entries["s3"] = Entry("s3", session=Session("s3"))  # woken into a new entry
    sizes["s3"] = 7
    assert entries.kv_bytes.total(measure) == sum(sizes.values())
