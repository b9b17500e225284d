"""The engine: one loaded MLX model, the sessions it runs, and their sleep and wake.

All MLX work happens on one thread. Every operation takes `mlx`, the runner for
its MLX steps (daemon/jobs.py): `direct` when the caller is that thread (the
in-process API tests and bench/ use), `EngineThread.call` when it is a worker
thread (the daemon's session manager). Either way the operation is this code:
sleep and wake are `kv/pipeline.py` (codec and disk work on the `Pool`, every
core by default, bounded by bytes in flight), appends are plan, check, prefix,
apply (the daemon's session manager calls these steps itself, with room made
between them); how a prompt is cut into chunks, packs and slices is the
scheduler's (model/scheduler/).

Prefix reuse: before a cold prefill, the engine asks the store for the longest
run of stored full blocks that starts the tokens (under this bundle), restores
them (from the RAM tier where it holds them, else disk) and prefills only the
rest; the daemon's manager first looks for a hot session's copy and hands it to
`apply`. Models whose caches cannot
be cut by token (sliding windows, recurrent state) only reuse whole snapshots:
their prefix reuse is off.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvwake.daemon.kv import capacity as kvcapacity
from kvwake.daemon.kv import cache_blocks, devplanes, paged_cache, pipeline, points, restore_buffers, window_stage
from kvwake.daemon.kv.bundle import DIGEST_CACHE_NAME, Bundle, describe_bundle, start_digests
from kvwake.daemon.config import Tuning
from kvwake.daemon.jobs import Mlx, direct
from kvwake.daemon.kv.context import KvContext, quantize_cache
from kvwake.daemon.kv.paging import Pages
from kvwake.daemon.kv.ram_tier import RamTier
from kvwake.daemon.kv.persist import Persister
from kvwake.daemon.kv.points import PointTaker
from kvwake.daemon.kv.pool import Pool
from kvwake.daemon.model import (attention, kernel_cache, memory, packing, parallel_rows, quantized, quantized_kernel,
                                 ragged_decode, weights)
from kvwake.daemon.model.appending import Appending, ShouldStop
from kvwake.daemon.model.scheduler import PrefillPlanner, default_step
from kvwake.daemon.model.convert import DEFAULT_MODEL_NAME, ensure_default_model
from kvwake.daemon.model.decode_calls import batch_mode
from kvwake.daemon.model.decoder import Decoder
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.model.grammar import Grammars
from kvwake.daemon.model.masks import Constraint
from kvwake.daemon.model.prompt import Plan, Prompter
from kvwake.daemon.model.reply_points import ReplyPoints
from kvwake.daemon.timing import Phases
from kvwake.daemon.session_state import Session
from kvwake.errors import ContextTooLongError, InvalidParamsError
from kvwake.store import SnapshotRecord, Store
from kvwake.store.decode_procs import DecodeProcs

__all__ = ["CONTENT_FORMAT", "Engine", "Plan", "ShouldStop", "resolve_model"]

# What a block's payload means (kv/cache_blocks.py's naming), as the bundle hash records it. Frozen at the
# value kvwake 0.1 hashed: the compression codec and the file format are per file (each block
# file says its own), so switching codec or file format never orphans a store's snapshots.
CONTENT_FORMAT = ("planes-zstd+kvstate1", 1)


log = logging.getLogger("kvwake.engine")



def context_length(model_path: Path) -> int | None:
    """The model's context in tokens, from its config.json (`max_position_embeddings`, also under
    `text_config`); None when the config does not say."""
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings", (config.get("text_config") or {}).get("max_position_embeddings"))
    return int(value) if isinstance(value, int) and value > 1 else None


def resolve_model(model: str | Path | None, data_dir: Path) -> tuple[Path, str]:
    """(local model folder, display name); no model means the default, converted once."""
    if model is None:
        return ensure_default_model(data_dir), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve(), path.name
    from mlx_lm.utils import _download  # hub ids: mlx-lm's own download/cache lookup

    return Path(_download(str(model))), str(model)


class Engine(Appending):
    """Holds one model and runs sessions on it: one operation per session at a time, MLX work through `mlx`."""

    def __init__(
        self,
        store: Store,
        data_dir: Path,
        model: str | Path | None = None,
        *,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        ram_tier_bytes: int = 256 << 20,
        prefill_step: int | None = None,
        io_workers: int | None = None,
        io_inflight_bytes: int = 512 << 20,
        max_batch: int = 32,
        max_context: int | None = None,
        limits: memory.Limits | None = None,
        persist: bool = False,
        warm: bool = True,
        tuning: Tuning = Tuning(),
        kernels_for: Sequence[Path] = (),
        staging_beside_load: bool = True,
        ram_tier: RamTier | None = None,
        wakes_ahead: Callable[[], int] | None = None,
        eager_grammars: bool = True,
    ) -> None:
        prefill_step = prefill_step or default_step()  # by backend (model/scheduler/prefill.py)
        self.store, self.prefill_step, self.tuning = store, prefill_step, tuning
        self.restore_mode = restore_buffers.restore_mode(tuning.restore_mode)
        self.started = Phases()  # where the engine's start went (the daemon logs it with "ready")
        self.model_path, self.model_name = resolve_model(model, Path(data_dir))
        # the bundle's file digests, read on background threads while the weights load (kv/bundle.py)
        digests = start_digests(self.model_path, digest_cache=Path(data_dir) / DIGEST_CACHE_NAME)
        kernels = row_kernel = None
        # plain KV layers in pages, a shared prefix held once (kv/paging.py): `--tune paged_kv`, else CUDA's
        # default for a model of plain attention only (the config's guess; the loaded cache decides below)
        self.paged = kernel_cache.paged_wanted(tuning.paged_kv, self.model_path)
        if attention.on_cuda():  # buffers off cuDNN's 256-token grid below 16k tokens (kv/capacity.py)
            kvcapacity.install()
            # MLX's kernels compiled beside the load, once per machine (model/kernel_cache.py)
            kernels = kernel_cache.Warmer.for_model(self.model_path, paged=self.paged,
                                                    paths=tuning.paths_ahead) if tuning.kernel_warmer else None
            # and the row kernel, once per process, whatever the warmer's knob: built on this engine's thread,
            # its compile would stop every other model's decode steps for its length
            # (`kernels_for`: other models' folders, whose row kernels are built now)
            staged = staging_beside_load and self.restore_mode == "staged"
            row_kernel = kernel_cache.BesideLoad(self.model_path, ragged_decode.wanted(tuning.row_kernel),
                                                 store.block_tokens if staged else None, others=kernels_for,
                                                 wakes=wakes_ahead, quantized=tuning.quantized_kernel,
                                                 page_tokens=store.block_tokens if self.paged else None)
        self.weight_pieces: list[dict[str, Any]] = []  # each piece of the weights' read (model/weights.py)
        self.model, self.tokenizer = weights.load(str(self.model_path), phases=self.started,
                                                  timeline=self.weight_pieces, read=tuning.weights_read)
        # its own parameters' bytes, not the process's memory: a second model loaded beside the first would
        # count the first's weights and KV as its own (and its KV room, budget and longest session with them)
        self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        # a quantized model's products by their rows: none waits for a compile of MLX's (model/quantized.py)
        # (kvwake's 4-bit kernel taken below, once it is built)
        self.quantized_layers = quantized.install(self.model) if attention.on_cuda() else 0
        self.quantized_kernel = False
        self.started.mark("weights")
        known = [n for n in (context_length(self.model_path), max_context) if n]
        self.context_length = min(known) if known else None
        probe = quantize_cache(make_prompt_cache(self.model), kv_bits, kv_group_size)
        kv_layout = cache_blocks.layout(probe, model=self.model)
        self.bundle: Bundle = describe_bundle(
            self.model_path, kv_layout=kv_layout, block_tokens=store.block_tokens,
            codec=CONTENT_FORMAT[0], codec_version=CONTENT_FORMAT[1], digests=digests, model_name=self.model_name,
        )
        store.register_bundle(self.bundle.hash, self.bundle.description)
        self.started.mark("bundle")
        tier = ram_tier if ram_tier is not None else RamTier(ram_tier_bytes)
        self.kv = KvContext(store=store, bundle=self.bundle, model=self.model, ram_tier=tier,
                            pool=Pool(io_workers, io_inflight_bytes, nice=tuning.pool_nice),
                            vocab_size=self._vocab_size(), restore_mode=self.restore_mode,
                            cuttable=cache_blocks.cuttable(probe), kv_bits=kv_bits, kv_group_size=kv_group_size,
                            # KV on a discrete GPU: byte planes are made there
                            device_planes=self.restore_mode == "staged", window_blocks=tuning.window_blocks,
                            procs=DecodeProcs(tuning.decode_processes)
                            if tuning.decode_processes and self.restore_mode == "direct" else None)
        self.ram_tier, self.pool, self.counters, self.cuttable = self.kv.ram_tier, self.kv.pool, self.kv.counters, self.kv.cuttable
        self.started.mark("kv")
        self.prompter = Prompter(self.tokenizer, self.kv.vocab_size, self.model_name, tuning.renders_at_once)
        self.template = self.prompter.template
        self.started.mark("prompter")
        self.decode_mode, self.decode_reason = batch_mode(probe, kv_bits, max_batch, self.model)
        self.cuda_graphs = attention.cuda_graphs()  # fixed for the process: MLX reads the variable once
        self.decoder = Decoder(self.model, self.decode_mode, max_batch, self.kv.vocab_size)
        self.started.mark("decoder")
        # Built before the daemon answers (beside the load, or now): MLX compiles a custom kernel in every process
        # (a long compile, not from its disk cache), and a decode step or an idle warm-up job building it would
        # hold up every request that comes meanwhile (a restart's first round: docs/benchmarks.md, "fleet").
        # False when the model's heads are not a shape it takes.
        self.decoder.row_kernel = ragged_decode.wanted(tuning.row_kernel) and ragged_decode.warm(
            self.model, built=row_kernel.result() if row_kernel is not None else None,
            page_tokens=store.block_tokens if self.paged else None,
            paged=row_kernel.paged if row_kernel is not None else None)
        self.decoder.paged_kernel = attention.on_cuda() if tuning.paged_kernel is None else tuning.paged_kernel
        if self.quantized_layers and row_kernel is not None and row_kernel.quantized_built:
            # built beside the load (not where the GPU cannot run it: before sm_80's tensor-core products)
            quantized.install(self.model, kernel=True)
            self.quantized_kernel = True
        self.started.mark("row_kernel")
        self.grammars = Grammars(self.tokenizer, self.kv.vocab_size, eager=eager_grammars)
        # Where each session's prefill is cut into chunks, packs and slices (model/scheduler/prefill.py);
        # packing is for where calls batch (the same exactness class)
        # Where a pass costs its tokens (the CPU) packs pay only with their rows apart on several cores
        # (model/parallel_rows.py, tuning prefill_threads): packed then unless pack_prefill says otherwise
        threads = parallel_rows.threads_wanted(tuning.prefill_threads)
        packable = self.decode_mode == "batched" and packing.packable_model(self.model)
        pack = packing.wanted(tuning.pack_prefill) or (tuning.pack_prefill is None and threads > 1 and packable)
        pack_prefill = pack and packable
        # its threads start at its first pack (none left behind by an engine whose start fails after this)
        self.prefill_rows = parallel_rows.ParallelRows(threads, f"kvwake-rows-{self.model_name}") \
            if pack_prefill and threads > 1 else None
        self.planner = PrefillPlanner(
            self.model, self.decoder, self.counters, prefill_step=prefill_step,
            plain_prefill=attention.wanted(),  # CUDA: no cuDNN graph build per new chunk shape
            bucket_prefill=attention.bucket_wanted(),  # a short chunk over a long cache: a shared shape
            pack_prefill=pack_prefill,
            slice_of_step=tuning.slice_of_step, gather_s=tuning.pack_gather_ms / 1000,
            first_s=tuning.prefill_first_ms / 1000,
            # one at a time where packing would not pay (one core), not where a model cannot pack (a GPU keeps
            # its turns' jobs as they come there)
            one_at_a_time=not pack, parallel=self.prefill_rows, padded_prefill=tuning.padded_prefill)
        self.started.mark("set_up")
        # MLX's kernels the warmers compile (model/kernel_cache.py): waited for by the first forward pass
        # (`wait_kernels`), not by the start: on a fresh machine the daemon answers once the weights are in,
        # and what needs no kernel (renders, matching, a wake's reads) goes on while they compile
        self.kernels = kernels
        self.token_bytes = memory.kv_token_bytes(self.model, kv_bits, kv_group_size)  # shapes: nothing runs
        self.started.mark("token_bytes")
        self.limits = limits
        self.set_kv_room(memory.kv_room(limits, self.weights_bytes) if limits else None)
        self.persister = Persister(self.kv, persist)  # full blocks written as they fill (kv/persist.py)
        # a model whose cache does not cut by token: restore points where its prefills pass a block boundary
        marks = self.template.message_marks() if not self.cuttable and tuning.restore_points else frozenset()
        self.points = PointTaker(self.kv, probe, tuning.restore_points, marks, tuning.window_blocks,
                                 tuning.held_points, tuning.cut_points and not self.paged)  # cut_at: plain KVCache
        self.planner.stop_at = self.points.next_stop if self.points.enabled else None
        self.points.idle_of = lambda: self.planner.idle  # the engine thread's, once attached (model/thread.py)
        self.reply_points = ReplyPoints(self)  # and one where a reply crossed a block boundary
        # in pages (`self.paged`): plain KV layers, a shared prefix held once (kv/paging.py), up to what all
        # KV may take (the hot budget is where sessions start to sleep, not a bound)
        kv_bound = self.kv_room_bytes if self.kv_room_bytes is not None else self.hot_budget_bytes
        self.points.set_room(kv_bound)  # and again as the room moves (set_kv_room)
        self.pages = Pages.for_model(probe, kv_layout, store.block_tokens, kv_bound,
                                     self.bundle.hash) if self.paged else None
        # Whether a wake may take its first blocks from another session's cache: plain KV, not quantized (what
        # a snapshot's blocks hold is what that cache holds); paged, it maps that cache's pages (kv/paged_wake.py)
        self.wakes_share = self.cuttable and kv_bits is None and all(type(c) is KVCache for c in probe)
        if warm:  # last: a warm-up's caches are sized against the room the limits leave
            self.wait_kernels()
            for job in self.warm_jobs():
                job()
            self.started.mark("warm")

    def wait_kernels(self) -> None:
        """Engine thread, before its first forward pass (the daemon's first job on it, model/loader.py): the
        kernel warmers' compiles into MLX's disk cache finished, so the pass loads them rather than compiling
        them itself (a wait that long is in the engine thread's slow jobs; nothing to wait for off CUDA or
        once waited or stopped)."""
        kernels = self.kernels
        if kernels is not None:
            kernels.wait()
            self.kernels = None
        if self.tuning.paths_ahead and self.planner.plain_prefill and self.planner.paths is None:
            # the attention paths' costs as the machine keeps them (measured by a warmer's "paths" part, or by an
            # earlier daemon's warm-up): chosen by them from the first chunk on, not once idle moments let the
            # warm-up measure them
            self.planner.paths = attention.PathCosts.known(self.model, attention.key_ladder(self.context_length),
                                                           kept=True, named=self._costs_dtype())

    def _costs_dtype(self) -> Any:
        """The dtype the machine's costs file keys this model's rows by: its checkpoint's, as the warmer's child
        reads it (a bf16 model with float32 norms measures in bf16 here, its rows keyed as the child keys them)."""
        return getattr(mx, kernel_cache.weights_dtype(self.model_path))

    def stop_kernels(self) -> None:
        """Any thread: the kernel warmers still compiling no longer waited for, whether the engine thread's first
        job waits for them (it returns then) or none ran yet; they end on their own (kernel_cache.Warmer.stop). A
        model stopped before its first forward pass (an unload, a load making room by one, the daemon's stop)
        otherwise waited for their compiles, kernel_cache.WAIT_S at most, a stop being queued behind that job."""
        kernels, self.kernels = self.kernels, None
        if kernels is not None:
            kernels.stop()

    def quantized_status(self) -> dict[str, Any] | None:
        """A quantized model's products by their rows (model/quantized.py); None for other models or off CUDA.
        The counts are the process's (every model's)."""
        if not self.quantized_layers:
            return None
        return {"layers": self.quantized_layers, "dequantize_rows": quantized.VECTOR_ROWS,
                "kernel_rows": quantized_kernel.ROWS if self.quantized_kernel else 0,
                "products": quantized.counts()}

    def set_kv_room(self, room: int | None) -> None:
        """What all KV may hold (None: no limit kept), and from it the most tokens one session may hold and
        what hot sessions may hold when the settings name no budget (model/memory.py); a wake or a prefill
        that would pass it sleeps others first (SessionManager). Set again as other models load and unload
        beside this one: the room is what their weights leave (model/budget.py)."""
        self.kv_room_bytes = room
        self.session_tokens = memory.tokens_in(room, self.token_bytes) if room is not None else None
        self.hot_budget_bytes = memory.hot_budget_in(room) if room is not None else memory.DEFAULT_HOT_BUDGET
        pages = getattr(self, "pages", None)  # made after the first room is set (the pool is bounded by it)
        if pages is not None:
            pages.set_budget(room if room is not None else self.hot_budget_bytes)
        points = getattr(self, "points", None)  # the arrays cut points keep alive while their copies wait: a share
        if points is not None:  # (made after the first room is set, and given its share then)
            points.set_room(room if room is not None else self.hot_budget_bytes)

    def warm_jobs(self) -> list[Callable[[], Any]]:
        """What makes the first requests fast on CUDA, as short jobs for the engine thread (run at once
        unless made with warm=False; the daemon runs them after it answers): each batch size's kernels
        built (MLX compiles per shape), a lone session's decode graphs at a few cache capacities
        (attention.warm_decode), then the attention paths' costs measured per key length. None elsewhere."""
        jobs: list[Callable[[], Any]] = []
        if attention.on_cuda():
            jobs += [lambda n=n: self.decoder.warm_size(n) for n in self.decoder.warm_sizes()]
            # a session decoding alone: cuDNN's decode graphs, whose first build would stall a first token
            # (docs/decisions.md, "Many agents at once (issue 24)")
            jobs += [lambda c=c: attention.warm_decode(self.model, c) for c in attention.decode_warm_capacities()]
        if attention.on_cuda() and self.restore_mode == "staged":
            jobs.append(self._warm_staging)
        if self.planner.plain_prefill:  # the plain path at each class of shape MLX builds kernels for (plain_warm_shapes)
            room = self.kv_room_bytes if self.kv_room_bytes is not None else float("inf")
            jobs += [lambda q=q, k=k: attention.warm_plain(self.model, q, k)
                     for q, k in attention.plain_warm_shapes(self.prefill_step, self.context_length)
                     if self.kv_bytes(q + k) <= room / 2]  # its cache made for it: beside room for sessions
            jobs += attention.PathCosts.steps(self.model, attention.key_ladder(self.context_length),
                                              lambda costs: setattr(self.planner, "paths", costs),
                                              kept=self.tuning.paths_ahead,
                                              named=self._costs_dtype() if self.tuning.paths_ahead else None)
        return jobs

    def _warm_staging(self) -> bool:
        """A wake's staging ring made and kept, its joins compiled (devplanes.warm), for plain KV caches: a
        paged wake's too (kv/page_restore.py: a staged one joins its spans through the same ring), so the
        sample is the model's plain cache, not a paged one (with paged KV on, the first wake after a start made
        the ring and compiled its joins itself)."""
        cache = self.kv.make_cache()
        if not cache or not all(type(c) is KVCache for c in cache):
            return False
        mx.eval(self.model(mx.array([[0]], dtype=mx.uint32), cache=cache))
        return devplanes.warm(cache[0].keys, 2 * len(cache), self.block_tokens)

    def close(self) -> None:
        self.stop_kernels()  # still compiling (no forward pass ran, or its wait cut short): not waited for
        self.persister.close()
        if self.prefill_rows is not None:
            self.prefill_rows.close()
        self.points.give_up()  # first: a reply point's thread may wait for a point whose idle job never runs
        self.reply_points.close()  # before the points: its prefills hand their writes to them
        self.points.close()
        self.pool.close()
        if self.kv.procs is not None:  # after the pool: no read is left to ask them
            self.kv.procs.close()
        # Its wakes' kept staging slots go but a ring's worth, and other models' stay: a model unloaded and
        # loaded again for its sessions finds its first wake's ring made (one made afresh is a long job, and a
        # ring with no idle slot decodes one span ahead), and closing one model's engine once dropped every
        # model's slots (docs/decisions.md, "Several models")
        shape = self._staging_shape()  # those made beside its load, which no wake may have taken yet
        if shape is not None:
            devplanes.note_owner(id(self.model), shape)
        devplanes.drop_owned(id(self.model), keep=devplanes.RING_SLOTS)
        window_stage.drop_idle()

    def _staging_shape(self) -> tuple[int, int] | None:
        """The shape of the staging slots made beside this engine's load (devplanes.slot_shape), for plain KV
        caches; None for others."""
        cache = self.make_cache()
        heads = ragged_decode.shape_of(self.model)
        if not cache or heads is None or not all(type(c) is KVCache for c in cache):
            return None
        _, kv_heads, head_dim, dtype = heads
        return devplanes.slot_shape((1, kv_heads, 1, head_dim), dtype.size, 2 * len(cache), self.block_tokens)

    def _vocab_size(self) -> int:
        args = getattr(self.model, "args", None)
        return int(getattr(args, "vocab_size", 0) or len(self.tokenizer.vocab))

    @property
    def vocab_size(self) -> int:
        return self.kv.vocab_size

    @property
    def block_tokens(self) -> int:
        return self.store.block_tokens

    @property
    def min_partial(self) -> int:
        return self.kv.min_partial

    def make_cache(self) -> list:
        """A fresh cache; with kv_bits, plain KV layers are quantized (mlx-lm cannot quantize the others);
        with `paged_kv`, they are paged."""
        return self.pages.make(self.kv.make_cache()) if self.pages is not None else self.kv.make_cache()

    def cache_bytes(self, session: Session) -> int:
        """Bytes of the session's KV in memory (0 while it has none); a paged layer counts its share of the
        pages it lists (a page listed by n sessions: 1/n)."""
        kv = cache_blocks.cache_nbytes(session.cache) if session.cache is not None else 0
        return kv + points.held_bytes(session)  # held while a batch holds its KV, or a failure dropped it

    def unpaged_bytes(self, session: Session) -> int:
        """Bytes of the session's KV held outside the page pool (its layers that are not paged, its held point)."""
        kv = [c for c in session.cache or () if not isinstance(c, paged_cache.PagedKVCache)]
        return cache_blocks.cache_nbytes(kv) + points.held_bytes(session)

    def sleep_frees(self, session: Session) -> tuple[int, int]:
        """(Bytes a sleep of the session frees: its unpaged layers' and the pages no other session lists; bytes
        it holds, its shared pages whole). Equal unless it shares pages (kv/paging.Pages.frees)."""
        unpaged = self.unpaged_bytes(session)
        freed, held = self.pages.frees(session.cache) if self.pages is not None else (0, 0)
        return unpaged + freed, unpaged + held

    def page_bytes(self) -> int:
        """Bytes of KV the page pool holds now, a shared page once (0 without pages); read from any thread (a
        table a sleep let go counts until the engine thread frees it)."""
        return self.pages.status()["held_bytes"] if self.pages is not None else 0

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of the KV buffer a session of `tokens` tokens holds (as its growth makes it)."""
        return kvcapacity.capacity(tokens) * self.token_bytes if tokens > 0 else 0

    def wake_bytes(self, record: SnapshotRecord) -> int | None:
        """Bytes of KV a paged wake from `record` adds: the pages it does not map from those resident (another
        session lists them) and its layers that are not paged, as a buffer holds them; None without pages (the
        room counts a buffer's growth itself). Read from any thread: the room a wake needs (sessions/room.py)."""
        if self.pages is None:
            return None
        return (self.pages.wake_bytes(record, maps=self.wakes_share)  # a wake maps resident pages where it shares
                + self._unpaged_growth(len(record.token_ids), 0))

    def append_bytes(self, session: Session, target: list[int]) -> int | None:
        """Bytes of KV a paged append growing `session` to `target` adds: its pages past those it lists (a new
        session's past the published blocks that start `target`, which it maps) and its layers that are not
        paged, as a buffer grows; None without pages. Read from any thread: the room a turn needs."""
        if self.pages is None:
            return None
        return (self.pages.append_bytes(session.cache, target, maps=self.wakes_share)
                + self._unpaged_growth(len(target), self.unpaged_bytes(session)))

    def _unpaged_growth(self, tokens: int, held: int) -> int:
        """Bytes a paged engine's layers that are not paged (none for a model paged whole) take at `tokens`
        tokens, as a buffer holds them, past the `held` bytes they hold already."""
        layout = self.pages.pool.layout
        per_token = max(0, self.token_bytes - layout.page_bytes // layout.page_tokens)
        return max(0, kvcapacity.capacity(tokens) * per_token - held) if per_token and tokens > 0 else 0

    def copy_prefix(self, session: Session, n_tokens: int) -> list:
        """A new cache holding the first n_tokens of the session's (MLX work); the session keeps its own."""
        return cache_blocks.copy_prefix(session.cache, n_tokens)

    def copy_point_prefix(self, session: Session, n_tokens: int) -> tuple[list | None, int]:
        """(A new cache holding the session's state at its deepest held point within n_tokens, that point's
        tokens), or (None, 0): what a shared prefill's waiter takes on a model cut by restore points (MLX work)."""
        return points.held_copy(session, n_tokens)

    def end_trail(self, session: Session) -> None:
        """The session led a shared prefill: what it held for its waiters alone is freed (MLX work)."""
        points.end_trail(session)

    def held_point_bytes(self, session: Session) -> int:
        """Bytes of the session's held restore points (kv/points.py `hold`), counted in `cache_bytes` too."""
        return points.held_bytes(session)

    # -- input ----------------------------------------------------------------

    def render(self, **inputs: Any) -> Plan:
        """A whole conversation (messages, text or tokens, and tools) rendered once, for any session."""
        return self.prompter.render(**inputs)

    @staticmethod
    def mlx_memory() -> dict[str, int]:
        """MLX's own counters: bytes in arrays now, in its cache of freed buffers, and at most so far."""
        return {"mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory(),
                "mlx_peak_bytes": mx.get_peak_memory()}

    @property
    def max_tokens(self) -> int | None:
        """The most tokens a session may hold: the model's context (or `max_context`), what its KV may take of
        the memory limit, and what the page pool may hold (`paged_kv`), whichever is least; None when none is
        known."""
        paged = self.pages.most_tokens() if self.pages is not None else None
        known = [n for n in (self.context_length, self.session_tokens, paged) if n is not None]
        return min(known) if known else None

    def check_fits(self, tokens: int) -> None:
        """A prompt of `tokens` must leave room for one generated token in the model's context and in the
        memory a session may take; raises ContextTooLongError otherwise (callers check before any prefill)."""
        limit = self.max_tokens
        if limit is None or tokens < limit:
            return
        by_memory = limit != self.context_length  # the least of the two, and not the context's: memory's
        by_pages = by_memory and limit != self.session_tokens  # the page pool's bound (kv/paging.py)
        room = (f"the memory limit of {self.limits.memory_bytes / 2**30:.1f} GiB beside the weights"
                if self.limits is not None else "the hot budget")
        why = (f" (the KV of {limit} tokens is what the page pool may hold: {self.pages.pool.limit} pages, of {room})"
               if by_pages else f" (the KV of {limit} tokens is what fits {room})" if by_memory else "")
        raise ContextTooLongError(f"prompt is too long: {tokens} tokens > {limit - 1} maximum{why}",
                                  tokens=tokens, limit=limit, bound="memory" if by_memory else "context")

    def check_structure(self, params: GenerateParams, tools: list[dict[str, Any]] | None) -> None:
        """Compile the call's structure now (kept for the call): InvalidParamsError before any compute."""
        if params.structure is not None:
            self.grammars.matcher(params.structure, tools)

    def constraint(self, params: GenerateParams, tools: list[dict[str, Any]] | None,
                   prompt: list[int] = ()) -> Constraint | None:
        """The grammar state a constrained call from `prompt` decodes under (None: unconstrained)."""
        if params.structure is None:
            return None
        grammars = self.grammars
        matcher = grammars.matcher(params.structure, tools, grammars.opened_thought(list(prompt)))
        return Constraint(matcher, grammars.eos_ids, grammars.eos)

    def fit(self, params: GenerateParams, tokens: int) -> GenerateParams:
        """`params` with max_tokens capped to what the context (and memory) has left after `tokens`;
        ContextTooLongError (`check_fits`) when nothing is left."""
        limit = self.max_tokens
        if limit is not None and tokens >= limit:
            self.check_fits(tokens)
        room = limit - tokens if limit is not None else params.max_tokens
        return dataclasses.replace(params, max_tokens=room) if params.max_tokens > room else params

    # -- sleep and wake -------------------------------------------------------

    def sleep(self, session: Session, *, label: str | None = None, free: bool = True,
              mlx: Mlx = direct) -> dict[str, Any]:
        """Write the session's KV as a snapshot and free it (kv/pipeline.py). On failure the session stays hot.

        Its running persistence checkpoint is waited for and replaced: the blocks it wrote are reused."""
        phases = Phases()
        if session.processed:  # its restore points whose copies wait for idle time: stored before the snapshot
            self.points.hurry(mlx, session.id)  # (an empty one, a new session's, has none)
        supersede = self.persister.settle(session.id)
        phases.mark("settle")  # its running checkpoint waited for
        info = pipeline.sleep(self.kv, session, mlx, label=label, free=free, supersede=supersede)
        self.persister.stored(session.id, info["tokens"])
        info["ms"] = round(info["ms"] + phases.ms["settle"], 3)
        info["phases_ms"] = {**phases.ms, **info["phases_ms"]}
        return info

    def release(self, session: Session, mlx: Mlx = direct) -> None:
        """Free the session's KV on the engine thread, layer by layer (kv/pipeline.py); its tokens stay."""
        pipeline.release(session, mlx)

    def wake(self, session_id: str, snapshot_id: str | None = None, mlx: Mlx = direct, *,
             record: SnapshotRecord | None = None, prefix: tuple[list, int] | None = None) -> tuple[Session, dict[str, Any]]:
        """Restore a session from its latest (or a given) snapshot, exactly (kv/pipeline.py); `record`: the
        snapshot's verified record, read already (`record`), so it is not read again; `prefix`: its first
        blocks from another cache holding them (`wakes_share`; pipeline.wake)."""
        self.persister.forget(session_id)  # a hot session woken from another snapshot: its old self writes no more
        if self.pages is not None:  # its blocks resident as the store's bytes are mapped, not read
            record = record or self.record(snapshot_id or self.store.latest_snapshot(session_id))
            prefix = self.pages.wake_prefix(self.kv.make_cache, record, prefix, mlx)
        session, info = pipeline.wake(self.kv, session_id, snapshot_id, mlx, record=record, prefix=prefix,
                                      pages=self.pages.pool if self.pages is not None else None)
        if self.pages is not None:  # its blocks into pages: held once by every session woken over them
            mlx(lambda: self.pages.adopt(session))
        self.persister.stored(session_id, session.processed)
        return session, info

    def persist(self, session: Session, mlx: Mlx, turn: bool = False) -> None:
        """Write the session's new full blocks in the background (kv/persist.py), when persistence is on and
        the session has a snapshot already (a daemon's session; a scratch session never has one). `turn`:
        a call ended; its state is committed even without a new block."""
        if session.head is not None:
            self.persister.offer(session, mlx, turn)

    def forget(self, session_id: str) -> None:
        """A deleted session: wait for its running checkpoint, write nothing more of it."""
        self.persister.forget(session_id)


    def record(self, snapshot_id: str) -> SnapshotRecord:
        """A snapshot's verified record; BundleMismatchError (with the differences) for another model's."""
        return self.kv.record(snapshot_id)

    # -- shared prompts -------------------------------------------------------

    def check_warmable(self) -> None:
        """A prompt can be warmed where its blocks serve a new session: the cache cuts by token, or restore
        points are taken (kv/points.py: the warm's prefill takes one at the prompt's last block boundary)."""
        if not (self.cuttable or self.points.enabled):
            raise InvalidParamsError(f"{self.model_name} keeps state that cannot be cut by token (sliding window or "
                                     "recurrent layers) and takes no restore points here: prefix blocks cannot be "
                                     "reused; checkpoint and fork instead")

    def warm(self, *, messages: Any = None, text: Any = None, tokens: Any = None, mlx: Mlx = direct,
             scratch: Session | None = None, prompt: Plan | None = None,
             prefix: tuple[list | None, int] | None = None) -> dict[str, Any]:
        """Prefill a shared prompt once and pin all of it in the prefix cache (its last partial block as a
        short block). `scratch`: the throwaway session to prefill in (the daemon keeps it to publish its
        tokens to the remote tier); `prompt`: its plan, made and checked already; `prefix`: what its caller
        found for it (a hot session's copy or stored blocks; (None, 0): nothing), else the store is asked."""
        self.check_warmable()
        scratch = scratch if scratch is not None else Session(id="prefix-warm")
        plan = prompt
        if plan is None:  # a prompt given was planned and checked by its caller
            plan = self.plan(scratch, messages=messages, text=text, tokens=tokens)
            self.check_fits(len(plan.target))
        if prefix is None:  # one given was looked for by its caller (a hot copy, then stored blocks)
            prefix = self.stored_prefix(plan.target, mlx) if self.wants_prefix(scratch, plan.target) else (None, 0)
        self.apply(scratch, plan, prefix, mlx)
        self.prefill(scratch, len(scratch.tokens), mlx)  # the pending last token too: all of it is stored
        info = pipeline.write_prefix(self.kv, scratch, mlx)
        return {"tokens": len(scratch.tokens), "blocks": scratch.processed // self.block_tokens,
                "new_blocks": info.new_blocks, "stored_bytes": info.stored_bytes}


