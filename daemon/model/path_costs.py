"""The attention paths' measured costs kept per machine (`--tune paths_ahead`): a file beside MLX's kernel cache.

model/attention.py `PathCosts` measures which path a short prefill chunk's attention should take (plain ops or
the fused kernel) at a ladder of key lengths; model/kernel_cache.py's warmer part "paths" measures them beside a
load where this file lacks them. Both read and write it here, a module of its own so that neither imports the
other for it (docs/decisions.md, "The attention paths' costs measured before serving").
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["COSTS_FILE", "COSTS_FORMAT", "KEY_LADDER", "PROBE_QUERIES", "PROBE_REPEATS", "attention_shape",
           "costs_file", "costs_key", "key_ladder", "store_cost", "stored_costs"]

log = logging.getLogger("kvwake.kernels")
COSTS_FILE = "path-costs.json"  # the measured rows, by device, MLX version and attention shape
# In the key: what a row means (attention.py `_timed_paths`: plain, fused at a known shape, fused's extra at a new
# one, seconds a layer). A change to that measure names another version, so old rows are not taken for new ones.
COSTS_FORMAT = "v1"
PROBE_QUERIES, PROBE_REPEATS = 128, 2  # what PathCosts measures: a turn's chunk of queries, the best of two runs
KEY_LADDER = (1024, 4096, 16384, 65536, 131072)  # and at which key lengths, up to the model's context


def costs_file() -> Path:
    """The machine's measured attention costs: beside MLX's kernel cache, one file per MLX version (the costs are
    its kernels')."""
    import mlx.core as mx

    from kvwake.paths import default_cache_dir

    return default_cache_dir() / f"mlx-{mx.__version__}" / COSTS_FILE


def key_ladder(context: int | None) -> list[int]:
    """KEY_LADDER up to a model's context (32k when unknown)."""
    top = context or 32768
    return [k for k in KEY_LADDER if k <= top] or [top]


def attention_shape(field: Callable[[str], Any]) -> tuple[int, int, int] | None:
    """(heads, KV heads, head size) from a model's fields (`field(name)`: its args' or its config's, None where
    absent); None where they do not give them."""
    heads, hidden = field("num_attention_heads"), field("hidden_size")
    if not (heads and hidden):
        return None
    return heads, field("num_key_value_heads") or heads, field("head_dim") or hidden // heads


def costs_key(heads: int, kv_heads: int, head_dim: int, dtype: Any, queries: int, repeats: int) -> str:
    """A measure's key in the costs file: the device it ran on and what it measured."""
    import mlx.core as mx

    device = mx.device_info().get("device_name", str(mx.default_device()))
    return f"{COSTS_FORMAT}|{device}|{heads}x{kv_heads}x{head_dim}|{dtype}|q{queries}|r{repeats}"


def stored_costs(key: str) -> dict[int, tuple[float, float, float]]:
    """The rows (key length -> plain, fused, fused's extra at a new shape) kept under `key`; {} where none are or
    the file cannot be read (measured again then)."""
    try:
        rows = json.loads(costs_file().read_text()).get(key, {})
        return {int(k): (float(a), float(b), float(c)) for k, (a, b, c) in rows.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


_costs_lock = threading.Lock()  # one writer of the costs file at a time in this process (engines of several models)


def store_cost(key: str, keys: int, row: tuple[float, float, float]) -> None:
    """Keep one measured row. The file is {key: {key length: [plain, fused, extra]}}, read, updated and written
    whole by a rename (a reader never sees half a file) under this process's lock and an exclusive lock on a file
    beside it (processes: a daemon and a warmer's child), so no writer loses another's rows. Only speed is at
    stake: a failure is logged."""
    import fcntl
    import tempfile

    path = costs_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _costs_lock, open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                kept = json.loads(path.read_text())
            except (OSError, ValueError):
                kept = {}
            kept = kept if isinstance(kept, dict) else {}
            rows = kept.get(key) if isinstance(kept.get(key), dict) else {}
            kept[key] = {**rows, str(keys): list(row)}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(kept, indent=1, sort_keys=True))
            os.replace(tmp, path)
    except OSError as exc:
        log.warning("keeping a measured attention cost failed", extra={"file": str(path), "error": repr(exc)})
