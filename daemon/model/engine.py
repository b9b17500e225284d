"""The engine: one loaded MLX model, the sessions it runs, and their sleep and wake.

All MLX work happens in the thread that calls the engine (the daemon gives it
one thread of its own). Sleep and wake are `kvwake.daemon.kv.pipeline`, which the
daemon runs too: codec and disk work on the engine's `Pool` (every core by
default, bounded by bytes in flight), MLX work on the engine thread.

Prefix reuse: before a cold prefill, the engine asks the store for the longest
run of stored full blocks that starts the tokens (under this bundle), restores
them (from the RAM tier when hot, else disk) and prefills only the rest. Models
whose caches cannot be cut by token (sliding windows, recurrent state) only
reuse whole snapshots: their prefix reuse is off.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from kvwake.daemon.kv import fill as kvfill, pipeline, prefixhit, state as kvstate
from kvwake.daemon.model import attention
from kvwake.daemon.kv.bundle import Bundle, describe_bundle, diff_descriptions
from kvwake.daemon.model.convert import DEFAULT_MODEL_NAME, ensure_default_model
from kvwake.daemon.model.decoder import Call, Decoder, batch_mode, run_alone
from kvwake.daemon.model.generation import GenerateParams, GenerateResult, OnEvent, TextOutput
from kvwake.daemon.kv.hotblocks import HotBlocks
from kvwake.daemon.kv.pipeline import Pool
from kvwake.daemon.session import ChatTemplate, Session, check_json, check_messages, common_prefix
from kvwake.errors import BundleMismatchError, CorruptBlockError, InvalidParamsError
from kvwake.store import SnapshotRecord, SnapshotWriter, Store

__all__ = ["CONTENT_FORMAT", "Engine", "Plan", "resolve_model"]

log = logging.getLogger("kvwake.engine")
# What a block's payload means (kvstate's naming), as the bundle hash records it. Frozen at the
# value kvwake 0.1 hashed: the compression codec and the file format are per file (each block
# file says its own), so switching codec or file format never orphans a store's snapshots.
CONTENT_FORMAT = ("planes-zstd+kvstate1", 1)


@dataclass(frozen=True)
class Plan:
    """What an append will make of a session: its new tokens and chat state."""

    target: list[int]
    mode: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


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
    """Holds one model and runs sessions on it. Not thread-safe: one thread calls it."""

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
    ) -> None:
        self.store, self.prefill_step = store, prefill_step
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.model_path, self.model_name = resolve_model(model, Path(data_dir))
        self.model, self.tokenizer = mlx_lm.load(str(self.model_path))
        probe = self.make_cache()
        self.cuttable = kvstate.cuttable(probe)
        self.bundle: Bundle = describe_bundle(
            self.model_path, kv_layout=kvstate.layout(probe, model=self.model), block_tokens=store.block_tokens,
            codec=CONTENT_FORMAT[0], codec_version=CONTENT_FORMAT[1],
            digest_cache=Path(data_dir) / "digests.json",
            model_name=self.model_name,
        )
        store.register_bundle(self.bundle.hash, self.bundle.description)
        self.template = ChatTemplate(self.tokenizer)
        self.hot = HotBlocks(hot_bytes)
        self.counters = {"blocks_ram": 0, "blocks_disk": 0, "tokens_reused": 0, "tokens_prefilled": 0}
        self._counter_lock = threading.Lock()
        self.pool = Pool(io_workers, io_inflight_bytes)
        self.device_planes = kvfill.restore_mode() == "staged"  # KV on a discrete GPU: byte planes are made there
        self.decode_mode, self.decode_reason = batch_mode(probe, kv_bits, max_batch)
        self.decoder = Decoder(self.model, self.decode_mode, max_batch)
        self.plain_prefill = attention.wanted()  # CUDA: no cuDNN graph build per new chunk shape

    def close(self) -> None:
        self.pool.close()

    @property
    def block_tokens(self) -> int:
        return self.store.block_tokens

    def make_cache(self) -> list:
        """A fresh cache; with kv_bits, plain KV layers are quantized (mlx-lm cannot quantize the others)."""
        cache = make_prompt_cache(self.model)
        return self.quantize(cache) if self.kv_bits is not None else cache

    # -- input ----------------------------------------------------------------

    def append(self, session: Session, *, messages: Any = None, text: Any = None, tokens: Any = None,
               tools: Any = None, whole: bool = False) -> dict[str, int]:
        """Add input and prefill it (all but the last token, which stays pending).

        Returns {"tokens": total, "prefilled": n, "reused": n from the prefix cache}.
        """
        plan = self.plan(session, messages=messages, text=text, tokens=tokens, tools=tools, whole=whole)
        return self.apply(session, plan, self.prefix_cache(session, plan.target))

    def plan(self, session: Session, *, messages: Any = None, text: Any = None, tokens: Any = None,
             tools: Any = None, whole: bool = False) -> Plan:
        """Validate input and compute the session's new token list; changes nothing.

        With `whole`, the input is the whole conversation (as OpenAI clients send it), not an addition:
        it replaces the session's messages or tokens, and the cache keeps their common prefix.
        """
        if sum(x is not None for x in (messages, text, tokens)) != 1:
            raise InvalidParamsError("give exactly one of messages, text or tokens")
        if messages is not None:
            session.check_mode("chat")
            if tools is not None:
                tools = self._check_tools(tools)
            elif not whole:  # a whole conversation brings its own tools, or has none
                tools = session.tools
            candidate = ([] if whole else session.messages) + check_messages(messages)
            return Plan(self.template.render(candidate, tools), "chat", candidate, tools)
        session.check_mode("raw")
        if text is not None:
            if not isinstance(text, str) or not text:
                raise InvalidParamsError("text must be a non-empty string")
            added = list(self.tokenizer.encode(text, add_special_tokens=whole or not session.tokens))
        else:
            added = self._check_tokens(tokens)
        return Plan(([] if whole else session.tokens) + added, "raw", session.messages, session.tools)

    def _check_tools(self, tools: Any) -> list[dict[str, Any]]:
        """Tools only for a model whose tool calls mlx-lm can parse: an agent given tools must get
        structured calls back, not raw text it would have to parse itself."""
        tools = check_json(tools, "tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidParamsError("tools must be a list of maps (OpenAI's tool definitions)", param="tools")
        if tools and not self.tokenizer.has_tool_calling:
            raise InvalidParamsError(
                f"model {self.model_name} has no tool-call format mlx-lm knows (its tokenizer names no tool parser), "
                "so its tool calls could not be parsed; send no tools, or set \"tool_parser_type\" (a module of "
                "mlx_lm.tool_parsers) in the model's tokenizer_config.json", param="tools")
        return tools

    @property
    def vocab_size(self) -> int:
        args = getattr(self.model, "args", None)
        return int(getattr(args, "vocab_size", 0) or len(self.tokenizer.vocab))

    def _check_tokens(self, tokens: Any) -> list[int]:
        vocab = self.vocab_size
        if (not isinstance(tokens, list) or not tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)):
            raise InvalidParamsError(f"tokens must be a non-empty list of ids in [0, {vocab})")
        return list(tokens)

    def _keep(self, session: Session, target: list[int]) -> int:
        """How much of the session's cache stays valid for `target` (at least one token stays pending)."""
        return min(common_prefix(session.tokens[: session.processed], target), len(target) - 1)

    def needs_fresh_cache(self, session: Session, target: list[int]) -> bool:
        """True when appending `target` cannot keep the session's cache (none yet, or it cannot be cut back)."""
        return session.cache is None or (self._keep(session, target) < session.processed
                                         and not can_trim_prompt_cache(session.cache))

    def prefix_cache(self, session: Session, target: list[int], mlx: pipeline.Mlx = pipeline.direct) -> tuple[list | None, int]:
        """A cache restored from stored blocks that start `target`, when the session will need a fresh one.

        Store and codec work on the caller's thread and the pool, MLX work through `mlx`.
        Returns (cache or None, tokens it holds). A bad block shortens the hit; it never fails the append.
        """
        if not self.cuttable or len(target) < 2 or not self.needs_fresh_cache(session, target):
            return None, 0
        hit = self.store.prefix_hit(self.bundle.hash, target[: len(target) - 1], min_partial=self.min_partial)
        return prefixhit.restore_prefix(self, hit, target, mlx)

    @property
    def min_partial(self) -> int:
        """The fewest tokens a partial block or tail serves: a quarter block. Below that the match is the
        chat template's opening, which every session shares: restoring (and keeping in RAM) a whole
        block for it would cost more than prefilling it and push real shared prompts out of the RAM tier."""
        return max(1, self.block_tokens // 4)

    def apply(self, session: Session, plan: Plan, prefix: tuple[list | None, int] = (None, 0),
              mlx: pipeline.Mlx = pipeline.direct) -> dict[str, int]:
        """Make the cache cover plan.target[:-1]: keep the common prefix, take `prefix` (a restored cache), prefill the rest.

        MLX work goes through `mlx` one chunk at a time, so other sessions decode between the chunks.
        """
        reused = mlx(lambda: self._adopt(session, plan, prefix))
        prefilled = self.prefill(session, len(plan.target) - 1, mlx)
        return {"tokens": len(plan.target), "prefilled": prefilled, "reused": reused}

    def _adopt(self, session: Session, plan: Plan, prefix: tuple[list | None, int]) -> int:
        """Cut the session's cache back to what plan.target keeps (or take `prefix`); returns tokens reused."""
        target, keep = plan.target, self._keep(session, plan.target)
        if self.needs_fresh_cache(session, target):
            session.cache, session.processed = None, 0  # recurrent or wrapped ring state cannot be rewound
        elif keep < session.processed:
            trim_prompt_cache(session.cache, session.processed - keep)
            session.processed = keep
        reused = 0
        if session.cache is None:
            cache, reused = prefix
            session.cache = cache if cache is not None else self.make_cache()
            session.processed = reused
            self.count("tokens_reused", reused)
        session.mode, session.messages, session.tools, session.tokens = plan.mode, plan.messages, plan.tools, target
        return reused

    def quantize(self, cache: list) -> list:
        return [c.to_quantized(group_size=self.kv_group_size, bits=self.kv_bits) if type(c) is KVCache else c
                for c in cache]

    def make_blank(self) -> list:
        """make_prompt_cache(model): the cache skeleton a restore fills."""
        return make_prompt_cache(self.model)

    def log_unusable(self, exc: CorruptBlockError) -> None:
        log.warning("prefix block unusable, prefilling instead: %s", exc.message)

    def count(self, name: str, n: int) -> None:
        with self._counter_lock:  # worker threads count too
            self.counters[name] += n

    def prefill(self, session: Session, upto: int, mlx: pipeline.Mlx = pipeline.direct) -> int:
        """Feed session.tokens[processed:upto] to the model, one chunk per `mlx` call; returns how many."""
        start = session.processed
        while session.processed < upto:
            mlx(lambda: self._prefill_chunk(session, upto))
        self.count("tokens_prefilled", upto - start)
        return upto - start

    def _prefill_chunk(self, session: Session, upto: int) -> None:
        # Fixed chunks, also beside running calls: MLX on CUDA compiles for each new (chunk, offset)
        # shape (measured: a 64-token chunk at a new offset 100 ms, again 20 ms), so chunks sized to
        # the decode step made an 8k prefill 17-30x slower and the others' gaps longer, not shorter.
        end = min(upto, session.processed + self.prefill_step)
        # A chunk shorter than the step (a turn's input, a prompt's last piece) has a key length nothing
        # computed before: plain attention spares it a cuDNN graph build. Full chunks stay fused: beside
        # decoding, 128-token chunks over 8k took 3.0 s plain against 1.5 s fused (daemon/attention.py).
        plain = self.plain_prefill and end - session.processed < self.prefill_step
        with attention.plain_prefill(self.model) if plain else contextlib.nullcontext():
            self.model(mx.array(session.tokens[session.processed : end], dtype=mx.uint32)[None], cache=session.cache)
        mx.eval([c.state for c in session.cache])
        session.processed = end

    # -- generation -----------------------------------------------------------

    def generate(self, session: Session, params: GenerateParams, on_event: OnEvent | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerateResult:
        """Generate from the session's pending tokens, alone; the reply becomes part of the session."""
        return run_alone(self.decoder, self.start_call(session, params, on_event, should_stop))

    def start_call(self, session: Session, params: GenerateParams, on_event: OnEvent | None = None,
                   should_stop: Callable[[], bool] | None = None, mlx: pipeline.Mlx = pipeline.direct) -> Call:
        """A generate call ready to join the decoder: the cache covers every pending token but the last.

        `on_event` gets the streamed events (text pieces, tool calls: daemon/toolcalls.py).
        Store work on the caller's thread, MLX work through `mlx` (prefill one chunk per call).
        """
        output = TextOutput(self.tokenizer, params, on_event, should_stop, session.tools)
        if session.cache is None and session.tokens:  # after a failed generation: rebuild from the tokens
            plan = Plan(session.tokens, session.mode or "raw", session.messages, session.tools)
            self.apply(session, plan, self.prefix_cache(session, session.tokens, mlx), mlx)
        mlx(lambda: self._ensure_pending(session))
        prompt_tokens = len(session.pending)
        self.prefill(session, len(session.tokens) - 1, mlx)
        return Call(session, session.tokens[-1], output, prompt_tokens)

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
    # The pipeline (pipeline.py) drives these; begin_sleep / finish_sleep / record
    # touch only the store, capture_* only MLX (engine thread).

    def begin_sleep(self, session: Session, *, label: str | None = None) -> SnapshotWriter:
        """Open the snapshot writer (store work); its `needed` says which blocks to capture."""
        tokens = session.tokens[: session.processed]
        return self.store.writer(session.id, self.bundle.hash, tokens, parent=session.head, label=label,
                                 metadata=session.state())

    def capture_blocks(self, cache: list, first: int, count: int) -> list:
        """Blocks as host arrays (kvstate), or, KV on a discrete GPU, as byte planes made there."""
        if self.device_planes and self.store.codec == "planes-zstd":
            planed = kvstate.capture_planed(cache, first, count, self.block_tokens)
            if planed is not None:
                return planed
        return kvstate.capture_blocks(cache, first, count, self.block_tokens)

    def capture_tail(self, session: Session) -> dict:
        if session.cache is None:
            return {}
        return kvstate.capture_tail(session.cache, session.processed, self.block_tokens)

    def kv_bytes_per_token(self, cache: list) -> int:
        return kvstate.bytes_per_token(cache)

    def finish_sleep(self, session: Session, w: SnapshotWriter, started: float) -> dict[str, Any]:
        """Commit (store work). The session stays hot: the pipeline frees its KV on the engine thread."""
        info = w.commit()
        session.head = info.id
        return {"snapshot_id": info.id, "tokens": info.n_tokens, "raw_bytes": info.raw_bytes,
                "stored_bytes": info.stored_bytes, "new_blocks": info.new_blocks,
                "reused_blocks": info.reused_blocks, "written_bytes": info.written_bytes,
                "ms": round((time.perf_counter() - started) * 1000, 3)}

    def sleep(self, session: Session, *, label: str | None = None, free: bool = True) -> dict[str, Any]:
        """Write the session's KV as a snapshot and free it. On failure the session stays hot."""
        return pipeline.sleep(self, session, pipeline.direct, label=label, free=free)

    def wake(self, session_id: str, snapshot_id: str | None = None) -> tuple[Session, dict[str, Any]]:
        """Restore a session from its latest (or a given) snapshot, exactly."""
        return pipeline.wake(self, session_id, snapshot_id, pipeline.direct)

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

    # -- shared prompts -------------------------------------------------------

    def check_warmable(self) -> None:
        if not self.cuttable:
            raise InvalidParamsError(f"{self.model_name} keeps state that cannot be cut by token (sliding window or "
                                     "recurrent layers): prefix blocks cannot be reused; checkpoint and fork instead")

    def warm(self, *, messages: Any = None, text: Any = None, tokens: Any = None) -> dict[str, Any]:
        """Prefill a shared prompt once and pin all of it in the prefix cache (its last partial block as a short block)."""
        self.check_warmable()
        scratch = Session(id="prefix-warm")
        self.append(scratch, messages=messages, text=text, tokens=tokens)
        info = pipeline.write_prefix(self, scratch, pipeline.direct)
        return {"tokens": len(scratch.tokens), "blocks": len(scratch.tokens[: scratch.processed]) // self.block_tokens,
                "new_blocks": info.new_blocks, "stored_bytes": info.stored_bytes}
