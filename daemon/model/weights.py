"""A model's weights read in pieces, so a load lets the other models' engine threads run.

`mlx_lm.load` evaluates every parameter in one `mx.eval`, and reading the weights holds the GIL for long
stretches of that call: while a second model loads, the first one's engine thread waits for the GIL at each
step (status.gil showed the loading thread inside that one eval at every long wait).
Evaluated a piece at a time, the GIL is let go between pieces, so a wait is at most one piece's read. The
pieces are whole tensors grouped up to PIECE_BYTES (a tensor larger than that is a piece of its own).
docs/decisions.md, "Several models (issue 53)", says what was measured.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten

from kvwake.daemon.timing import Phases

__all__ = ["PIECE_BYTES", "load", "pieces"]

PIECE_BYTES = 32 << 20  # a piece's bytes: a 1B model's largest tensor, so its pieces are mostly one tensor each


def load(path: str, most: int = PIECE_BYTES, phases: Phases | None = None,
         timeline: list[dict[str, float]] | None = None) -> tuple[Any, Any]:
    """mlx-lm's (model, tokenizer) of the model folder `path`, its weights evaluated piece by piece; `phases`
    gets "modules" (the model built lazily, its tokenizer read) marked before the weights are read, and
    `timeline` each piece: `at_ms` (from `phases`' start, else from this call), `ms`, `bytes` -- to line the
    pieces up against what other models' clients saw meanwhile (bench/models.py)."""
    clock = phases if phases is not None else Phases()
    model, tokenizer = mlx_lm.load(path, lazy=True)
    if phases is not None:
        phases.mark("modules")
    for piece in pieces([v for _, v in tree_flatten(model.parameters())], most):
        began = time.perf_counter()
        mx.eval(piece)
        if timeline is not None:
            timeline.append({"at_ms": clock.elapsed_ms(began), "ms": round((time.perf_counter() - began) * 1000, 2),
                             "bytes": sum(a.nbytes for a in piece)})
    return model, tokenizer


def pieces(arrays: list[mx.array], most: int = PIECE_BYTES) -> Iterator[list[mx.array]]:
    """`arrays` in order, grouped while a group's bytes stay within `most` (one larger array: a group alone)."""
    group: list[mx.array] = []
    size = 0
    for a in arrays:
        if group and size + a.nbytes > most:
            yield group
            group, size = [], 0
        group.append(a)
        size += a.nbytes
    if group:
        yield group
