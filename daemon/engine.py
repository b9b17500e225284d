"""The engine: one loaded MLX model, the sessions it runs, and their sleep and wake.

All MLX work happens in the thread that calls the engine (the daemon gives it
one thread of its own). Inside a sleep, encoding and writing blocks run on a
small worker pool while the engine thread captures the next block, with at
most `INFLIGHT` captured blocks waiting: a sleep never holds a second full copy
of the KV. A wake streams blocks the same way in reverse.

Prefix reuse: before a cold prefill, the engine asks the store for the longest
run of stored full blocks that starts the tokens (under this bundle), restores
them (from the RAM tier when hot, else disk) and prefills only the rest. Models
whose caches cannot be cut by token (sliding windows, recurrent state) only
reuse whole snapshots: their prefix reuse is off.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from kvwake.daemon import kvstate
from kvwake.daemon.bundle import Bundle, describe_bundle, diff_descriptions
from kvwake.daemon.convert import DEFAULT_MODEL_NAME, ensure_default_model
from kvwake.daemon.generation import GenerateParams, GenerateResult, run_generation
from kvwake.daemon.hotblocks import HotBlocks
from kvwake.daemon.session import ChatTemplate, Session, check_json, check_messages, common_prefix
from kvwake.errors import BundleMismatchError, CorruptBlockError, InvalidParamsError
from kvwake.store import BlockRef, SnapshotRecord, SnapshotWriter, Store
from kvwake.store.codec import FORMAT_VERSION

__all__ = ["Engine", "Loaded", "Plan", "resolve_model"]

log = logging.getLogger("kvwake.engine")
INFLIGHT = 2


@dataclass(frozen=True)
class Plan:
    """What an append will make of a session: its new tokens and chat state."""

    target: list[int]
    mode: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


@dataclass
class Loaded:
    """A verified snapshot read into memory, ready to restore."""

    record: SnapshotRecord
    blocks: list[dict]
    tail: dict
    started: float
    counts: dict[str, int]


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
    ) -> None:
        self.store, self.prefill_step = store, prefill_step
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.model_path, self.model_name = resolve_model(model, Path(data_dir))
        self.model, self.tokenizer = mlx_lm.load(str(self.model_path))
        probe = self.make_cache()
        self.cuttable = kvstate.cuttable(probe)
        self.bundle: Bundle = describe_bundle(
            self.model_path, kv_layout=kvstate.layout(probe, model=self.model), block_tokens=store.block_tokens,
            codec=f"{store.codec}+kvstate{kvstate.STATE_FORMAT}", codec_version=FORMAT_VERSION,
            digest_cache=Path(data_dir) / "digests.json",
            model_name=self.model_name,
        )
        store.register_bundle(self.bundle.hash, self.bundle.description)
        self.template = ChatTemplate(self.tokenizer)
        self.hot = HotBlocks(hot_bytes)
        self.counters = {"blocks_ram": 0, "blocks_disk": 0, "tokens_reused": 0, "tokens_prefilled": 0}
        self._counter_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max_workers=INFLIGHT, thread_name_prefix="kvwake-io")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @property
    def block_tokens(self) -> int:
        return self.store.block_tokens

    def make_cache(self) -> list:
        """A fresh cache; with kv_bits, plain KV layers are quantized (mlx-lm cannot quantize the others)."""
        cache = make_prompt_cache(self.model)
        return self._quantize(cache) if self.kv_bits is not None else cache

    # -- input ----------------------------------------------------------------

    def append(self, session: Session, *, messages: Any = None, text: Any = None, tokens: Any = None,
               tools: Any = None) -> dict[str, int]:
        """Add input and prefill it (all but the last token, which stays pending).

        Returns {"tokens": total, "prefilled": n, "reused": n from the prefix cache}.
        """
        plan = self.plan(session, messages=messages, text=text, tokens=tokens, tools=tools)
        return self.apply(session, plan, self.prefix_blocks(session, plan.target))

    def plan(self, session: Session, *, messages: Any = None, text: Any = None, tokens: Any = None,
             tools: Any = None) -> Plan:
        """Validate input and compute the session's new token list; changes nothing."""
        if sum(x is not None for x in (messages, text, tokens)) != 1:
            raise InvalidParamsError("give exactly one of messages, text or tokens")
        if messages is not None:
            session.check_mode("chat")
            tools = session.tools if tools is None else check_json(tools, "tools")
            candidate = session.messages + check_messages(messages)
            return Plan(self.template.render(candidate, tools), "chat", candidate, tools)
        session.check_mode("raw")
        if text is not None:
            if not isinstance(text, str) or not text:
                raise InvalidParamsError("text must be a non-empty string")
            added = list(self.tokenizer.encode(text, add_special_tokens=not session.tokens))
        else:
            added = self._check_tokens(tokens)
        return Plan(session.tokens + added, "raw", session.messages, session.tools)

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

    def _needs_fresh_cache(self, session: Session, target: list[int]) -> bool:
        return session.cache is None or (self._keep(session, target) < session.processed
                                         and not can_trim_prompt_cache(session.cache))

    def prefix_blocks(self, session: Session, target: list[int]) -> list[dict]:
        """Stored blocks that start `target`, when the session will need a fresh cache (store work).

        A bad block shortens the hit; it never fails the append.
        """
        if not self.cuttable or len(target) <= self.block_tokens or not self._needs_fresh_cache(session, target):
            return []
        blocks = []
        for ref in self.store.longest_prefix(self.bundle.hash, target[: len(target) - 1]):
            try:
                blocks.append(self._fetch(ref))
            except CorruptBlockError as exc:
                log.warning("prefix block unusable, prefilling instead: %s", exc.message)
                break
        return blocks

    def apply(self, session: Session, plan: Plan, blocks: list[dict]) -> dict[str, int]:
        """Make the cache cover plan.target[:-1]: keep the common prefix, restore `blocks`, prefill the rest."""
        target, keep = plan.target, self._keep(session, plan.target)
        if self._needs_fresh_cache(session, target):
            session.cache, session.processed = None, 0  # recurrent or wrapped ring state cannot be rewound
        elif keep < session.processed:
            trim_prompt_cache(session.cache, session.processed - keep)
            session.processed = keep
        reused = 0
        if session.cache is None:
            session.cache = self._prefix_cache(blocks) if blocks else self.make_cache()
            reused = session.processed = len(blocks) * self.block_tokens
            self._count("tokens_reused", reused)
        session.mode, session.messages, session.tools, session.tokens = plan.mode, plan.messages, plan.tools, target
        prefilled = self._prefill(session, len(target) - 1)
        return {"tokens": len(target), "prefilled": prefilled, "reused": reused}

    def _prefix_cache(self, blocks: list[dict]) -> list:
        cache = kvstate.restore_prefix(self.model, iter(blocks), len(blocks), self.block_tokens)
        return self._quantize(cache) if self.kv_bits is not None else cache

    def _quantize(self, cache: list) -> list:
        return [c.to_quantized(group_size=self.kv_group_size, bits=self.kv_bits) if type(c) is KVCache else c
                for c in cache]

    def _fetch(self, ref: BlockRef, record: SnapshotRecord | None = None) -> dict:
        read = lambda r: self.store.read_block(r, snapshot_id=record.id if record else None,  # noqa: E731
                                               session_id=record.session_id if record else None)
        arrays, from_ram = self.hot.fetch(ref, read)
        self._count("blocks_ram" if from_ram else "blocks_disk", 1)
        return arrays

    def _count(self, name: str, n: int) -> None:
        with self._counter_lock:  # worker threads count too
            self.counters[name] += n

    def _prefill(self, session: Session, upto: int) -> int:
        start = session.processed
        while session.processed < upto:
            end = min(upto, session.processed + self.prefill_step)
            self.model(mx.array(session.tokens[session.processed : end], dtype=mx.uint32)[None], cache=session.cache)
            mx.eval([c.state for c in session.cache])
            session.processed = end
        self._count("tokens_prefilled", upto - start)
        return upto - start

    # -- generation -----------------------------------------------------------

    def generate(self, session: Session, params: GenerateParams, on_text: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerateResult:
        """Generate from the session's pending tokens; the reply becomes part of the session."""
        if session.cache is None and session.tokens:  # after a failed generation: rebuild from the tokens
            plan = Plan(session.tokens, session.mode or "raw", session.messages, session.tools)
            self.apply(session, plan, self.prefix_blocks(session, session.tokens))
        if not session.pending:
            if session.processed and can_trim_prompt_cache(session.cache):
                trim_prompt_cache(session.cache, 1)
                session.processed -= 1
            else:
                raise InvalidParamsError(f"session {session.id} has nothing to generate from: append input first",
                                         session_id=session.id)
        prompt = session.pending
        try:
            result = run_generation(self.model, self.tokenizer, session.cache, prompt,
                                    session.tokens[: session.processed], params, on_text, should_stop)
        except BaseException:
            session.cache, session.processed = None, 0  # state unknown: rebuilt from tokens on next use
            raise
        session.tokens = session.tokens + result.tokens
        session.processed = len(session.tokens)
        if session.mode == "chat":
            session.messages.append({"role": "assistant", "content": result.text})
        return result

    # -- sleep and wake -------------------------------------------------------
    # Each is split into phases so the daemon can run MLX work on its engine
    # thread and store work on worker threads: begin_sleep / finish_sleep and
    # load_snapshot touch only the store; capture_* and restore touch only MLX.

    def begin_sleep(self, session: Session, *, label: str | None = None) -> SnapshotWriter:
        """Open the snapshot writer (store work); its `needed` says which blocks to capture."""
        tokens = session.tokens[: session.processed]
        return self.store.writer(session.id, self.bundle.hash, tokens, parent=session.head, label=label,
                                 metadata=session.state())

    def capture_block(self, session: Session, index: int) -> dict:
        return kvstate.capture_block(session.cache, index, self.block_tokens)

    def capture_tail(self, session: Session) -> dict:
        if session.cache is None:
            return {}
        return kvstate.capture_tail(session.cache, session.processed, self.block_tokens)

    def finish_sleep(self, session: Session, w: SnapshotWriter, started: float, *, free: bool = True) -> dict[str, Any]:
        """Commit (store work), then free the session's KV (unless `free` is False: a checkpoint).

        Until the commit succeeds the session stays hot.
        """
        info = w.commit()
        session.head = info.id
        if free:
            session.cache = None
        return {"snapshot_id": info.id, "tokens": info.n_tokens, "raw_bytes": info.raw_bytes,
                "stored_bytes": info.stored_bytes, "new_blocks": info.new_blocks,
                "reused_blocks": info.reused_blocks, "written_bytes": info.written_bytes,
                "ms": round((time.perf_counter() - started) * 1000, 3)}

    def sleep(self, session: Session) -> dict[str, Any]:
        """Write the session's KV as a snapshot and free it. On failure the session stays hot."""
        started = time.perf_counter()
        with self.begin_sleep(session) as w:
            inflight: list[cf.Future] = []
            try:
                for i in w.needed:
                    while len(inflight) >= INFLIGHT:
                        inflight.pop(0).result()
                    inflight.append(self._pool.submit(w.add_block, i, self.capture_block(session, i)))
            finally:  # never leave a write running behind an aborting writer
                cf.wait(inflight)
            for f in inflight:
                f.result()
            tail = self.capture_tail(session)
            if tail:
                w.set_tail(tail)
            return self.finish_sleep(session, w, started)

    def load_snapshot(self, session_id: str, snapshot_id: str | None = None) -> Loaded:
        """Read and verify everything a wake needs (store work, parallel decode)."""
        started = time.perf_counter()
        with self.store.reading():  # gc cannot evict this snapshot's files while they are read
            sid = snapshot_id or self.store.latest_snapshot(session_id)
            record = self._record(sid)
            if record.session_id != session_id:
                raise InvalidParamsError(f"snapshot {sid} belongs to session {record.session_id}, not {session_id}; "
                                         "use fork", session_id=session_id, snapshot_id=sid)
            before = dict(self.counters)
            tail_future = self._pool.submit(self.store.read_tail, record)  # decoded alongside the blocks
            blocks = list(self._stream_blocks(record))
            tail = tail_future.result()
        return Loaded(record, blocks, tail, started, {
            "blocks_from_memory": self.counters["blocks_ram"] - before["blocks_ram"],
            "blocks_from_disk": self.counters["blocks_disk"] - before["blocks_disk"]})

    def restore(self, loaded: Loaded) -> tuple[Session, dict[str, Any]]:
        """Build the session's cache from loaded blocks (MLX work)."""
        r = loaded.record
        cache = kvstate.restore(self.model, iter(loaded.blocks), loaded.tail, len(r.token_ids), self.block_tokens) \
            if r.token_ids else None
        session = Session.from_state(r.session_id, list(r.token_ids), r.metadata, r.id, self.vocab_size)
        session.cache = cache
        return session, {"snapshot_id": r.id, "tokens": len(session.tokens), **loaded.counts,
                         "ms": round((time.perf_counter() - loaded.started) * 1000, 3)}

    def wake(self, session_id: str, snapshot_id: str | None = None) -> tuple[Session, dict[str, Any]]:
        """Restore a session from its latest (or a given) snapshot, exactly."""
        return self.restore(self.load_snapshot(session_id, snapshot_id))

    def _record(self, snapshot_id: str) -> SnapshotRecord:
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

    def _stream_blocks(self, record: SnapshotRecord) -> Iterator[dict]:
        """Blocks in order, decoded on the worker pool, at most INFLIGHT ahead of the consumer."""
        self.store.touch([b.key for b in record.blocks])
        refs = list(record.blocks)
        pending: list[cf.Future] = []
        for ref in refs[:INFLIGHT]:
            pending.append(self._pool.submit(self._fetch, ref, record))
        for i in range(len(refs)):
            arrays = pending.pop(0).result()
            if i + INFLIGHT < len(refs):
                pending.append(self._pool.submit(self._fetch, refs[i + INFLIGHT], record))
            yield arrays

    # -- shared prompts -------------------------------------------------------

    def check_warmable(self) -> None:
        if not self.cuttable:
            raise InvalidParamsError(f"{self.model_name} keeps state that cannot be cut by token (sliding window or "
                                     "recurrent layers): prefix blocks cannot be reused; checkpoint and fork instead")

    def warm(self, *, messages: Any = None, text: Any = None, tokens: Any = None) -> dict[str, Any]:
        """Prefill a shared prompt once and pin its full blocks in the prefix cache."""
        self.check_warmable()
        scratch = Session(id="prefix-warm")
        self.append(scratch, messages=messages, text=text, tokens=tokens)
        with self.store.writer(None, self.bundle.hash, scratch.tokens[: scratch.processed], pin=True) as w:
            for i in w.needed:
                w.add_block(i, kvstate.capture_block(scratch.cache, i, self.block_tokens))
            info = w.commit()
        return {"tokens": len(scratch.tokens), "blocks": len(w.keys), "new_blocks": info.new_blocks,
                "stored_bytes": info.stored_bytes}
