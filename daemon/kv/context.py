"""KvContext: the narrow view of the loaded model and the daemon that the KV layer works with.

The pipeline (sleep, wake, prefix writes) and prefix restores take this, never
the `Engine`: the store, the bundle hash, the block size, the RAM tier, the
worker pool, the counters, and the few facts of the model's cache they need
(its skeleton, its quantization, whether it can be cut by token). The engine
(daemon/model/) builds one when it loads a model and shares it; nothing in
kv/ imports model/.

`Mlx`: the runner the caller gives for MLX work. MLX runs on one thread: a
caller that is that thread passes `direct`; one that is not passes a callable
that runs a function there and returns its result (`EngineThread.call`).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvwake.daemon.kv.bundle import Bundle, diff_descriptions
from kvwake.daemon.kv.hotblocks import HotBlocks
from kvwake.daemon.kv.pool import Pool
from kvwake.errors import BundleMismatchError, KvwakeError
from kvwake.store import SnapshotRecord, Store

__all__ = ["Counters", "KvContext", "Mlx", "Packed", "direct", "quantize_cache", "quick", "unframed"]

log = logging.getLogger("kvwake.engine")  # the name its messages had before the layers (logs are read by it)
T = TypeVar("T")
Mlx = Callable[[Callable[[], Any]], Any]
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def unframed(exc: BaseException) -> BaseException:
    """`exc` (and the exceptions chained to it) with its traceback's finished frames cleared of their locals.

    An exception raised by MLX work travels to another thread (a job's waiter, a call's client) with a
    traceback whose frames hold that work's locals: caches, batches, MLX arrays. Freed there, an MLX array's
    memory goes back to MLX's allocator from a thread that is not the engine thread, while the engine thread
    may be allocating (MLX is not thread-safe). A suspect, not proven, in the daemons that exited by SIGSEGV
    at a stop on the H100 (the last one's main thread was in the event loop, the engine thread in an MLX
    eval). Cleared here, on the engine thread, they are freed here. Tracebacks still name every file and line."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            # A generator's or coroutine's frame is left alone: clearing one still suspended would close it.
            if not tb.tb_frame.f_code.co_flags & _SUSPENDABLE:
                try:
                    tb.tb_frame.clear()
                except BaseException:  # still executing (the frame that caught it): left as it is
                    pass
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]
    return exc


def direct(fn: Callable[[], T]) -> T:
    """The `mlx` runner for a caller that is itself the engine thread."""
    return fn()


def quick(fn: Callable[[], T]) -> Callable[[], T]:
    """Mark `fn` as an engine job with no MLX work (a look at a session's state, a call's join): the engine
    thread runs it before its next job with the other quick ones, not at its turn, one job between two decode
    steps (model/thread.py). Only for what reads or moves Python objects: a quick job is not ordered behind
    the jobs queued before it."""
    fn.engine_quick = True  # type: ignore[attr-defined]
    return fn


class Packed:
    """An engine job that runs with every job of the same `pack` queued when its turn comes (model/thread.py):
    the engine thread calls `pack(jobs)` once for them all, in the place of the first, and each caller gets
    its item of the list it returns (an exception item is raised to that caller; `pack` raising fails them
    all). Called as a plain function (another runner than the engine thread's, or `direct`), it is a pack of
    one. `fn`: what one job does, named in the engine's timing; `args`: what `pack` reads of each job."""

    __slots__ = ("args", "engine_pack", "fn")

    def __init__(self, fn: Callable[..., Any], pack: Callable[[list[Packed]], list[Any]], args: tuple = ()) -> None:
        self.fn, self.engine_pack, self.args = fn, pack, args

    def __call__(self) -> Any:
        result = self.engine_pack([self])[0]
        if isinstance(result, BaseException):
            raise result
        return result


_engine = threading.local()  # on an engine thread: how `later` queues a job there


def serve_later(put: Callable[[Callable[[], Any]], Future]) -> None:
    """Called by an engine thread as it starts: `later`, from that thread, queues its jobs through `put`."""
    _engine.put = put


def later(fn: Callable[[], Any]) -> Future | None:
    """From a job on an engine thread: queue `fn` as a job of its own, behind those waiting (a decode step
    runs between two jobs; `quick` jobs go first, and `fn` is not made one), and return its Future (failed
    if the engine stops first); None on any other thread (the caller runs it itself)."""
    put = getattr(_engine, "put", None)
    return None if put is None else put(fn)


def quantize_cache(cache: list, bits: int | None, group_size: int) -> list:
    """The cache with its plain KV layers quantized when `bits` is set (mlx-lm cannot quantize the
    others); as it is otherwise."""
    if bits is None:
        return cache
    return [c.to_quantized(group_size=group_size, bits=bits) if type(c) is KVCache else c for c in cache]


class Counters(dict):
    """Named event counts, added to from the engine thread and the pool's workers alike."""

    def __init__(self, *names: str) -> None:
        super().__init__({name: 0 for name in names})
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self[name] += n


@dataclass
class KvContext:
    """Everything sleep, wake and prefix restores need, and nothing else.

    model: the loaded MLX model, only for its cache skeleton (`make_prompt_cache`).
    kv_bits, kv_group_size: quantized KV (plain KV layers only, as mlx-lm quantizes them).
    device_planes: KV on a discrete GPU: a sleep splits byte planes there (devplanes.py).
    cuttable: every layer can be cut by token, so prefixes are reusable across sessions.
    """

    store: Store
    bundle: Bundle
    model: Any
    hot: HotBlocks
    pool: Pool
    vocab_size: int
    cuttable: bool
    kv_bits: int | None = None
    kv_group_size: int = 64
    device_planes: bool = False
    counters: Counters = field(default_factory=lambda: Counters("blocks_ram", "blocks_disk", "tokens_reused",
                                                                "tokens_prefilled", "prefill_packs",
                                                                "prefill_packed_chunks"))

    @property
    def block_tokens(self) -> int:
        return self.store.block_tokens

    @property
    def min_partial(self) -> int:
        """The fewest tokens a partial block or tail serves: a quarter block. Below that the match is the
        chat template's opening, which every session shares: restoring (and keeping in RAM) a whole
        block for it would cost more than prefilling it and push real shared prompts out of the RAM tier."""
        return max(1, self.block_tokens // 4)

    def make_blank(self) -> list:
        """make_prompt_cache(model): the cache skeleton a restore fills (MLX work)."""
        return make_prompt_cache(self.model)

    def make_cache(self) -> list:
        """A fresh cache; with kv_bits, plain KV layers are quantized (mlx-lm cannot quantize the others)."""
        return self.quantize(self.make_blank())

    def quantize(self, cache: list) -> list:
        """The cache with its plain KV layers quantized when kv_bits is set; as it is otherwise."""
        return quantize_cache(cache, self.kv_bits, self.kv_group_size)

    def record(self, snapshot_id: str) -> SnapshotRecord:
        """A snapshot's verified record; BundleMismatchError (with the differences) for another model's."""
        try:
            return self.store.snapshot(snapshot_id, bundle=self.bundle.hash)
        except BundleMismatchError as exc:
            theirs = self.store.bundle(exc.data.get("snapshot_bundle", "")) or {}
            diffs = diff_descriptions(theirs, self.bundle.description) if theirs else []
            if diffs:
                exc.message += "; differences: " + "; ".join(diffs[:5])
                exc.args = (exc.message,)
                exc.data["differences"] = diffs
            raise

    @staticmethod
    def log_unusable(exc: KvwakeError) -> None:
        log.warning("prefix block unusable, prefilling instead: %s", exc.message)
