"""The engine: one loaded MLX model, the sessions it runs, and their sleep and wake.

All MLX work happens on one thread. Every operation takes `mlx`, the runner for
its MLX steps (kv/context.py): `direct` when the caller is that thread (the
in-process API tests and bench/ use), `EngineThread.call` when it is a worker
thread (the daemon's session manager). Either way the operation is this code:
sleep and wake are `kv/pipeline.py` (codec and disk work on the `Pool`, every
core by default, bounded by bytes in flight), appends are plan, prefix, apply.

Prefix reuse: before a cold prefill, the engine asks the store for the longest
run of stored full blocks that starts the tokens (under this bundle), restores
them (from the RAM tier when hot, else disk) and prefills only the rest; the
daemon first offers a hot session's copy (`shared`). Models whose caches cannot
be cut by token (sliding windows, recurrent state) only reuse whole snapshots:
their prefix reuse is off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from kvwake.daemon.kv import capacity as kvcapacity
from kvwake.daemon.kv import devplanes, fill, pipeline, prefixhit, state
from kvwake.daemon.kv.bundle import Bundle, describe_bundle
from kvwake.daemon.kv.context import KvContext, Mlx, Packed, direct, quantize_cache
from kvwake.daemon.kv.hotblocks import HotBlocks
from kvwake.daemon.kv.persist import Persister
from kvwake.daemon.kv.pool import Pool
from kvwake.daemon.model import attention, memory, packing, prefillslices
from kvwake.daemon.model.convert import DEFAULT_MODEL_NAME, ensure_default_model
from kvwake.daemon.model.calls import Call, batch_mode
from kvwake.daemon.model.decoder import Decoder, run_alone
from kvwake.daemon.model.generation import GenerateParams, GenerateResult, OnEvent, TextOutput
from kvwake.daemon.model.grammar import Grammars
from kvwake.daemon.model.masks import Constraint
from kvwake.daemon.model.prompt import Plan, Prompter
from kvwake.daemon.phases import Phases
from kvwake.daemon.session import Session, common_prefix
from kvwake.errors import CancelledError, ContextTooLongError, InvalidParamsError
from kvwake.store import SnapshotRecord, Store

__all__ = ["CONTENT_FORMAT", "Engine", "Plan", "Shared", "ShouldStop", "resolve_model"]

# What a block's payload means (kv/state.py's naming), as the bundle hash records it. Frozen at the
# value kvwake 0.1 hashed: the compression codec and the file format are per file (each block
# file says its own), so switching codec or file format never orphans a store's snapshots.
T = TypeVar("T")
CONTENT_FORMAT = ("planes-zstd+kvstate1", 1)
# A source of a prefix another session holds in memory: (cache, tokens) for a target, or (None, 0).
Shared = Callable[[list[int]], tuple[list | None, int]]
# Asked between prefill chunks: True when the caller is gone (a client that left, a daemon stopping).
ShouldStop = Callable[[], bool] | None


log = logging.getLogger("kvwake.engine")

THINK_LOOKBACK = 64  # tokens at a prompt's end where a template's opened thinking span is looked for
BUCKET_AHEAD_AFTER = 4096  # a prefill of this many tokens ends by building the next turn's likeliest buckets,
BUCKETS_AHEAD = 2  # this many (128 and 192 queries: turns of 65-192 tokens; one build each, ~60-90 ms on the GPU)
# Turns whose short chunks come at once prefill in one forward pass from this many (model/packing.py);
# KVWAKE_PACK_PREFILL=0 turns packing off (bench/turns_at_once.py compares)
PACK_MIN = 2
PACK_PADDING = 2.0  # a pack computes at most this many times its rows' tokens (right-padded to the longest)
PACK_PREFILL = os.environ.get("KVWAKE_PACK_PREFILL", "1") != "0"
# A packed slice takes at most this many decode steps' time however many turns it feeds (0: no cap;
# KVWAKE_PACK_SHARE_MAX; bench/turns_at_once.py measures the talker's gaps against the turns' first tokens)
PACK_SHARE_MAX = float(os.environ.get("KVWAKE_PACK_SHARE_MAX", "0"))
PLAIN_BEFORE_BUILD = 2  # a full chunk's new fused shape runs plain beside decoding this often, then is built


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


class Engine:
    """Holds one model and runs sessions on it: one operation per session at a time, MLX work through `mlx`."""

    def __init__(
        self,
        store: Store,
        data_dir: Path,
        model: str | Path | None = None,
        *,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        hot_bytes: int = 256 << 20,
        prefill_step: int = 512,
        io_workers: int | None = None,
        io_inflight_bytes: int = 512 << 20,
        max_batch: int = 32,
        max_context: int | None = None,
        limits: memory.Limits | None = None,
        persist: bool = False,
        warm: bool = True,
    ) -> None:
        self.store, self.prefill_step = store, prefill_step
        self.started = Phases()  # where the engine's start went (the daemon logs it with "ready")
        self.model_path, self.model_name = resolve_model(model, Path(data_dir))
        if attention.on_cuda():  # buffers off cuDNN's 256-token grid below 16k tokens (kv/capacity.py)
            kvcapacity.install()
        self.model, self.tokenizer = mlx_lm.load(str(self.model_path))
        mx.eval(self.model.parameters())
        self.weights_bytes = mx.get_active_memory()
        self.started.mark("weights")
        known = [n for n in (context_length(self.model_path), max_context) if n]
        self.context_length = min(known) if known else None
        probe = quantize_cache(make_prompt_cache(self.model), kv_bits, kv_group_size)
        self.bundle: Bundle = describe_bundle(
            self.model_path, kv_layout=state.layout(probe, model=self.model), block_tokens=store.block_tokens,
            codec=CONTENT_FORMAT[0], codec_version=CONTENT_FORMAT[1],
            digest_cache=Path(data_dir) / "digests.json",
            model_name=self.model_name,
        )
        store.register_bundle(self.bundle.hash, self.bundle.description)
        self.started.mark("bundle")
        self.kv = KvContext(store=store, bundle=self.bundle, model=self.model, hot=HotBlocks(hot_bytes),
                            pool=Pool(io_workers, io_inflight_bytes), vocab_size=self._vocab_size(),
                            cuttable=state.cuttable(probe), kv_bits=kv_bits, kv_group_size=kv_group_size,
                            # KV on a discrete GPU: byte planes are made there
                            device_planes=fill.restore_mode() == "staged")
        self.hot, self.pool, self.counters, self.cuttable = self.kv.hot, self.kv.pool, self.kv.counters, self.kv.cuttable
        self.prompter = Prompter(self.tokenizer, self.kv.vocab_size, self.model_name)
        self.template = self.prompter.template
        self.decode_mode, self.decode_reason = batch_mode(probe, kv_bits, max_batch)
        self.cuda_graphs = attention.cuda_graphs()  # fixed for the process: MLX reads the variable once
        self.decoder = Decoder(self.model, self.decode_mode, max_batch, self.kv.vocab_size)
        self.grammars = Grammars(self.tokenizer, self.kv.vocab_size)
        self.plain_prefill = attention.wanted()  # CUDA: no cuDNN graph build per new chunk shape
        # Which path a short chunk's attention takes, measured at this model's shape (warm_jobs); until
        # then, and off CUDA, short chunks take the plain ops.
        self.paths: attention.PathCosts | None = None
        # A short chunk over a long cache runs fused at a shared shape (attention.bucketed_attention)
        self.bucket_prefill = attention.bucket_wanted()
        # Runs a job on the engine thread when nothing else waits (the daemon's EngineThread.idle): the next
        # turns' shared shapes built ahead. None (in-process use): built when first met.
        self.idle: Callable[[Callable[[], Any]], None] | None = None
        self._bucket_warming: set[tuple[Any, ...]] = set()
        # chunks' shapes run fused: attention.fused_shape, or ("bucket", *attention.bucket_shape)
        self._fused_shapes: set[tuple[Any, ...]] = set()
        self._plain_shapes: dict[tuple[Any, ...], int] = {}  # new ones run plain beside decoding, how often
        self.slicer = prefillslices.Slicer()  # a long prefill's layers in slices while other calls decode
        self.slice_prefill = True  # off: whole chunks beside decoding too (bench/prefill_slices.py compares)
        # several sessions' short chunks in one forward pass: where calls batch (the same exactness class)
        self.pack_prefill = PACK_PREFILL and self.decode_mode == "batched" and packing.packable_model(self.model)
        self.started.mark("set_up")
        self.token_bytes = memory.kv_token_bytes(self.model, kv_bits, kv_group_size)  # the first forward pass
        self.started.mark("first_forward")
        # The most tokens one session may hold: its KV must fit the memory limit (model/memory.py).
        self.session_tokens = memory.session_tokens(limits, self.weights_bytes, self.token_bytes) if limits else None
        self.limits = limits
        # What hot sessions' KV may hold when the settings name no budget (model/memory.py hot_budget), and
        # what all of it may hold: a wake or a prefill that would pass it sleeps others first (SessionManager)
        self.hot_budget_bytes = memory.hot_budget(limits, self.weights_bytes) if limits else memory.DEFAULT_HOT_BUDGET
        self.kv_room_bytes = memory.kv_room(limits, self.weights_bytes) if limits else None
        self.persister = Persister(self.kv, persist)  # full blocks written as they fill (kv/persist.py)
        if warm:  # last: a warm-up's caches are sized against the room the limits leave
            for job in self.warm_jobs():
                job()
            self.started.mark("warm")

    def warm_jobs(self) -> list[Callable[[], Any]]:
        """What makes the first requests fast on CUDA, as short jobs for the engine thread (run at once
        unless made with warm=False; the daemon runs them after it answers): each batch size's kernels
        built (MLX compiles per shape), a lone session's decode graphs at a few cache capacities
        (attention.warm_decode), then the attention paths' costs measured per key length. None elsewhere."""
        jobs: list[Callable[[], Any]] = []
        if attention.on_cuda():
            jobs += [lambda n=n: self.decoder.warm_size(n) for n in self.decoder.warm_sizes()]
            # a session decoding alone: cuDNN's decode graphs (their first builds take ~0.5-1 s each)
            jobs += [lambda c=c: attention.warm_decode(self.model, c) for c in attention.decode_warm_capacities()]
        if attention.on_cuda() and fill.restore_mode() == "staged":
            jobs.append(self._warm_staging)
        if self.plain_prefill:  # the plain path at each class of shape MLX builds kernels for (plain_warm_shapes)
            room = self.kv_room_bytes if self.kv_room_bytes is not None else float("inf")
            jobs += [lambda q=q, k=k: attention.warm_plain(self.model, q, k)
                     for q, k in attention.plain_warm_shapes(self.prefill_step, self.context_length)
                     if self.kv_bytes(q + k) <= room / 2]  # its cache made for it: beside room for sessions
            jobs += attention.PathCosts.steps(self.model, attention.key_ladder(self.context_length),
                                              lambda costs: setattr(self, "paths", costs))
        return jobs

    def _warm_staging(self) -> bool:
        """A wake's staging ring made and kept, its joins compiled (devplanes.warm), for plain KV caches."""
        cache = self.make_cache()
        if not cache or not all(type(c) is KVCache for c in cache):
            return False
        mx.eval(self.model(mx.array([[0]], dtype=mx.uint32), cache=cache))
        return devplanes.warm(cache[0].keys, 2 * len(cache), self.block_tokens)

    def close(self) -> None:
        self.persister.close()
        self.pool.close()
        devplanes.drop_idle()

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
        """A fresh cache; with kv_bits, plain KV layers are quantized (mlx-lm cannot quantize the others)."""
        return self.kv.make_cache()

    def cache_bytes(self, session: Session) -> int:
        """Bytes of the session's KV in memory (0 while it has none)."""
        return state.cache_nbytes(session.cache) if session.cache is not None else 0

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of the KV buffer a session of `tokens` tokens holds (as its growth makes it)."""
        return kvcapacity.capacity(tokens) * self.token_bytes if tokens > 0 else 0

    def copy_prefix(self, session: Session, n_tokens: int) -> list:
        """A new cache holding the first n_tokens of the session's (MLX work); the session keeps its own."""
        return state.copy_prefix(session.cache, n_tokens)

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
        """The most tokens a session may hold: the model's context (or `max_context`), and what its KV
        may take of the memory limit, whichever is less; None when neither is known."""
        known = [n for n in (self.context_length, self.session_tokens) if n is not None]
        return min(known) if known else None

    def check_fits(self, tokens: int) -> None:
        """A prompt of `tokens` must leave room for one generated token in the model's context and in the
        memory a session may take; raises ContextTooLongError otherwise (callers check before any prefill)."""
        limit = self.max_tokens
        if limit is None or tokens < limit:
            return
        by_memory = limit != self.context_length  # the least of the two, and not the context's: memory's
        why = (f" (the KV of {limit} tokens is what fits the memory limit of {self.limits.memory_bytes / 2**30:.1f} GiB "
               f"beside the weights)") if by_memory else ""
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
        """`params` with max_tokens capped to what the context (and memory) has left after `tokens` (not refused)."""
        self.check_fits(tokens)
        limit = self.max_tokens
        room = limit - tokens if limit is not None else params.max_tokens
        return dataclasses.replace(params, max_tokens=room) if params.max_tokens > room else params

    def plan(self, session: Session, **inputs: Any) -> Plan:
        """What appending `inputs` will make of the session (Prompter.plan); changes nothing."""
        return self.prompter.plan(session, **inputs)

    def append(self, session: Session, *, messages: Any = None, text: Any = None, tokens: Any = None,
               tools: Any = None, whole: bool = False, prompt: Plan | None = None, mlx: Mlx = direct,
               shared: Shared | None = None, should_stop: ShouldStop = None,
               room: Callable[[int], Any] | None = None) -> dict[str, int]:
        """Add input and prefill it (all but the last token, which stays pending).

        The input is rendered on the caller's thread, not the engine's, so decoding goes on meanwhile
        (once: `prompt` is one `render` made already), then `room` is told the tokens the session will
        hold, before anything is restored or prefilled.
        A session that needs a fresh cache takes the longest prefix `shared` offers (another
        session's, in memory), else the one the prefix cache holds. Store and codec work run on
        the caller's thread and the pool, MLX work through `mlx`, one prefill chunk per call.
        Returns {"tokens": total, "prefilled": n, "reused": n from the prefix cache}. Raises
        CancelledError when `should_stop` says so between chunks (see `prefill`).
        """
        plan = self.plan(session, messages=messages, text=text, tokens=tokens, tools=tools, whole=whole,
                         prompt=prompt)
        self.check_fits(len(plan.target))  # before any prefill
        if room is not None:
            room(len(plan.target))
        return self.apply(session, plan, self.prefix_cache(session, plan.target, mlx, shared), mlx, should_stop)

    def _keep(self, session: Session, target: list[int]) -> int:
        """How much of the session's cache stays valid for `target` (at least one token stays pending)."""
        return min(common_prefix(session.tokens[: session.processed], target), len(target) - 1)

    def needs_fresh_cache(self, session: Session, target: list[int], keep: int | None = None) -> bool:
        """True when appending `target` cannot keep the session's cache (none yet, or it cannot be cut back);
        `keep`: `_keep(session, target)` when the caller has it."""
        if session.cache is None:
            return True
        keep = self._keep(session, target) if keep is None else keep
        return keep < session.processed and not can_trim_prompt_cache(session.cache)

    def prefix_cache(self, session: Session, target: list[int], mlx: Mlx = direct,
                     shared: Shared | None = None) -> tuple[list | None, int]:
        """A cache restored for `target` when the session will need a fresh one: from `shared` (a copy
        of another session's) when it offers one, else from stored blocks (kv/prefixhit.py).

        Returns (cache or None, tokens it holds). A bad block shortens the hit; it never fails the append.
        """
        if not self.cuttable or len(target) < 2 or not self.needs_fresh_cache(session, target):
            return None, 0
        if shared is not None:
            copied = shared(target)
            if copied[0] is not None:
                return copied
        return prefixhit.stored_prefix(self.kv, target, mlx)

    def apply(self, session: Session, plan: Plan, prefix: tuple[list | None, int] = (None, 0),
              mlx: Mlx = direct, should_stop: ShouldStop = None) -> dict[str, int]:
        """Make the cache cover plan.target[:-1]: keep the common prefix, take `prefix` (a restored cache), prefill the rest.

        MLX work goes through `mlx` one chunk at a time, so other sessions decode between the chunks.
        """
        upto = len(plan.target) - 1
        args = (session, plan, prefix, upto, should_stop)
        reused, chunk = mlx(Packed(self._adopt_and_start, self._start_turns, args) if self.pack_prefill else
                            lambda: self._adopt_and_start(*args))
        prefilled = self.prefill(session, upto, mlx, should_stop, chunk)
        self.persist(session, mlx)  # also when a restored prefix left nothing to prefill
        return {"tokens": len(plan.target), "prefilled": prefilled, "reused": reused}

    def _adopt_and_start(self, session: Session, plan: Plan, prefix: tuple[list | None, int], upto: int,
                         should_stop: ShouldStop = None) -> tuple[int, prefillslices.Chunk | None]:
        """`_adopt`, then the first prefill chunk queued (when there is one and `should_stop` does not say
        stop: `prefill` then raises before any chunk), in one engine job: while calls decode a job waits for
        a step, and a turn's first token one job fewer."""
        reused = self._adopt(session, plan, prefix)
        start = session.processed < upto and not (should_stop is not None and should_stop())
        return reused, self._prefill_chunk(session, upto) if start else None

    def _start_turns(self, jobs: list[Packed]) -> list[Any]:
        """The `_adopt_and_start` of every turn queued at once (a Packed job each, model/thread.py), in one
        job: each cache adopted, then the first chunks queued (`_queue_chunks`: in packs where they can). One
        turn: `_adopt_and_start` itself, as before packing. An item is (tokens reused, the chunk queued or
        None), or the exception of that turn's adoption."""
        if len(jobs) == 1 or not self.pack_prefill:
            return [_outcome(lambda job=job: self._adopt_and_start(*job.args)) for job in jobs]
        results: list[Any] = []
        rows: list[tuple[int, Session, int]] = []  # (its result's index, session, upto) of each that starts a chunk
        for job in jobs:
            session, plan, prefix, upto, should_stop = job.args
            # One turn's failure (its adoption, its caller's should_stop) is that turn's item alone.
            reused = _outcome(lambda: (self._adopt(session, plan, prefix),
                                       should_stop is not None and session.processed < upto and should_stop()))
            results.append(reused if isinstance(reused, BaseException) else [reused[0], None])
            if not isinstance(reused, BaseException) and session.processed < upto and not reused[1]:
                rows.append((len(results) - 1, session, upto))
        for (i, _, _), chunk in zip(rows, self._queue_chunks([(session, upto) for _, session, upto in rows])):
            results[i] = chunk if isinstance(chunk, BaseException) else [results[i][0], chunk]
        return [r if isinstance(r, BaseException) else tuple(r) for r in results]

    def _next_chunks(self, jobs: list[Packed]) -> list[Any]:
        """The next `_prefill_chunk` of every prefill queued at once (a Packed job each), in one job."""
        if len(jobs) == 1 or not self.pack_prefill:
            return [_outcome(lambda job=job: self._prefill_chunk(*job.args)) for job in jobs]
        return self._queue_chunks([job.args for job in jobs])

    def _queue_chunks(self, rows: list[tuple[Session, int]]) -> list[Any]:
        """Each session's next chunk towards its `upto`: those of plain KV layers in packs (`pack_groups`:
        PACK_MIN or more, padding bounded), one forward pass each (model/packing.py), the others alone. An
        item is the chunk (shared by a pack's sessions) or the exception queuing it raised."""
        out: list[Any] = [None] * len(rows)
        packs = pack_groups([(i, self._chunk_end(session, upto) - session.processed)
                             for i, (session, upto) in enumerate(rows)
                             if session.cache is not None and all(type(c) is KVCache for c in session.cache)])
        packed = {i for pack in packs for i in pack}
        for i, (session, upto) in enumerate(rows):
            if i not in packed:
                out[i] = _outcome(lambda: self._prefill_chunk(session, upto))
        for pack in packs:
            chunk = _outcome(lambda: self._pack_chunk([rows[i] for i in pack]))
            for i in pack:
                out[i] = chunk
        return out

    def _pack_chunk(self, rows: list[tuple[Session, int]]) -> prefillslices.Chunk:
        """Queue one forward pass feeding each session of `rows` (session, upto) its next chunk (`_chunk_end`),
        each row's attention on the path its chunk alone would take; computed all at once when nobody
        decodes, else a slice of layers per step (a Chunk of several sessions)."""
        sliced = self.slice_prefill and self.decoder.active
        ends = [(session, self._chunk_end(session, upto), upto) for session, upto in rows]
        paths = [self._path(session, end - session.processed, end, sliced)[1] or _fused for session, end, _ in ends]
        try:
            packing.forward(self.model, [(session.tokens[session.processed : end], session.cache)
                                         for session, end, _ in ends], paths)
        except BaseException:  # caches part-fed (their offsets moved layer by layer): rebuilt from tokens on next use
            for session, _, _ in ends:
                session.cache, session.processed = None, 0
            raise
        for session, end, upto in ends:
            if end == upto:  # its prefill's last chunk: the next turn's shapes, once the engine is idle
                self._warm_buckets(session, end - session.processed)
        longest = max(end - session.processed for session, end, _ in ends)
        (first, end, _), more = ends[0], [(session, end) for session, end, _ in ends[1:]]
        # A slice's time is shared by the sessions on each side: N turns waiting beside D decoding calls take
        # slices of N / D steps (at least one). One step each, 16 turns packed beside one talker took 32
        # slices, 32 steps between them (H100, 8B: first tokens 1.4 s for 3k tokens of prefill work).
        share = max(1.0, len(rows) / max(1, self.decoder.running))
        if PACK_SHARE_MAX:
            share = min(share, max(1.0, PACK_SHARE_MAX))
        chunk = prefillslices.Chunk(first, end, self.slicer,
                                    self.decoder.step_s * prefillslices.SLICE_OF_STEP * share if sliced else None,
                                    kind=prefillslices.kind("packed", max(end for _, end, _ in ends)),
                                    more=more, padded=len(rows) * longest)
        self.counters.add("prefill_packs", 1)
        self.counters.add("prefill_packed_chunks", len(rows))
        if not sliced:
            chunk.step()
        return chunk

    def _adopt(self, session: Session, plan: Plan, prefix: tuple[list | None, int]) -> int:
        """Cut the session's cache back to what plan.target keeps (or take `prefix`); returns tokens reused."""
        target, keep = plan.target, self._keep(session, plan.target)
        if self.needs_fresh_cache(session, target, keep):
            session.cache, session.processed = None, 0  # recurrent or wrapped ring state cannot be rewound
        elif keep < session.processed:
            trim_prompt_cache(session.cache, session.processed - keep)
            session.processed = keep
        reused = 0
        if session.cache is None:
            cache, reused = prefix
            session.cache = cache if cache is not None else self.make_cache()
            session.processed = reused
            self.counters.add("tokens_reused", reused)
        session.mode, session.messages, session.tools, session.tokens = plan.mode, plan.messages, plan.tools, target
        return reused

    def prefill(self, session: Session, upto: int, mlx: Mlx = direct, should_stop: ShouldStop = None,
                chunk: prefillslices.Chunk | None = None) -> int:
        """Feed session.tokens[processed:upto] to the model, one chunk per `mlx` call (a slice of
        layers per call while other calls decode); returns how many. `chunk`: the first chunk, queued
        already (`_adopt_and_start`; it may be computed too).

        `should_stop` is asked before each chunk: when it says so, CancelledError (with the tokens
        prefilled and to prefill). The session stays consistent: its input is kept, the cache covers
        what was prefilled, and the next call prefills the rest (as a generation a client left keeps
        the tokens it made).
        """
        start = session.processed if chunk is None else chunk.start_of(session)
        try:
            while chunk is not None or session.processed < upto:
                if chunk is None:
                    if should_stop is not None and should_stop():
                        raise CancelledError(f"session {session.id}: prefill stopped after "
                                             f"{session.processed - start} of {upto - start} tokens (the client "
                                             "left, or the daemon is stopping)", session_id=session.id,
                                             prefilled=session.processed - start, tokens=upto - start)
                    chunk = mlx(Packed(self._prefill_chunk, self._next_chunks, (session, upto)) if self.pack_prefill
                                else lambda: self._prefill_chunk(session, upto))
                try:
                    while not chunk.done:
                        mlx(chunk.step_job)  # a packed chunk's callers: one job for those queued together
                finally:
                    if not chunk.done:  # a slice's job did not run to its end: nothing may wait on the rest
                        mlx(chunk.abandon)
                chunk = None
                self.persist(session, mlx)
        finally:
            self.counters.add("tokens_prefilled", session.processed - start)
        if upto - start >= BUCKET_AHEAD_AFTER:
            self._bucket_ahead(session, mlx)
        return upto - start

    def chunk_end(self, processed: int, upto: int) -> int:
        """Where the prefill chunk from `processed` ends: at the next multiple of the prefill step (or `upto`).

        Aligned, every full chunk's key length is a multiple of the step whatever the turn or prefix hit
        before it, so MLX on CUDA builds one cuDNN graph per (step, multiple), not one per chunk (about
        100 ms each); the short chunk that reaches the boundary is a turn's input or a hit's remainder.
        """
        step = self.prefill_step
        return min(upto, (processed // step + 1) * step)

    def _chunk_end(self, session: Session, upto: int) -> int:
        """Where the session's next prefill chunk ends: `chunk_end`, or `upto` for a turn's input that runs at
        one query bucket (no boundary to keep: its graph is the bucket's)."""
        end = self.chunk_end(session.processed, upto)
        if end < upto and self._bucketed(session.cache, upto - session.processed):
            end = upto
        return end

    def _prefill_chunk(self, session: Session, upto: int) -> prefillslices.Chunk:
        """Queue the next chunk's forward pass and compute all of it, or, while other calls decode, nothing
        yet (the `Chunk` computes it a slice of layers per `step`, one per engine job)."""
        if session.cache is None:  # dropped under it (a failed pass of a pack it was in): nothing to feed
            raise RuntimeError(f"session {session.id}: its cache was dropped before its chunk to {upto}")
        end = self._chunk_end(session, upto)
        sliced = self.slice_prefill and self.decoder.active  # a decoding neighbour waits one slice, not the chunk
        n = end - session.processed
        path, make = self._path(session, n, end, sliced)
        with attention.swapped(self.model, make) if make else contextlib.nullcontext():
            self.model(mx.array(session.tokens[session.processed : end], dtype=mx.uint32)[None], cache=session.cache)
        if end == upto:  # the prefill's last chunk: the next turn's shapes, once the engine is idle
            self._warm_buckets(session, n)
        chunk = prefillslices.Chunk(session, end, self.slicer,
                                    self.decoder.step_s * prefillslices.SLICE_OF_STEP if sliced else None,
                                    kind=prefillslices.kind(path, end))
        if not sliced:  # all of it in this job; sliced, the graph's building is a job of its own (~10-20 ms
            chunk.step()  # in Python for the 8B shape), and its slices the next ones
        return chunk

    def _path(self, session: Session, n: int, end: int, sliced: bool) -> tuple[str, Callable[[Any], Any] | None]:
        """The attention path of a chunk of n tokens of the session's (to `end`): ("plain" | "bucket" |
        "fused", what makes its attention from the model's fused one; None: the fused one itself). Records
        the shapes run fused, and those run plain beside decoding."""
        # A chunk shorter than the step (a turn's input, a prompt's last piece) has a key length nothing
        # computed before: plain attention spares it a cuDNN graph build, where plain ops cost less than
        # the build at this key length (measured: attention.PathCosts). Full chunks stay fused: their
        # shapes recur (aligned), and beside decoding 128-token chunks over 8k took 3.0 s plain against
        # 1.5 s fused (model/attention.py) -- unless a neighbour decodes and the graph would be new to
        # this process: its build (~90 ms on the H100, in the chunk's first slice) is a gap of a dozen
        # decode steps; plain, the neighbour waits one slice (the prefill itself takes longer). A shape
        # that comes back (PLAIN_BEFORE_BUILD times plain) is built then: its build pays for itself.
        # Past CUDNN_MIN such a chunk runs fused at its query bucket over the whole buffer: turns within
        # one capacity share its graph (attention.bucketed_attention), built once, not once per turn.
        is_short = n < self.prefill_step and n <= attention.PLAIN_MAX_QUERIES
        bucket = self._bucketed(session.cache, n)
        shape = ("bucket", *bucket) if bucket else attention.fused_shape(session.cache, n) if self.plain_prefill else None
        new = shape is None or shape not in self._fused_shapes  # unknown (not a plain KVCache): counted new
        short = is_short and (self.paths is None or self.paths.plain(n, end, new, bucket))
        new_beside = sliced and shape is not None and new and self._plain_shapes.get(shape, 0) < PLAIN_BEFORE_BUILD
        if new_beside:
            self._plain_shapes[shape] = self._plain_shapes.get(shape, 0) + 1
        plain = self.plain_prefill and (short or new_beside)
        if self.plain_prefill and not plain and shape is not None:
            self._fused_shapes.add(shape)  # the one record of shapes run fused (their graphs built)
        if plain:
            queries = max(n, attention.PLAIN_MAX_QUERIES)
            return "plain", lambda fused: attention.plain_attention(fused, queries)
        return ("bucket", attention.bucketed_attention) if bucket else ("fused", None)

    def _bucketed(self, cache: list, n: int) -> tuple[int, int] | None:
        """The shared shape a chunk of n tokens fed to `cache` would run on (attention.bucket_shape), for a
        short chunk (2 tokens to below the prefill step and PLAIN_MAX_QUERIES: one query takes the decode
        kernel) while bucketed prefill is on; else None."""
        if not (self.bucket_prefill and 2 <= n < self.prefill_step and n <= attention.PLAIN_MAX_QUERIES):
            return None
        return attention.bucket_shape(cache, n)

    def _turn_buckets(self, cache: list, n: int) -> tuple[int, list[int]] | None:
        """(the capacity `cache` has once fed n more tokens, every query bucket of a turn there, likeliest
        first), or None when no later turn would share those graphs: bucketed prefill off, not a plain
        KVCache past CUDNN_MIN, or a buffer off the capacity grid (a batch's or a copy's, trimmed; its
        next growth puts it back on the grid)."""
        if not self.bucket_prefill or not cache or attention.bucket_shape(cache, max(n, 1)) is None:
            return None
        capacity = kvcapacity.grown(cache[0], n)
        if kvcapacity.capacity(capacity) != capacity:
            return None
        return capacity, attention.query_buckets(min(attention.PLAIN_MAX_QUERIES, self.prefill_step - 1))

    def _warm_buckets(self, session: Session, n: int) -> None:
        """The shared shapes of the next turns over the session's cache once fed n more tokens, built as
        idle jobs: when nothing else waits. Built ones and queued ones are skipped; so is one whose
        session holds another capacity by its turn (grown, or gone)."""
        turn = self._turn_buckets(session.cache, n) if self.idle is not None else None
        for bucket in turn[1] if turn else ():
            shape = ("bucket", bucket, turn[0])
            if shape not in self._fused_shapes and shape not in self._bucket_warming:
                self._bucket_warming.add(shape)
                self.idle(lambda shape=shape, ref=weakref.ref(session): self._warm_bucket(shape, ref))

    def _bucket_ahead(self, session: Session, mlx: Mlx) -> None:
        """After a long prefill, nobody decoding: the likeliest turns' shared shapes at the cache's capacity
        (BUCKETS_AHEAD of them) built now, one job each (a graph build, ~60-90 ms on the GPU at 75k keys, on a
        prefill of seconds), not by the next turn: a client that sends it at once leaves no idle time to build
        it in (on the H100 its first token took 196-245 ms against 120-150 for the turns after; on the H200 a
        131-token turn, bucket 192, took 203 ms when only 128 was built ahead, 104-137 ms after). Beside a
        decoding call (a gap) the idle jobs build them."""
        turn = self._turn_buckets(session.cache, 0)
        for bucket in turn[1][:BUCKETS_AHEAD] if turn else ():
            shape = ("bucket", bucket, turn[0])
            if shape not in self._fused_shapes:
                mlx(lambda shape=shape: self.decoder.active or self._warm_bucket(shape, weakref.ref(session)))

    def _warm_bucket(self, shape: tuple[Any, ...], session: weakref.ref) -> None:
        """Build `shape`'s graph (attention.warm_bucket) for the session's buffer if it still has that
        capacity. Only speed is at stake: a failure is logged, never raised."""
        self._bucket_warming.discard(shape)
        s = session()
        layer = s.cache[0] if s is not None and s.cache else None
        if shape in self._fused_shapes or type(layer) is not KVCache or layer.keys is None or \
                layer.keys.shape[2] != shape[2]:
            return  # built meanwhile, or its session's cache is gone or holds another capacity now
        try:
            if attention.warm_bucket(self.model, shape[1], shape[2], like=layer.keys):
                self._fused_shapes.add(shape)
        except Exception as exc:  # noqa: BLE001
            log.warning("building a turn's attention graph ahead failed",
                        extra={"session": s.id, "shape": list(shape[1:]), "error": repr(exc)})

    # -- generation -----------------------------------------------------------

    def generate(self, session: Session, params: GenerateParams, on_event: OnEvent | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerateResult:
        """Generate from the session's pending tokens, alone; the reply becomes part of the session."""
        return run_alone(self.decoder, self.start_call(session, params, on_event, should_stop))

    def start_call(self, session: Session, params: GenerateParams, on_event: OnEvent | None = None,
                   should_stop: Callable[[], bool] | None = None, mlx: Mlx = direct) -> Call:
        """A generate call ready to join the decoder: the cache covers every pending token but the last.

        `on_event` gets the streamed events (text pieces, tool calls: model/toolcalls.py).
        Store work on the caller's thread, MLX work through `mlx` (prefill one chunk per call);
        `should_stop` stops the prefill too (CancelledError) and then the generation.
        """
        constraint = self.constraint(params, session.tools, session.tokens)  # refused before any prefill
        output = TextOutput(self.tokenizer, self.fit(params, len(session.tokens)), on_event, should_stop,
                            session.tools, self.opens_thinking(session.tokens))
        if session.cache is None and session.tokens:  # after a failed generation: rebuild from the tokens
            plan = Plan(session.tokens, session.mode or "raw", session.messages, session.tools)
            self.apply(session, plan, self.prefix_cache(session, plan.target, mlx), mlx, should_stop)
        if not session.pending:  # rare (every token in the cache): no engine-thread job otherwise
            mlx(lambda: self._ensure_pending(session))
        prompt_tokens = len(session.pending)
        self.prefill(session, len(session.tokens) - 1, mlx, should_stop)
        return Call(session, session.tokens[-1], output, prompt_tokens, constraint=constraint)

    def opens_thinking(self, tokens: list[int]) -> bool:
        """Whether a reply to `tokens` begins inside a thinking span: the template opened one (its start
        marker after the last end marker), as mlx-lm's server decides."""
        tok = self.tokenizer
        if not getattr(tok, "has_thinking", False):
            return False
        tail = tokens[-THINK_LOOKBACK:]  # the generation prompt's end: a long conversation is not scanned
        return tok.rfind_think_start(tail) > tok.rfind_think_end(tail)

    def _ensure_pending(self, session: Session) -> None:
        """A call starts from a pending token: re-feed the last one when every token is in the cache."""
        if session.pending:
            return
        if session.processed and can_trim_prompt_cache(session.cache):
            trim_prompt_cache(session.cache, 1)
            session.processed -= 1
        else:
            raise InvalidParamsError(f"session {session.id} has nothing to generate from: append input first",
                                     session_id=session.id)

    # -- sleep and wake -------------------------------------------------------

    def sleep(self, session: Session, *, label: str | None = None, free: bool = True,
              mlx: Mlx = direct) -> dict[str, Any]:
        """Write the session's KV as a snapshot and free it (kv/pipeline.py). On failure the session stays hot.

        Its running persistence checkpoint is waited for and replaced: the blocks it wrote are reused."""
        phases = Phases()
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

    def wake(self, session_id: str, snapshot_id: str | None = None, mlx: Mlx = direct) -> tuple[Session, dict[str, Any]]:
        """Restore a session from its latest (or a given) snapshot, exactly (kv/pipeline.py)."""
        self.persister.forget(session_id)  # a hot session woken from another snapshot: its old self writes no more
        session, info = pipeline.wake(self.kv, session_id, snapshot_id, mlx)
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
        if not self.cuttable:
            raise InvalidParamsError(f"{self.model_name} keeps state that cannot be cut by token (sliding window or "
                                     "recurrent layers): prefix blocks cannot be reused; checkpoint and fork instead")

    def warm(self, *, messages: Any = None, text: Any = None, tokens: Any = None, mlx: Mlx = direct,
             shared: Shared | None = None, scratch: Session | None = None) -> dict[str, Any]:
        """Prefill a shared prompt once and pin all of it in the prefix cache (its last partial block as a
        short block). `scratch`: the throwaway session to prefill in (the daemon keeps it to publish
        its tokens to the remote tier); `mlx` and `shared` as for append."""
        self.check_warmable()
        scratch = scratch if scratch is not None else Session(id="prefix-warm")
        self.append(scratch, messages=messages, text=text, tokens=tokens, mlx=mlx, shared=shared)
        self.prefill(scratch, len(scratch.tokens), mlx)  # the pending last token too: all of it is stored
        info = pipeline.write_prefix(self.kv, scratch, mlx)
        return {"tokens": len(scratch.tokens), "blocks": scratch.processed // self.block_tokens,
                "new_blocks": info.new_blocks, "stored_bytes": info.stored_bytes}


def pack_groups(rows: list[tuple[T, int]]) -> list[list[T]]:
    """Rows (each with its number of new tokens) in packs of PACK_MIN or more whose padding (every row as
    long as the pack's longest) at most doubles the tokens computed; a row that fits no pack is left out
    (it prefills alone). Shortest first, each pack takes the next (longer) rows while they fit."""
    packs: list[list[tuple[T, int]]] = []
    for row in sorted(rows, key=lambda r: r[1]):
        pack = packs[-1] if packs else None
        if pack is not None and (len(pack) + 1) * row[1] <= PACK_PADDING * (sum(n for _, n in pack) + row[1]):
            pack.append(row)
        else:
            packs.append([row])
    return [[r for r, _ in pack] for pack in packs if len(pack) >= PACK_MIN]


def _outcome(fn: Callable[[], Any]) -> Any:
    """fn's result, or the exception it raised (a pack's item: model/thread.py raises it to its caller)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - delivered to the one caller it belongs to
        return exc


def _fused(fused: Any) -> Any:
    """A packed row's attention on the fused path: the model's own."""
    return fused
