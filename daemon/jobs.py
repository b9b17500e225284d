"""Engine jobs: how work reaches the one thread that runs MLX.

MLX runs on one thread per loaded model (model/thread.py). A caller gives the work
it needs there as a runner, `Mlx`: `direct` when the caller is that thread (the
in-process API tests and bench/ use), `EngineThread.call` when it is another
thread (the daemon's session manager). What a job may be marked as (`quick`,
`Packed`) tells the engine thread's scheduler how to order it
(model/scheduler/steps.py). A job on the engine thread that queues another one
behind the waiting ones uses the engine thread's `later`, which the thread
hands to what needs it when it attaches (None in process: the caller runs it).

Nothing here imports MLX: kv/, model/ and sessions/ all use these.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Mlx", "Packed", "direct", "outcome", "quick", "unframed"]

T = TypeVar("T")
Mlx = Callable[[Callable[[], Any]], Any]
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def unframed(exc: BaseException) -> BaseException:
    """`exc` (and the exceptions chained to it) with its traceback's finished frames cleared of their locals.

    An exception raised by MLX work travels to another thread (a job's waiter, a call's client) with a
    traceback whose frames hold that work's locals: caches, batches, MLX arrays. Freed there, an MLX array's
    memory goes back to MLX's allocator from a thread that is not the engine thread, while the engine thread
    may be allocating (MLX is not thread-safe): a suspect, not proven, in daemons that exited by SIGSEGV at
    a stop (docs/decisions.md). Cleared here, on the engine thread, they are freed here. Tracebacks still
    name every file and line."""
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


def outcome(fn: Callable[[], Any]) -> Any:
    """fn's result, or the exception it raised: a pack's item, raised to the one caller it belongs to."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - delivered to the one caller it belongs to
        return exc
