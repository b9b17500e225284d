"""Sliding-window layers' rows stored by token in blocks (kv/window_rows.py): a ring rebuilt from the rows its
blocks captured as a prefill passed them is, array for array, the ring a restore point keeps of a cold
prefill (points.compact_rings); a point over such blocks is a marker, and a hit through it continues as a
plain prefill does, bit for bit on the CPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from kvwake.daemon.kv import cache_blocks, window_rows
from kvwake.daemon.kv.points import compact_rings
from testkit.tinymodel import make_model_dir

B = 16


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
