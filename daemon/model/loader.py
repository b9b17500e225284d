"""A model's engine and engine thread, started and stopped (one pair per loaded model).

`start_model` blocks its caller until the model is loaded: the weights are read on the model's own new
engine thread, so the daemon calls it from a worker thread (sessions/models.py), never from the event
loop or another model's engine thread. `stop_model` undoes it once the model's sessions sleep.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from kvwake.daemon.config import Settings
from kvwake.daemon.kv import bundle
from kvwake.daemon.kv.ram_tier import RamTier
from kvwake.daemon.model import kernel_cache, memory, switching, weights
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.provider import LoadedModel
from kvwake.daemon.model.registry import ModelSpec
from kvwake.daemon.model.thread import EngineThread
from kvwake.store import Store

__all__ = ["WARM_HOLD_S", "WARM_POLL_S", "free_stopped", "release_mlx_streams", "start_model", "stop_model",
           "warm_model"]

log = logging.getLogger("kvwake.models")


def release_mlx_streams() -> None:
    """Run last on an engine thread: MLX's per-thread streams must be destroyed by the thread that
    made them, before the interpreter shuts down, or MLX may abort at exit ("terminate called without
    an active exception"; ml-explore/mlx#4327; docs/decisions.md, "Leaving the process after a stop
    (session 7)")."""
    import mlx.core as mx

    mx.synchronize()
    mx.clear_streams()


def start_model(settings: Settings, store: Store, spec: ModelSpec, limits: memory.Limits | None,
                neighbours: Sequence[ModelSpec] = (), ram_tier: RamTier | None = None,
                wakes_ahead: Callable[[], int] | None = None) -> tuple[Engine, EngineThread]:
    """`spec`'s engine, built on a new engine thread of its own (named for the model), and that thread;
    `limits`: MLX's memory limits as the first model set them (None: this is the first, it sets them).
    The first model's start makes what a later load must not make while another model decodes: the row
    kernels of `neighbours` (the other models configured, those given as folders), their kernel warmers'
    compiles, their tokenizers and modules (model/weights.py `preload`) and, once it is loaded, their files' digests
    (kv/bundle.py `digests_ahead`), and a wake's staging ring beside its load
    (model/kernel_cache.py BesideLoad, Warmer); its llguidance tokenizer too (a later load's is built at its
    first structure: model/grammar.py). `ram_tier`:
    the RAM tier its engine takes, filling already (kv/hot_set.py); None: a new one. `wakes_ahead`: how many
    sessions will wake at once after the start (the hot set's), a staging slot made beside the load for each."""
    first = limits is None
    others = [Path(s.source).expanduser() for s in neighbours
              if s is not spec and s.source is not None and Path(s.source).expanduser().is_dir()] if first else []
    for folder in others:  # their kernel warmers now, while nothing decodes: a later load takes them done
        # (Warmer.for_model) instead of starting two processes on the GPU beside the models decoding then
        kernel_cache.start_early(str(folder), settings.tuning.kernel_warmer, settings.tuning.paged_kv,
                                 settings.tuning.paths_ahead)
    # their tokenizers and modules, whose making held the GIL beside the decoding at their load (model/weights.py)
    weights.preload(others, modules=settings.tuning.modules_ahead, read=settings.tuning.weights_read)
    thread = EngineThread(f"kvwake-engine-{spec.name}", on_exit=release_mlx_streams,
                          slow_job_ms=settings.tuning.slow_job_ms, slow_jobs_kept=settings.tuning.slow_jobs_kept)
    try:
        if limits is None:  # the first model: MLX's limits (process-wide) set where MLX runs
            limits = thread.submit(lambda: memory.apply_limits(settings.mlx_memory_bytes,
                                                               settings.mlx_cache_bytes)).result()
        # other models decode meanwhile: no full collection stops them (model/switching.py)
        with switching.while_loading(settings.tuning.load_switch_ms):
            engine = thread.submit(lambda: Engine(
                store, settings.data_dir, spec.source, kv_bits=settings.kv_bits, kv_group_size=settings.kv_group_size,
                ram_tier_bytes=settings.ram_tier_bytes, io_workers=settings.io_workers,
                io_inflight_bytes=settings.io_inflight_bytes, max_batch=settings.max_batch,
                prefill_step=settings.prefill_step, max_context=settings.max_context, limits=limits,
                persist=settings.persist, warm=False, tuning=settings.tuning, kernels_for=others,
                staging_beside_load=first, ram_tier=ram_tier, wakes_ahead=wakes_ahead,
                # llguidance's tokenizer (its build holds the GIL) built now only while nothing decodes
                eager_grammars=first)).result()
        # The decoder attached before that first job, here on the caller's worker thread: attached later (as the
        # provider adds the model, on the event loop) it waited behind the kernels' wait, and the event loop with
        # it, so every other model's streamed tokens stopped for that long (docs/decisions.md, "Several models").
        thread.attach(engine.decoder, engine.planner)
        thread.submit(engine.wait_kernels)  # its first job: whatever runs the model after it finds the kernels
        if others and settings.tuning.digests_ahead:  # once this model is in: their reads do not slow its load
            bundle.digests_ahead(others, Path(settings.data_dir) / bundle.DIGEST_CACHE_NAME)
    except BaseException:
        thread.stop()
        raise
    return engine, thread


def stop_model(model: LoadedModel) -> None:
    """Stop a model no session is hot on any more: its writes finished, its thread stopped, its engine
    closed (blocks until done: from a worker thread). Its memory goes once the caller lets go of it too:
    `free_stopped` then."""
    started = time.perf_counter()
    model.engine.stop_kernels()  # a thread whose first job still waits for them ends now, not once they compiled
    model.engine.persister.close()  # while the engine thread still runs the checkpoint it may be in
    model.engine.points.hurry(model.thread.call)  # and the points whose copies wait for its idle time: made now
    model.thread.stop()
    model.engine.close()
    log.info("model stopped", extra={"model": model.name, "ms": round((time.perf_counter() - started) * 1000, 1)})


def free_stopped(clear: bool = True) -> dict[str, int]:
    """Free what stopped models left, once nothing refers to them any more (from a worker thread). Their arrays sit
    in reference cycles (mlx-lm's modules), which only a full collection frees; and their objects were frozen after
    their load (model/switching.py), out of the collector's reach: back within it for this one pass, then what the
    other models hold is frozen again. Run while the caller still held a stopped model, the pass found it alive and
    froze it again, weights and all, until the next unload's pass (a reload held the old weights beside the new).

    Then MLX's cache of freed buffers is emptied (`clear`): what the stopped model freed went there (up to its
    limit) and MLX hands a cached buffer to the next request of its size whatever memory it is. On CUDA a host
    array (a wake's image, a sleep's copy) is managed memory and a kernel's output device memory, and a buffer
    of one kind reused as the other is migrated or copied whole at its first use: the next model's first wake
    and turn would pay for the last one's leftovers (docs/decisions.md, "Several models"). False
    only to measure that (bench/reload_probe.py). Says what MLX holds after it, in arrays and in its cache (the
    unload's log line: what an unload left behind is there to see)."""
    import mlx.core as mx

    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if clear:
        mx.clear_cache()
    return {"mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory()}


# a warm-up waits this long at most for the requests it would hold back (`warm_model`'s `until_idle`)
WARM_HOLD_S = 10.0
WARM_POLL_S = 0.05


async def warm_model(model: LoadedModel, until_idle: Callable[[], Any] | None = None) -> None:
    """The model's warm-up (CUDA: batch sizes' kernels, attention paths' costs) as idle jobs one at a time:
    requests go first (a wake after a restart, a prefill), and one that comes while a warm-up job runs waits
    for that one alone. A shape a request needs before its warm-up ran is built by the request itself, as
    it would be unwarmed. `until_idle`: the warm-up first waits while it returns true, WARM_HOLD_S at most (the
    requests that came with the start or the load: a job is not cut, so one that began just before them would
    hold them, as a restart's wakes were, docs/benchmarks.md, "fleet", and a reloaded model's first wake)."""
    held = time.monotonic()
    while until_idle is not None and until_idle() and time.monotonic() - held < WARM_HOLD_S:
        if not getattr(model.thread, "alive", True):
            break
        await anyio.sleep(WARM_POLL_S)
    if not getattr(model.thread, "alive", True):  # unloaded while it waited: nothing to warm, nothing failed
        return
    started, took = time.perf_counter(), []
    try:
        jobs = await model.thread.run(model.engine.warm_jobs)
        for job in jobs:
            took.append(await model.thread.run_when_idle(_timed(job)))
    except Exception as exc:  # only speed is at stake: serving goes on
        if getattr(model.thread, "alive", True):  # else unloaded meanwhile (its jobs refused): nothing failed
            log.warning("warm-up failed", extra={"model": model.name, "error": repr(exc)})
        return
    model.warmed.set()
    if jobs:  # each job's ms, in Engine.warm_jobs' order: a long one is what a request may have waited for
        log.info("warm", extra={"model": model.name, "jobs": len(jobs), "jobs_ms": took,
                                "ms": round((time.perf_counter() - started) * 1000, 1)})


def _timed(job: Callable[[], Any]) -> Callable[[], float]:
    """`job` as a job that returns the milliseconds it ran."""
    def run() -> float:
        started = time.perf_counter()
        job()
        return round((time.perf_counter() - started) * 1000, 1)
    return run
