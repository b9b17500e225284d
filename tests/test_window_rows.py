"""Sliding-window layers' rows stored by token in blocks (kv/window_rows.py): a ring rebuilt from the rows its
blocks captured as a prefill passed them is, array for array, the ring a restore point keeps of a cold
prefill (points.compact_rings); a point over such blocks is a marker, and a hit through it continues as a
plain prefill does, bit for bit on the CPU."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache
from mlx_lm.utils import load

from kvwake.daemon.config import Tuning
from kvwake.daemon.kv import cache_blocks, points, window_rows, window_stage
from kvwake.daemon.kv.points import compact_rings
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session_state import Session, common_prefix
from kvwake.store import Store
from testkit.tinymodel import TOOLS_CHATML, make_model_dir
from tests.capabilities import chunked_prefill_is_exact
from tests.test_restore_points import ARCH_WINDOW, GREEDY, assert_as_cold, chat, logits_after

B = 16
OTHER = "Pick one tool and say why."


def assert_as_plain(engine: Engine, plain: Engine, session: Session) -> None:
    """The session continues bit for bit as a plain prefill (no points) of its tokens does (the CPU: chunked
    prefill is exact there for these models, docs/decisions.md, "Restore points (issue 52)"): the same
    greedy reply, and a copy of it (the same tokens, restored through the same points) the same next
    logits. Where no chunked prefill is exact (CUDA), within the bound every hit through a point is held to
    (test_restore_points.assert_as_cold)."""
    if not chunked_prefill_is_exact(plain):
        assert_as_cold(engine, plain, session, getattr(engine.model, "model_type", ""))
        return
    twin, copy, copy_twin = Session("plain-" + session.id), Session("copy"), Session("plain-copy")
    assert plain.append(twin, tokens=list(session.tokens))["reused"] == 0
    assert engine.generate(session, GREEDY).tokens == plain.generate(twin, GREEDY).tokens
    assert engine.append(copy, tokens=list(twin.tokens))["reused"] > 0
    plain.append(copy_twin, tokens=list(twin.tokens))
    assert mx.array_equal(logits_after(engine, copy), logits_after(plain, copy_twin)).item()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """gemma(window): the tiny gemma3_text with that sliding window, loaded once per window."""
    made: dict[int, tuple] = {}

    def model(window: int):
        if window not in made:
            path = make_model_dir(tmp_path_factory.mktemp("gemma") / f"w{window}", arch="gemma3_text",
                                  sliding_window=window)
            made[window] = load(str(path))[0]
        return made[window]

    return model


def prefill_capturing(model, tokens: list[int], chunks: list[int]) -> tuple[list, dict[int, dict]]:
    """A cold prefill of `tokens` in chunks of these sizes, each block's window rows captured after the chunk
    that passed it (first capture kept: a later chunk must not be needed)."""
    cache = model.make_cache()
    rows: dict[int, dict] = {}
    at = 0
    for n in chunks:
        model(mx.array(tokens[at : at + n])[None], cache=cache)
        at += n
        window, blocks = window_rows.held_blocks(cache, B)
        fresh = [k for k in blocks if k not in rows]
        if fresh:
            rows.update(window_rows.defer_rows(window, fresh, B).host())
    assert at == len(tokens)
    return cache, rows


@pytest.mark.parametrize("window,chunks", [(8, [16, 16, 24, 40]), (8, [48, 17, 31]), (40, [64, 16, 16]),
                                           (40, [30, 34, 32]), (40, [128])])
def test_a_ring_rebuilt_from_the_rows_its_blocks_captured_is_the_ring_a_point_keeps(gemma, window, chunks):
    model = gemma(window)
    tokens = [int(t) for t in np.random.default_rng(window + len(chunks)).integers(3, 250, sum(chunks))]
    cache, rows = prefill_capturing(model, tokens, chunks)
    position = len(tokens)
    point = compact_rings(cache_blocks.capture_tail(cache, position, B))
    spans = window_rows.spans(cache, position, B)
    assert spans is not None and all(s.rows == min(position, window) for s in spans)
    rebuilt = window_rows.assemble(window_rows.marker(point, spans), B, rows.__getitem__)
    assert rebuilt.keys() == point.keys()
    for name, t in point.items():
        assert rebuilt[name].dtype == t.dtype and np.array_equal(rebuilt[name].array, t.array), name


# -- an engine whose points over sliding windows are markers -------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """model_dir(arch, window=None): an ASCII-reply model folder (the test kit's window when None)."""
    made: dict[tuple, object] = {}

    def model_dir(arch: str, window: int | None = None):
        if (arch, window) not in made:
            extra = {} if window is None else {"sliding_window": window}
            made[arch, window] = make_model_dir(tmp_path_factory.mktemp("m") / f"{arch}-{window}", arch=arch,
                                                ascii_replies=True, template=TOOLS_CHATML, **extra)
        return made[arch, window]

    return model_dir


@pytest.fixture
def engines(model_dirs, tmp_path):
    """engines(arch, window=None, window_blocks=True, store="store", points=True, restore_mode=None, codec=None):
    an Engine (block 16)."""
    opened = []

    def open_(arch: str, window: int | None = None, window_blocks: bool = True, store: str = "store",
              points: bool = True, restore_mode: str | None = None, codec: str | None = None) -> Engine:
        s = Store(tmp_path / store, block_tokens=B, **({"codec": codec} if codec else {}))
        tuning = Tuning(window_blocks=window_blocks, restore_points=points, restore_mode=restore_mode)
        opened.append((Engine(s, tmp_path, model_dirs(arch, window), tuning=tuning), s))
        return opened[-1][0]

    yield open_
    for engine, s in opened:
        engine.close()
        s.close()


def stored_points(engine: Engine) -> list[dict]:
    return [engine.store.read_point(engine.store.point_refs([row["key"]], engine.bundle.hash)[row["key"]])
            for row in engine.store.rows("SELECT key FROM points")]


def block_names(engine: Engine, tokens: list[int]) -> list[set[str]]:
    """The tensor names of each stored block of `tokens`, in order."""
    refs = engine.store.longest_prefix(engine.bundle.hash, tokens)
    return [set(engine.store.block_specs(ref)) for ref in refs]


@pytest.mark.parametrize("arch,window", [("gemma3_text", None), ("gemma3_text", 40), ("gemma3_text", 32), ("lfm2", None)])
def test_a_hit_through_a_marker_point_continues_as_a_plain_prefill(engines, arch, window):
    engine = engines(arch, window)
    first = Session("first")
    got = engine.append(first, messages=chat("a"))
    taken = points.stops(first.tokens, 0, got["tokens"] - 1, B, engine.points.marks)
    stored = stored_points(engine)
    assert len(stored) == len(taken) >= 2
    rings = sorted(engine.points.window_names)
    marked = [any(n.endswith(window_rows.MARK) for n in p) for p in stored]
    if arch == "gemma3_text" and window:  # every point a marker: its last window's blocks hold its rings' rows
        assert rings and all(marked) and all(not set(rings) & set(p) for p in stored)
        assert engine.points.counters["points_marked"] == len(taken)
        names = block_names(engine, first.tokens)
        for at in taken:
            for k in range((at - min(at, window)) // B, at // B):
                assert set(rings) <= names[k], (at, k)
    elif arch == "gemma3_text":  # a window shorter than a block: a point's ring is smaller than a block's rows
        assert ARCH_WINDOW < B and not any(marked) and all("layers.0.keys" in p for p in stored)
        assert engine.points.counters["points_marked"] == 0
    else:  # no ring: the points hold the recurrent state as before
        assert not rings and not any(marked)
    second = Session("second")
    shared = common_prefix(first.tokens, engine.plan(second, messages=chat(OTHER)).target)
    got = engine.append(second, messages=chat(OTHER))
    deepest = max(w for w in taken if w <= shared)
    assert got["reused"] == deepest >= shared * 0.8
    assert_as_plain(engine, engines(arch, window, window_blocks=False, store="plain", points=False), second)


@pytest.mark.parametrize("codec", ["planes-zstd", "raw"])
def test_a_hit_through_a_marker_point_restores_staged_as_a_gpu_does(engines, monkeypatch, codec):
    # Staged (a GPU's way, run on the CPU): a block carrying window rows stages its plain part through the
    # ring as other blocks do, and the window rows the marker wants are staged as their runs hold them and
    # joined on the device (kv/window_stage.py; was: joined on the host into one array a name, then
    # uploaded as a point's rings). The hit is exact all the same.
    engine = engines("gemma3_text", 32, restore_mode="staged", codec=codec)
    first, second = Session("first"), Session("second")
    engine.append(first, messages=chat("a"))
    assert engine.points.counters["points_marked"] >= 2
    staged, rings = [], []
    stage_run, joined = window_stage.StagedRows.stage_run, window_stage.StagedRows.rings
    monkeypatch.setattr(window_stage.StagedRows, "stage_run", lambda held, start, run: staged.append(
        (start, held.first * B <= start < (held.first + held.count) * B)) or stage_run(held, start, run))
    monkeypatch.setattr(window_stage.StagedRows, "rings", lambda held, point: rings.append(
        out := joined(held, point)) or out)
    got = engine.append(second, messages=chat(OTHER))
    assert got["reused"] >= common_prefix(first.tokens, second.tokens) // B * B - B > 0
    window = set(range((got["reused"] - 32) // B * B, got["reused"], B))
    assert {start for start, wanted in staged if wanted} == window
    assert len(rings) == 1 and all(isinstance(rings[0][n], mx.array) for n in engine.points.window_names)
    assert_as_plain(engine, engines("gemma3_text", 32, window_blocks=False, store="plain", points=False), second)


def test_points_with_their_rings_in_an_older_store_are_still_served(engines):
    old = engines("gemma3_text", 40, window_blocks=False)
    old.append(Session("first"), messages=chat("a"))
    assert all("layers.0.keys" in p for p in stored_points(old))
    old.close()
    engine = engines("gemma3_text", 40)
    second = Session("second")
    got = engine.append(second, messages=chat(OTHER))
    assert got["reused"] > 0 and engine.counters["tokens_from_points"] == got["reused"]
    # its own points over blocks stored without rows keep their rings whole; the others are markers
    for p in stored_points(engine):
        assert ("layers.0.keys" in p) != (f"layers.0.{window_rows.MARK}" in p)
    assert_as_plain(engine, engines("gemma3_text", 40, window_blocks=False, store="plain", points=False), second)


def test_a_marker_whose_blocks_lack_the_rows_gives_way_and_the_prompt_is_prefilled(engines, monkeypatch, caplog):
    engine = engines("gemma3_text", 40)
    real = window_rows.defer_rows  # the points stay markers, their blocks written without the rows
    monkeypatch.setattr(window_rows, "defer_rows", lambda window, blocks, b: real(window, [], b))
    first, second = Session("first"), Session("second")
    engine.append(first, messages=chat("a"))
    shared = common_prefix(first.tokens, engine.plan(second, messages=chat(OTHER)).target)
    # a later point over the same blocks finds them stored without rows: it keeps its rings whole
    depth = {int(p["layers.0.ring"].array[0]): f"layers.0.{window_rows.MARK}" in p for p in stored_points(engine)}
    assert depth[min(depth)] and min(depth) <= shared
    got = engine.append(second, messages=chat(OTHER))
    assert got["reused"] == max([0, *(at for at, marker in depth.items() if at <= shared and not marker)])
    assert "holds no rows of layers.0" in caplog.text
    monkeypatch.undo()
    assert_as_plain(engine, engines("gemma3_text", 40, window_blocks=False, store="plain", points=False), second)


@pytest.mark.parametrize("mode", [None, "staged"])
def test_a_session_whose_blocks_carry_window_rows_sleeps_and_wakes_exactly(engines, mode, monkeypatch):
    # staged: the blocks' plain parts go through the ring; their window rows, which a wake does not read, are
    # decompressed and verified, not joined
    engine = engines("gemma3_text", 40, restore_mode=mode)
    finish, runs = window_rows.WindowRun.finish, []
    monkeypatch.setattr(window_rows.WindowRun, "finish", lambda run, held, start: runs.append(
        out := finish(run, held, start)) or out)
    s = Session("named")
    engine.append(s, messages=chat("List three tools."))
    assert any(engine.points.window_names <= names for names in block_names(engine, s.tokens))
    held = [np.array(a.view(mx.uint16)) for c in s.cache for a in c.state if isinstance(a, mx.array)]
    engine.sleep(s)
    woken, _ = engine.wake("named")
    # the engine's mode, not the parameter: None is the backend's default, staged on CUDA
    assert (len(runs) > 0 and not any(runs)) if engine.restore_mode == "staged" else not runs
    again = [np.array(a.view(mx.uint16)) for c in woken.cache for a in c.state if isinstance(a, mx.array)]
    assert len(held) == len(again) and all(np.array_equal(a, b) for a, b in zip(held, again))
    plain = engines("gemma3_text", 40, window_blocks=False, store="plain", points=False)
    twin = Session("twin")
    plain.append(twin, tokens=list(woken.tokens))
    assert engine.generate(woken, GREEDY).tokens == plain.generate(twin, GREEDY).tokens


@pytest.mark.parametrize("mode", [None, "staged"])
def test_a_marker_joins_its_rings_when_the_ram_tier_gives_its_blocks(engines, mode):
    # A block the RAM tier holds is a restore's copy of the plain layers' KV, without window rows (agents
    # starting together share blocks that way): the rows are read from the block's file. Was: its empty rows
    # were taken for the block's, every point refused and the whole prompt prefilled. Staged, such a block
    # was not staged with its rows: the host path joins them.
    engine = engines("gemma3_text", 40, restore_mode=mode)
    first, second = Session("first"), Session("second")
    engine.append(first, messages=chat("a"))
    for ref in engine.store.longest_prefix(engine.bundle.hash, first.tokens):
        arrays = engine.store.read_block(ref)
        engine.kv.ram_tier.put(ref.key, {n: t for n, t in arrays.items() if n not in engine.points.window_names})
    shared = common_prefix(first.tokens, engine.plan(second, messages=chat(OTHER)).target)
    got = engine.append(second, messages=chat(OTHER))
    assert got["reused"] == shared // B * B and engine.counters["blocks_ram"] > 0
    assert_as_plain(engine, engines("gemma3_text", 40, window_blocks=False, store="plain", points=False), second)


def append_stored_meanwhile(engine: Engine, monkeypatch) -> tuple[Session, list[dict]]:
    """A second conversation over the stored system prompt, its takes finding no block stored (another
    writer stores them between each take and its write): the session, and the points it stored."""
    theirs = {int(p["layers.0.ring"].array[0]) for p in stored_points(engine)}
    usable = engine.store.usable_blocks

    def not_yet(keys, tokens):  # at the take the blocks are not stored yet; at the write they are
        return {} if sys._getframe(1).f_code.co_name == "_plan" else usable(keys, tokens)

    monkeypatch.setattr(engine.store, "usable_blocks", not_yet)
    second = Session("second")
    engine.append(second, messages=chat(OTHER))
    monkeypatch.undo()
    return second, [p for p in stored_points(engine) if int(p["layers.0.ring"].array[0]) not in theirs]


def test_a_marker_whose_window_blocks_another_writer_stored_without_rows_is_stored_whole(engines, monkeypatch):
    # Between a take and its write another writer (a point without markers, a sleep) may store window blocks
    # the take copied with rows: ours are not written. Was: the point stayed a marker over blocks without
    # rows, and every hit through it gave way.
    old = engines("gemma3_text", 40, window_blocks=False)
    old.append(Session("first"), messages=chat("a"))  # the system prompt's blocks, without rows
    old.close()
    engine = engines("gemma3_text", 40)
    second, ours = append_stored_meanwhile(engine, monkeypatch)
    assert ours and all("layers.0.keys" in p and f"layers.0.{window_rows.MARK}" not in p for p in ours)
    assert engine.points.counters["points_joined"] == len(ours) and engine.points.counters["point_failures"] == 0
    again = Session("again")
    got = engine.append(again, tokens=list(second.tokens))
    assert got["reused"] == (len(second.tokens) - 1) // B * B
    assert_as_plain(engine, engines("gemma3_text", 40, window_blocks=False, store="plain", points=False), again)


def test_a_marker_whose_window_blocks_an_earlier_marker_stored_meanwhile_stays_a_marker(engines, monkeypatch):
    # Points taken before the previous ones are written (a prefill's successive points, agents starting
    # together) copy window blocks that the earlier writes store with rows first. Was: the stored blocks were
    # looked up with the tokens of the prefix's first blocks, not found, and the point was stored whole.
    engine = engines("gemma3_text", 40)
    engine.append(Session("first"), messages=chat("a"))
    second, ours = append_stored_meanwhile(engine, monkeypatch)
    assert ours and all(f"layers.0.{window_rows.MARK}" in p and "layers.0.keys" not in p for p in ours)
    assert engine.points.counters["points_joined"] == 0 and engine.points.counters["point_failures"] == 0
    again = Session("again")
    got = engine.append(again, tokens=list(second.tokens))
    assert got["reused"] == (len(second.tokens) - 1) // B * B
    assert_as_plain(engine, engines("gemma3_text", 40, window_blocks=False, store="plain", points=False), again)


def test_span_rows_reads_a_ring_in_token_order_however_it_is_rotated():
    ring = RotatingKVCache(max_size=40)
    rng = np.random.default_rng(5)
    kv = mx.array(rng.standard_normal((1, 2, 400, 4)).astype(np.float32))
    ring.update_and_fetch(kv[:, :, :23], kv[:, :, :23])  # a prefill chunk, then single tokens
    seen = set()
    for t in range(23, 200):
        for first in range(0, t // B):
            rows = window_rows.span_rows([ring], first, 1, B)
            held = first * B >= t - (40 if t > 40 else t) and (first + 1) * B <= t
            assert bool(rows) == held, (t, first)
            if rows:
                seen.add(ring._idx)
                assert np.array_equal(np.array(rows["layers.0.keys"]), np.array(kv[:, :, first * B : (first + 1) * B]))
        assert window_rows.first_held([ring], B) == -(-max(0, t - 40) // B)
        ring.update_and_fetch(kv[:, :, t : t + 1], kv[:, :, t : t + 1])
    assert len(seen) > 20  # read at many rotations, wrapping round the ring's end too


@pytest.mark.parametrize("mode", [None, "staged"])
def test_a_sleep_stores_the_window_rows_its_ring_holds_so_a_later_point_over_them_is_a_marker(engines, mode):
    # A sleep writes the blocks a reply filled, its ring rotated by decoding. Was: without rows, so a later
    # point whose window reached into them was stored whole (a ring's bytes, not a marker's). Staged: the
    # rows are split into byte planes on the device with the blocks (pipeline.defer_blocks).
    engine = engines("gemma3_text", 40, restore_mode=mode)
    engine.reply_points.enabled = False  # the reply's blocks are written by the sleep alone
    s = Session("named")
    engine.append(s, messages=chat("a"))
    stored = len(engine.store.longest_prefix(engine.bundle.hash, s.tokens))
    engine.generate(s, GenerateParams(max_tokens=40))
    rings = {name: (c.offset - 40, np.array(c._temporal_order(c.keys).view(mx.uint16)))
             for name, _, _, c in cache_blocks.units(s.cache) if cache_blocks.kind_of(c, name) == "rotating"}
    assert rings and all(c._idx < c.keys.shape[2] for c in s.cache if hasattr(c, "_idx"))  # rotated
    engine.sleep(s)
    refs = engine.store.longest_prefix(engine.bundle.hash, s.tokens)
    held = [k for k in range(stored, len(refs)) if k * B >= s.processed - 40]
    assert held and len(refs) > stored
    for k in range(stored, len(refs)):
        arrays = engine.store.read_block(refs[k])
        assert (k in held) == (engine.points.window_names <= set(arrays)), k
        for name, (first, keys) in rings.items() if k in held else ():
            want = keys[:, :, k * B - first : (k + 1) * B - first]
            assert np.array_equal(arrays[f"{name}.keys"].array, want), (k, name)
    later = Session("later")
    got = engine.append(later, tokens=[*s.tokens, *s.pending, *range(60, 90)])
    at = (len(later.tokens) - 1) // B * B
    assert (at - 40) // B * B < len(refs) * B  # the last point's window reaches into the sleep's blocks
    point = next(p for p in stored_points(engine) if int(p["layers.0.ring"].array[0]) == at)
    assert f"layers.0.{window_rows.MARK}" in point and engine.points.counters["points_joined"] == 0
    again = Session("again")
    assert engine.append(again, tokens=list(later.tokens))["reused"] == at > got["reused"]
    assert_as_plain(engine, engines("gemma3_text", 40, window_blocks=False, store="plain", points=False), again)
