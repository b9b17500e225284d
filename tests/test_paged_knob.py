"""`--tune paged_kv=true` through the engine (tiny llama, CPU): the same tokens as plain caches, a shared prompt
held once by sessions that come one after another, and a wake into pages."""

from __future__ import annotations

import pytest

from kvwake.daemon.config import Tuning
from kvwake.daemon.kv.paged_cache import PagedKVCache
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session_state import Session
from kvwake.store import Store

BLOCK = 16
PROMPT = "a shared system prompt with the tools an agent may call, " * 6  # 18 blocks and a part


@pytest.fixture
def engines(model_dir, tmp_path):
    made = [(Engine(Store(tmp_path / n, block_tokens=BLOCK), tmp_path, model_dir, max_batch=8,
                    tuning=Tuning(paged_kv=n == "paged")), n) for n in ("plain", "paged")]
    yield made[0][0], made[1][0]
    for e, _ in made:
        e.close()
        e.store.close()


def turn(engine: Engine, name: str, text: str, n: int = 8) -> tuple[Session, list[int]]:
    s = Session(name)
    engine.append(s, text=text)
    return s, engine.generate(s, GenerateParams(max_tokens=n)).tokens


def test_sessions_over_one_prompt_share_its_pages_and_decode_as_plain_caches_do(engines):
    plain, paged = engines
    assert paged.pages is not None and plain.pages is None
    for i in range(4):
        text = PROMPT + f" user {i}: go"
        s, tokens = turn(paged, f"s{i}", text)
        assert tokens == turn(plain, f"s{i}", text)[1]
        assert all(isinstance(c, PagedKVCache) for c in s.cache)
        if i == 0:
            alone = paged.pages.pool.pages_held()
    # each later session took the prompt's 18 resident blocks, and holds its own last two pages
    assert paged.pages.pool.pages_held() <= alone + 3 * 2


def test_a_paged_session_sleeps_and_wakes_into_pages(engines):
    _, paged = engines
    s, _ = turn(paged, "s", PROMPT)
    before = [c.keys for c in s.cache]
    paged.sleep(s)
    woken, _ = paged.wake("s")
    assert all(isinstance(c, PagedKVCache) for c in woken.cache)
    assert all((a == c.keys).all().item() for a, c in zip(before, woken.cache))
