"""The decoder: every generate call in flight, advanced one token per step on the engine thread.

Batched mode (models whose cache layers mlx-lm can merge: plain KV, sliding
windows, recurrent state; decode_calls.batch_mode): calls decode together, one
forward pass per step, through mlx-lm's `GenerationBatch` over each layer's
batched form (`BatchKVCache`, `BatchRotatingKVCache`, `ArraysCache`; shorter
histories are left-padded and the padding masked).
Calls join between steps, all those waiting at once: their sessions' plain
caches are laid out with the batch's rows in one go (batch_rows.joined: one
new buffer a plain layer, room for the steps to come) with the token each
feeds next, and the step's one forward pass feeds them beside the others (no
pass of their own; the token a row's first pass feeds is its prompt's last,
or one already handed out, so it is not output). A call leaves when it
finishes: its row is extracted as a plain per-layer cache into its session
(queued, not waited for) and the batch is filtered. So whenever no call runs
on a session, the session holds a plain cache, and sleep, fork and prefix
reuse see what they always saw.

Paged sessions (every layer in a page pool, kv/paged_cache.py) batch over their
own pages instead (kv/paged_batch.py, `in_pages`): a join puts the session's
page table in a row and a leave takes it back, no KV merged or copied; the
step's pages are reserved before its pass (a row the pool cannot grow fails
alone); nothing is padded, so no call decodes alone for its length, and a
dead slot takes any paged call.

Rows live in slots (batch_rows.py): the batch has 1, 2, 4, 8, 16 or 32 rows,
padded with dead rows; a call that leaves leaves a dead slot that the next call
whose history fits takes, and the batch keeps only its live rows once half its
slots are dead. On CUDA each size is warmed at start (`warm`).

Padding is bounded: the batch pads every row to its longest, so while the
padding would be more than the rows' own tokens (and more than `PAD_SLACK`
tokens), the longest call decodes alone beside the batch, joining or already
batched (one 32k-token session among seven short ones would otherwise pad each
of them to 32k).

A call that starts while no other call decodes or waits decodes alone (`Solo`,
decode_calls.py); when a second call arrives, the lone call moves into the batch
between two steps (in the same merge), with the token it has sampled but not
yet fed.

Structured output: a call with a `Constraint` has its logits masked by its
grammar each step (masks.py); while any running call has one, the forward pass
goes through `MaskedModel`, so constrained and unconstrained calls still share
one forward pass and one mask op per step. After each step the decoder hands
the constrained rows' sampled tokens to `Masks.prefetch`, so the next mask is
filled on a worker thread while this thread hands tokens out and builds the
next pass.

Solo mode (`batch_mode`, decode_calls.py, says when and why): every call decodes
alone; calls take one step each in turn, so they interleave but never share a
forward pass.

At most `max_batch` calls decode at once; more wait, in order, for a place.
Every token handed to a call's `TextOutput` has been fed to the model, so a
finished call's cache covers all of its tokens. A step that raises fails the
calls it was running (their caches are dropped; the engine rebuilds them from
the tokens on next use); the decoder itself goes on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, generation_stream
from mlx_lm.models.cache import make_prompt_cache

from kvwake.daemon.kv import paged_batch, paged_cache
from kvwake.daemon.kv.pages import PagePoolFullError
from kvwake.daemon.model import attention, ragged_decode
from kvwake.daemon.model.decode_calls import Call, Solo
from kvwake.daemon.model.generation import GenerateResult, RowsSampler, make_processors, make_sampler
from kvwake.daemon.model.batch_rows import (Row, dead_rows, extract_row, fits, joined, place, retire, rows_batch,
                                        schedule, slot_size)
from kvwake.daemon.model.masks import Constraint, MaskedModel, Masks

__all__ = ["Decoder", "run_alone"]

log = logging.getLogger("kvwake.decoder")
PAD_SLACK = 4096  # padding tokens a batch may hold whatever its rows' lengths (a long row decodes alone past it)


class Decoder:
    """Calls in flight and waiting; `step()` (engine thread) advances each running call by one token."""

    def __init__(self, model: Any, mode: str, max_batch: int, vocab_size: int) -> None:
        self.model, self.mode, self.max_batch = model, mode, max(1, max_batch)
        self.masks = Masks(vocab_size, self.max_batch)
        self.blanks = make_prompt_cache(model) if mode == "batched" else []  # each layer's kind, empty: dead rows
        self.waiting: deque[Call] = deque()
        self.solo: list[Call] = []
        self.batch: GenerationBatch | None = None
        self.rows: dict[int, Call] = {}  # batch uid -> call
        self.fed_only: set[int] = set()  # rows joined this step: the pass feeds their pending token
        self.dead: set[int] = set()  # batch uids of slots no call holds (batch_rows.py)
        # batch uid -> the paged cache its call brought (kv/paged_cache.py): its tokens stay in their pages
        # while the batch decodes a copy; the call's new tokens are written after them when it leaves
        self.paged: dict[int, list] = {}
        self._uids = itertools.count()
        self.counters = {"decode_steps": 0, "decode_tokens": 0, "max_batch_seen": 0, "merges": 0, "slot_reuses": 0,
                         "compactions": 0, "alone_for_length": 0, "rows_sampled_together": 0}
        self.rows_sampling = True  # sampling rows sample in one op (RowsSampler); off: row by row (benchmarks)
        self.row_kernel = False  # steps' attention by the row kernel (model/ragged_decode.py; the engine sets it)
        self.paged_kernel = False  # with it, a paged batch's by the paged kernel on CUDA, else gathered (the engine's)
        self._attends = model  # whose module's attention the row kernel takes over (self.model may be wrapped)
        # paged sessions decode in a batch over their own pages (kv/paged_batch.py); off: their KV is merged
        # into a BatchKVCache as other caches' is (benchmarks). Only where the model's attention can be swapped.
        self.in_pages = attention.attention_module(model) is not None
        self.step_s = 0.0  # moving average of one step's wall time
        # Where batched steps' time goes: mlx-lm's step (the pass queued, the step before waited for) and
        # the host work on its tokens (outputs, leaving rows, the next masks); seconds, summed.
        # seconds in: the batch's passes, handing out their tokens (of which: finished rows given back to their
        # sessions, and the batch cut to its live rows), calls joining
        self.spent = {"batch_next_s": 0.0, "batch_outputs_s": 0.0, "leave_s": 0.0, "compact_s": 0.0, "admit_s": 0.0}
        self.admitted: tuple[int, float] | None = None  # the last step's admission: (calls, seconds), or None

    @property
    def running(self) -> int:
        return len(self.rows) + len(self.solo)

    @property
    def active(self) -> bool:
        return bool(self.waiting or self.rows or self.solo)

    @property
    def starting(self) -> bool:
        """Calls whose first token has not come yet: waiting with a place free, or admitted and not yet given
        one (a batch's new row is fed its pending token at the step that admits it, and given its first token
        at the step after)."""
        if self.waiting and self.running < self.max_batch:
            return True
        return any(call.output.first is None for call in (*self.rows.values(), *self.solo))

    def join(self, call: Call) -> None:
        """Queue a call; it starts at the next step with a free place."""
        self.waiting.append(call)

    def step(self) -> None:
        """Admit waiting calls (in one merge), then one token for every running call."""
        started, waiting = time.perf_counter(), len(self.waiting)
        with mx.stream(generation_stream), self._attention():
            self._admit()
            admitted = time.perf_counter() - started
            self._step_batch()
            for call in list(self.solo):
                self._step_solo(call)
        joined = waiting - len(self.waiting)
        self.spent["admit_s"] += admitted
        self.admitted = (joined, admitted) if joined else None
        n = self.running
        self.counters["max_batch_seen"] = max(self.counters["max_batch_seen"], n)
        self.step_s = 0.9 * self.step_s + 0.1 * (time.perf_counter() - started) if self.step_s else \
            time.perf_counter() - started

    def admit(self) -> None:
        """Admit the waiting calls now, without a pass: what a step does first (a benchmark times a join
        alone)."""
        with mx.stream(generation_stream), self._attention():
            self._admit()

    def _attention(self) -> contextlib.AbstractContextManager[None]:
        """A step's attention: by the row kernel for every call, batched or alone (model/ragged_decode.py:
        a row's result does not depend on its company, so a batched call decodes as it would alone), over
        pages for a paged batch (and for paged calls alone where the kernel runs), or as the model computes
        it."""
        if not (self.row_kernel or self._over_pages()):
            return contextlib.nullcontext()
        kernel = self.row_kernel
        # Pages read in place by the paged kernel where the engine turned it on (Tuning.paged_kernel), else
        # gathered (docs/decisions.md, "Batched decode over pages")
        return attention.swapped(self._attends, lambda fused: ragged_decode.paged(
            ragged_decode.ragged(fused) if kernel else fused, kernel and self.paged_kernel))

    def _over_pages(self) -> bool:
        """Whether this step may run a batch over pages: one runs, or a waiting call's cache is paged."""
        if self.batch is not None:
            return paged_batch.in_pages(self.batch.prompt_cache)
        return self.in_pages and any(paged_batch.takes(call.session.cache) for call in self.waiting)

    def trace(self) -> str:
        """What the last step did beyond a step, for the engine thread's record of slow work: the calls it
        admitted and how long their admission (the merge into the batch) took, before the pass."""
        if self.admitted is None:
            return ""
        calls, seconds = self.admitted
        return f"admitting {calls} call{'s' if calls != 1 else ''} ({seconds * 1000:.1f} ms)"

    def warm(self) -> list[int]:
        """Two batched steps at each slot size up to max_batch, on dead rows (no call), so MLX builds each
        size's kernels before a request meets them (MLX on CUDA compiles per shape). The sizes warmed."""
        sizes = self.warm_sizes()
        for n in sizes:
            self.warm_size(n)
        return sizes

    def warm_sizes(self) -> list[int]:
        """The slot sizes `warm` builds (none unless batched)."""
        if self.mode != "batched":
            return []
        return sorted({slot_size(n, self.max_batch) for n in range(2, self.max_batch + 1)})

    def warm_size(self, n: int) -> None:
        """One size of `warm`: a batch of its own, so it may run between the live batch's steps."""
        with mx.stream(generation_stream), self._attention():
            batch = dead_rows(self.model, list(range(n)), self.blanks)
            batch.next()
            batch.next()

    def abort(self, exc: BaseException) -> None:
        """Fail every call (the engine thread is stopping)."""
        calls = [*self.waiting, *self.rows.values(), *self.solo]
        self.masks.forget([call.constraint for call in calls])
        for call in calls:
            call.fail(exc)
        self.waiting.clear()
        self.rows.clear()
        self.solo.clear()
        self.dead.clear()
        self.paged.clear()
        self.batch = None

    # -- joining ----------------------------------------------------------------

    def _admit(self) -> None:
        """Every waiting call that has a place starts now. Batched, they join the batch in one merge
        (with a lone call, when there is company), and the step's pass feeds their pending tokens:
        no pass of their own. A call that comes to an empty decoder alone decodes alone."""
        joining: list[Call] = []
        while self.waiting and self.running + len(joining) < self.max_batch:
            joining.append(self.waiting.popleft())
        if not joining:
            return
        if self.mode != "batched" or (len(joining) == 1 and not self.rows and not self.solo):
            for call in joining:
                self._start_solo(call)
            return
        new = {id(call) for call in joining}
        batched, alone = self._bounded(self.solo + joining)
        evicted = [call for call in alone if call.solo is None and id(call) not in new]
        self.counters["alone_for_length"] += len(evicted) + sum(id(call) in new for call in alone)
        if evicted:
            self._evict(evicted)
        if not self.rows and len(batched) == 1:  # no company left: alone too
            batched, alone = [], alone + batched
        for call in alone:
            if call.solo is None and all(call is not e for e in evicted):
                self._start_solo(call)
        rows = [row for lone in batched if lone.solo is not None and (row := self._lone_row(lone)) is not None]
        rows += [Row(call, call.token, call.session.cache, [], make_sampler(call.output.params))
                 for call in batched if id(call) in new]
        if rows:
            self._merge(rows)

    def _bounded(self, calls: list[Call]) -> tuple[list[Call], list[Call]]:
        """(of `calls`, those that join the batch; of them and the batch's rows, those that decode
        alone): the batch pads every row to its longest, so while the padding would be more than the
        tokens themselves (and more than PAD_SLACK tokens), the longest decodes alone (one 32k session
        among short ones would otherwise pad each of them to 32k)."""
        paged = self._paged_split(calls)
        if paged is not None:
            return paged
        pool = sorted([*self.rows.values(), *calls], key=_length)
        alone: list[Call] = []
        while len(pool) > 1:
            every = [_length(call) for call in pool]
            if len(every) * every[-1] - sum(every) <= max(sum(every), PAD_SLACK):
                break
            alone.append(pool.pop())
        joining = {id(call) for call in calls}
        return [call for call in pool if id(call) in joining], alone

    def _paged_split(self, calls: list[Call]) -> tuple[list[Call], list[Call]] | None:
        """`_bounded` for a batch over pages (running, or to be made of `calls`, each paged whole): it pads
        nothing, so every call paged whole joins and any other decodes alone. None: the batch merges KV."""
        if not self.in_pages or (self.batch is not None and not paged_batch.in_pages(self.batch.prompt_cache)):
            return None
        whole = [call for call in calls if paged_batch.takes(_cache(call)) is not None]
        if self.batch is None and len(whole) < len(calls):
            return None
        return whole, [call for call in calls if all(call is not w for w in whole)]

    def _evict(self, calls: list[Call]) -> None:
        """Batch rows that go on alone (their history pads the batch too much): each takes its cache
        and its sampled token (handed out here; the lone pass feeds it) to a `Solo`; then the batch
        keeps its other rows, cut to their length."""
        batch = self.batch
        assert batch is not None
        for call in calls:
            i = next(i for i, uid in enumerate(batch.uids) if self.rows.get(uid) is call)
            uid, token, sampler = batch.uids[i], batch._next_tokens[i : i + 1], batch.samplers[i]
            s, p = call.session, call.output.params
            extracted = self._extract(uid, i, call)
            del self.rows[uid]
            self.dead.add(uid)
            retire(batch, i)
            if not extracted:
                continue
            self.counters["decode_tokens"] += 1  # a token handed out, not a step of its own
            reason = call.output.add(int(token.item()))
            try:
                call.solo = Solo(lambda fed, call=call: self._model([call], fed), s.cache, token, sampler,
                                 make_processors(p), s.tokens[: s.processed] + call.output.tokens[:-1])
            except Exception as exc:
                self.masks.forget([call.constraint])
                call.fail(exc)
                continue
            if reason is not None:  # that token ended it: fed now, as every token handed out is
                call.solo = None
                call.finish(reason)
                continue
            self.solo.append(call)
            self.masks.prefetch([call.constraint], call.solo.next)
        self._compact()

    def _start_solo(self, call: Call) -> None:
        s, p = call.session, call.output.params
        try:
            call.solo = Solo(lambda fed, call=call: self._model([call], fed), s.cache, mx.array([call.token], dtype=mx.uint32), make_sampler(p),
                             make_processors(p), s.tokens[: s.processed])
        except Exception as exc:  # bad input for this call only (the model raised on it)
            self.masks.forget([call.constraint])
            call.fail(exc)
            return
        self.solo.append(call)
        self.masks.prefetch([call.constraint], call.solo.next)

    def _lone_row(self, call: Call) -> Row | None:
        """A lone call's row for the batch, with the token it has sampled: the batch's first pass feeds
        it without handing it out, so it is handed to the call's output here (None: that ended it)."""
        self.solo.remove(call)
        assert call.solo is not None
        solo, call.solo = call.solo, None
        self.counters["decode_tokens"] += 1  # a token handed out, not a step of its own
        reason = call.output.add(int(solo.next.item()))
        if reason is not None:  # that token ends the call: feed it alone, as every token handed out is
            solo.step()
            call.finish(reason)
            return None
        return Row(call, solo.next, solo.cache, call.output.tokens[:-1], solo.sampler)  # the same random state

    def _merge(self, rows: list[Row]) -> None:
        """Add rows to the batch: into dead slots where their histories fit, the rest in one merge
        appended (then dead rows up to the next slot size). No forward pass here: the step's pass
        feeds their next tokens with the others'."""
        batch, placed = self.batch, []
        if batch is not None and self.dead:
            slots = [i for i, uid in enumerate(batch.uids) if uid in self.dead]
            for row in [r for r in rows if fits(batch, r)][: len(slots)]:
                i, uid = slots.pop(0), next(self._uids)
                self.dead.discard(batch.uids[i])
                place(batch, i, uid, row)
                placed.append((uid, row))
                self.counters["slot_reuses"] += 1
            rows = [r for r in rows if all(r is not p for _, p in placed)]
        in_pages = paged_batch.in_pages(batch.prompt_cache) if batch is not None else \
            self.in_pages and all(paged_batch.takes(r.cache) is not None for r in rows)
        uids, dead = [next(self._uids) for _ in rows], []
        try:
            put_together, dead = self._joining(batch, uids, rows, in_pages) if rows else (None, [])
        except Exception as exc:  # a cache that cannot be merged: these calls fail, the batch goes on
            for row in rows:
                row.call.fail(exc)
            rows, put_together = [], None
        if put_together is not None:
            try:
                self.batch = put_together()
            except Exception as exc:  # the batch's own failure: the step's handler fails the calls in it
                for row in rows:
                    row.call.fail(exc)
                raise
            self.dead.update(dead)
        for uid, row in [*placed, *zip(uids, rows)]:
            row.call.session.cache = None  # the batch holds the only copy until the call leaves
            if paged_cache.is_paged(row.cache):
                self.paged[uid] = row.cache
            self.rows[uid] = row.call
            self.fed_only.add(uid)
        self.counters["merges"] += bool(rows)
        if self.batch is not None:
            self._fill_slots()
            schedule(self.batch)  # before the pass (MaskedModel waits on the tokens)

    def _joining(self, batch: GenerationBatch | None, uids: list[int], rows: list[Row],
                 in_pages: bool) -> tuple[Callable[[], GenerationBatch], list[int]]:
        """The joining rows' part made (what raises concerns them alone): what puts it into the batch, and the
        dead rows' uids it adds. Laid out with the dead rows that round the batch up to its slot size
        (batch_rows.joined), or over pages (dead rows then come from `_fill_slots`)."""
        if not in_pages:
            n = (len(batch.uids) if batch is not None else 0) + len(rows)
            dead = [next(self._uids) for _ in range(slot_size(n, max(self.max_batch, n)) - n)]
            return joined(self.model, batch, uids, rows, dead, self.blanks), dead
        paged = rows_batch(self.model, uids, rows, in_pages)
        if batch is None:
            return (lambda: paged), []

        def put_paged() -> GenerationBatch:
            batch.extend(paged)
            return batch
        return put_paged, []

    def _fill_slots(self) -> None:
        """Dead rows up to the batch's slot size, so it has one of a few sizes."""
        batch = self.batch
        n = len(batch.uids)
        size = slot_size(n, max(self.max_batch, n))
        if size > n:
            uids = [next(self._uids) for _ in range(size - n)]
            batch.extend(dead_rows(self.model, uids, self.blanks, like=batch.prompt_cache))
            self.dead.update(uids)

    # -- stepping ---------------------------------------------------------------

    def _model(self, calls: list[Call | None], fed: mx.array) -> Any:
        """The model for a forward pass over `calls` (in row order; None: a dead slot) feeding `fed`:
        masked when any is constrained. `fed` must be the array the step before scheduled (or a
        constant), so waiting for its values never waits for this pass."""
        constraints = _constraints(calls)
        return MaskedModel(self.model, constraints, self.masks, fed) if any(constraints) else self.model

    def _row_calls(self) -> list[Call | None]:
        return [self.rows.get(uid) for uid in self.batch.uids] if self.batch is not None else []

    def _step_batch(self) -> None:
        if self.batch is None:
            return
        if paged_batch.in_pages(self.batch.prompt_cache):  # first: a row left out is out of its masks too
            self._reserve_pages()
        # mlx-lm's GenerationBatch feeds `_next_tokens`, sampled (and scheduled) by its step before.
        self.batch.model = self._model(self._row_calls(), self.batch._next_tokens)
        samplers = self.batch.samplers
        if self.rows_sampling and RowsSampler.fits(samplers):  # one op samples every row (each its own key)
            self.batch.samplers = [RowsSampler(samplers)] * len(samplers)
            self.counters["rows_sampled_together"] += 1
        started = time.perf_counter()
        try:
            responses = self.batch.next()
        except Exception as exc:
            log.exception("batched decode step failed; failing its %d calls", len(self.rows))
            self.fed_only.clear()
            self.dead.clear()
            self.paged.clear()
            self.masks.forget([call.constraint for call in self.rows.values()])
            for call in self.rows.values():
                call.fail(exc)
            self.rows.clear()
            self.batch = None
            return
        finally:
            if self.batch is not None:
                self.batch.samplers = samplers
        nexted = time.perf_counter()
        self.spent["batch_next_s"] += nexted - started
        fed_only, done = self.fed_only, []
        self._count(len(responses) - len(fed_only) - len(self.dead))
        for i, r in enumerate(responses):
            if r.uid in fed_only or r.uid in self.dead:  # fed its pending token (a prompt's last, or one
                continue  # handed out), or a dead slot's
            reason = self.rows[r.uid].output.add(r.token)
            if reason is not None:
                done.append((i, r.uid, reason))
        fed_only.clear()
        if done:
            left = time.perf_counter()
            self._leave(done)
            self.spent["leave_s"] += time.perf_counter() - left
        if self.batch is not None:  # the rows that go on: their next mask, filled while this thread goes on
            self.masks.prefetch(_constraints(self._row_calls()), self.batch._next_tokens)
        self.spent["batch_outputs_s"] += time.perf_counter() - nexted

    def _reserve_pages(self) -> None:
        """A paged batch's room for the step's tokens, taken before its pass: a row the pool has no page for
        fails alone (PagePoolFullError), its slot dead; the other rows decode."""
        batch = self.batch
        for i in batch.prompt_cache[0].rows.begin_step():
            uid = batch.uids[i]
            call = self.rows.pop(uid)
            self.paged.pop(uid, None)
            self.fed_only.discard(uid)
            self.dead.add(uid)
            retire(batch, i)
            self.masks.forget([call.constraint])
            call.fail(PagePoolFullError(f"session {call.session.id}: no page left for its next token "
                                        f"({batch.prompt_cache[0].pool.limit} pages, all held)"))

    def _leave(self, done: list[tuple[int, int, str]]) -> None:
        """Give finished rows back to their sessions as plain caches; their slots stay, dead, for the
        next calls, until half the batch is dead: then it keeps only its live rows (at a slot size)."""
        batch = self.batch
        assert batch is not None
        for i, uid, reason in done:
            call = self.rows.pop(uid)
            if self._extract(uid, i, call):
                mx.async_eval(paged_cache.state_arrays(call.session.cache))  # queued behind the pass: no stall
                call.finish(reason)
            retire(batch, i)
            self.dead.add(uid)
        if 2 * len(self.dead) >= len(batch.uids):
            started = time.perf_counter()
            self._compact()
            self.spent["compact_s"] += time.perf_counter() - started

    def _extract(self, uid: int, i: int, call: Call) -> bool:
        """Row i's cache back to `call`'s session: a plain copy out of the batch, or the pages its call
        brought, with the tokens the batch added written after theirs. False when those tokens find no page
        (PagePoolFullError, a merged row of paged layers): the call fails alone, its session's cache dropped
        (rebuilt from its tokens on next use)."""
        row = extract_row(self.batch.prompt_cache, i)
        paged = self.paged.pop(uid, None)
        try:
            call.session.cache = paged_cache.fill(paged, row) if paged is not None else row
        except PagePoolFullError as exc:
            call.session.cache = None
            self.masks.forget([call.constraint])
            call.fail(exc)
            return False
        return True

    def _compact(self) -> None:
        """The batch keeps only its live rows (cut to the longest of them), at their slot size."""
        batch = self.batch
        assert batch is not None
        keep = [i for i, uid in enumerate(batch.uids) if uid not in self.dead]
        self.dead.clear()
        self.counters["compactions"] += 1
        if not keep:
            self.batch = None
            return
        batch.filter(keep)
        self._fill_slots()
        schedule(batch)  # the rows kept: scheduled before the next pass

    def _step_solo(self, call: Call) -> None:
        assert call.solo is not None
        try:
            token = call.solo.step()
        except Exception as exc:
            self.solo.remove(call)
            self.masks.forget([call.constraint])
            call.fail(exc)
            return
        self._count(1)
        reason = call.output.add(token)
        if reason is not None:
            self.solo.remove(call)
            call.solo = None
            call.finish(reason)
        else:
            self.masks.prefetch([call.constraint], call.solo.next)

    def _count(self, tokens: int) -> None:
        self.counters["decode_steps"] += 1
        self.counters["decode_tokens"] += tokens

    def status(self) -> dict[str, Any]:
        masks = self.masks
        return {"running": self.running, "waiting": len(self.waiting), **self.counters,
                "batch_rows": len(self.batch.uids) if self.batch is not None else 0, "dead_rows": len(self.dead),
                "step_ms": round(self.step_s * 1000, 3), **{k: round(v, 4) for k, v in self.spent.items()},
                "mask_fills": masks.fills,
                "mask_fill_ms": round(masks.fill_s / masks.fills * 1000, 4) if masks.fills else None,
                "mask_passes": masks.timing["passes"], "masks_ready_ahead": masks.timing["ready"],
                "mask_take_ms": round(masks.timing["take_s"] / masks.timing["passes"] * 1000, 4)
                if masks.timing["passes"] else None}


def _constraints(calls: list[Call | None]) -> list[Constraint | None]:
    return [call.constraint if call is not None else None for call in calls]


def _cache(call: Call) -> list | None:
    """The cache a call decodes on: its lone decode's, else its session's."""
    return call.solo.cache if call.solo is not None else call.session.cache


def _length(call: Call) -> int:
    """Tokens in the call's cache, give or take the one being fed."""
    return call.session.processed + len(call.output.tokens)


def run_alone(decoder: Decoder, call: Call) -> GenerateResult:
    """Drive `call` to its end on the calling (engine) thread: the in-process engine's generate."""
    decoder.join(call)
    while not call.future.done():
        decoder.step()
    return call.future.result()
