"""The engine's append protocol and a generate call's start: input planned, checked, adopted, prefilled.

Part of the `Engine` (model/engine.py takes these methods), by responsibility: here what a turn feeds
the model, there the loaded model, its caches, sleep and wake. An append is plan (render the input,
compare with the session's tokens), check (the context and the memory), a prefix for a fresh cache
(stored blocks; the daemon's manager may offer a hot session's copy), apply (adopt the prefix or cut
the cache back, then prefill the rest one chunk per engine job: the chunks, packs and slices are the
scheduler's, model/scheduler/prefill.py). All but the last token are prefilled: it stays pending, for
the call that generates from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from kvwake.daemon.jobs import Mlx, Packed, direct, outcome
from kvwake.daemon.kv import points, prefixhit
from kvwake.daemon.model.decode_calls import Call
from kvwake.daemon.model.decoder import run_alone
from kvwake.daemon.model.generation import GenerateParams, GenerateResult, OnEvent, TextOutput
from kvwake.daemon.model.prompt import Plan
from kvwake.daemon.model.scheduler import slices
from kvwake.daemon.session_state import Session, common_prefix
from kvwake.errors import CancelledError, InvalidParamsError

__all__ = ["Appending", "ShouldStop"]

# A stored point at most this many tokens past a session's held one is not worth its restore: the held point and a
# prefill of those few tokens come sooner than reading and uploading every block before the stored one (the whole
# prefix). A resend parting inside the last reply after a pause, when the reply's point was taken in the idle
# time, goes back to the held point (docs/decisions.md, "Restore points": the figures).
HELD_LEAD = 512

# Asked between prefill chunks: True when the caller is gone (a client that left, a daemon stopping).
ShouldStop = Callable[[], bool] | None
THINK_LOOKBACK = 64  # tokens at a prompt's end where a template's opened thinking span is looked for


class Appending:
    """The engine's turns (see the module docstring); `Engine` holds the model, caches and policy they use."""

    def plan(self, session: Session, **inputs: Any) -> Plan:
        """What appending `inputs` will make of the session (Prompter.plan); changes nothing."""
        return self.prompter.plan(session, **inputs)

    def append(self, session: Session, *, messages: Any = None, text: Any = None, tokens: Any = None,
               tools: Any = None, whole: bool = False, prompt: Plan | None = None, mlx: Mlx = direct,
               should_stop: ShouldStop = None) -> dict[str, int]:
        """Add input and prefill it (all but the last token, which stays pending), in process: plan, check,
        take a stored prefix, apply. The daemon's session manager runs the same steps itself (with room
        made and a hot session's prefix offered between them: sessions/manager.py).

        `prompt`: a `render` made already (taken as it is). Store and codec work run on the caller's
        thread and the pool, MLX work through `mlx`, one prefill chunk per call. Returns {"tokens": total,
        "prefilled": n, "reused": n from the prefix cache}. Raises ContextTooLongError before any prefill,
        CancelledError when `should_stop` says so between chunks (see `prefill`).
        """
        plan = self.plan(session, messages=messages, text=text, tokens=tokens, tools=tools, whole=whole,
                         prompt=prompt)
        self.check_fits(len(plan.target))
        held = self.held_serves(session, plan.target)
        prefix = self.stored_prefix(plan.target, mlx) if self.wants_prefix(session, plan.target, held) else (None, 0)
        return self.apply(session, plan, prefix, mlx, should_stop)

    def _keep(self, session: Session, target: list[int]) -> int:
        """How much of the session's cache stays valid for `target` (at least one token stays pending)."""
        return min(common_prefix(session.tokens[: session.processed], target), len(target) - 1)

    def needs_fresh_cache(self, session: Session, target: list[int], keep: int | None = None) -> bool:
        """True when appending `target` cannot keep the session's cache (none yet, or it cannot be cut back);
        `keep`: `_keep(session, target)` when the caller has it."""
        if session.cache is None:
            return True
        if can_trim_prompt_cache(session.cache):  # cut back to any length: kept (no token compare, the
            return False  # manager asks this on its event loop)
        keep = self._keep(session, target) if keep is None else keep
        return keep < session.processed

    def wants_prefix(self, session: Session, target: list[int], held: bool = False) -> bool:
        """Whether appending `target` starts the session on a fresh cache that a stored or shared prefix
        could fill: the model's caches can be cut by token (or it takes restore points: kv/points.py), and
        the session's own cache cannot be kept."""
        return (self.cuttable or self.points.enabled) and len(target) >= 2 and self.needs_fresh_cache(session, target) \
            and not held

    def held_serves(self, session: Session, target: list[int]) -> bool:
        """Whether appending `target` can go back to the session's held point (kv/points.py `hold`) rather than
        look in the store (`wants_prefix`'s `held`): it holds one, at or before what its cache keeps for
        `target`, and the store holds no point before there deeper than HELD_LEAD tokens past it (a reply's,
        model/reply_points.py). Reads the store: off the event loop and the engine thread."""
        held = session.held_point
        if held is None or session.cache is None:
            return False
        keep = self._keep(session, target)
        return 0 < held[0] <= keep and not self.points.stored_after(target, held[0] + HELD_LEAD, keep)

    def stored_prefix(self, target: list[int], mlx: Mlx = direct) -> tuple[list | None, int]:
        """A cache restored from the longest run of stored blocks that starts `target` (kv/prefixhit.py):
        (cache, tokens it holds), or (None, 0). A bad block shortens the hit; it never fails the append.
        With `paged_kv`, blocks resident in pages are mapped first (kv/paging.py)."""
        if self.pages is not None:
            return self.pages.prefix(self.kv.make_cache, target,
                                     lambda: prefixhit.stored_prefix(self.kv, target, mlx), mlx)
        return prefixhit.stored_prefix(self.kv, target, mlx)

    def apply(self, session: Session, plan: Plan, prefix: tuple[list | None, int] = (None, 0),
              mlx: Mlx = direct, should_stop: ShouldStop = None) -> dict[str, int]:
        """Make the cache cover plan.target[:-1]: keep the common prefix, take `prefix` (a restored cache), prefill the rest.

        MLX work goes through `mlx` one chunk at a time, so other sessions decode between the chunks.
        """
        upto = len(plan.target) - 1
        args = (session, plan, prefix, upto, should_stop)
        reused, chunk = mlx(Packed(self._adopt_and_start, self._start_turns, args) if self.planner.pack_prefill else
                            lambda: self._adopt_and_start(*args))
        prefilled = self.prefill(session, upto, mlx, should_stop, chunk)
        if self.pages is not None:  # its full blocks shared with the sessions that come after it
            mlx(lambda: self.pages.publish(session))
        self.persist(session, mlx)  # also when a restored prefix left nothing to prefill
        return {"tokens": len(plan.target), "prefilled": prefilled, "reused": reused}

    def _adopt_and_start(self, session: Session, plan: Plan, prefix: tuple[list | None, int], upto: int,
                         should_stop: ShouldStop = None) -> tuple[int, slices.Chunk | None]:
        """`_adopt`, then the first prefill chunk queued (when there is one and `should_stop` does not say
        stop: `prefill` then raises before any chunk), in one engine job: while calls decode a job waits for
        a step, and a turn's first token one job fewer."""
        reused = self._adopt(session, plan, prefix)
        start = session.processed < upto and not (should_stop is not None and should_stop())
        return reused, self.planner.chunk(session, upto) if start else None

    def _start_turns(self, jobs: list[Packed]) -> list[Any]:
        """The `_adopt_and_start` of every turn queued at once (a Packed job each, model/thread.py), in one
        job: each cache adopted, then the first chunks queued (the scheduler's `queue_chunks`: in packs). One
        turn: `_adopt_and_start` itself. An item is (tokens reused, the chunk queued or
        None), or the exception of that turn's adoption."""
        if len(jobs) == 1 or not self.planner.pack_prefill:
            return [outcome(lambda job=job: self._adopt_and_start(*job.args)) for job in jobs]
        results: list[Any] = []
        rows: list[tuple[int, Session, int]] = []  # (its result's index, session, upto) of each that starts a chunk
        for job in jobs:
            session, plan, prefix, upto, should_stop = job.args
            # One turn's failure (its adoption, its caller's should_stop) is that turn's item alone.
            reused = outcome(lambda: (self._adopt(session, plan, prefix),
                                       should_stop is not None and session.processed < upto and should_stop()))
            results.append(reused if isinstance(reused, BaseException) else [reused[0], None])
            if not isinstance(reused, BaseException) and session.processed < upto and not reused[1]:
                rows.append((len(results) - 1, session, upto))
        for (i, _, _), chunk in zip(rows, self.planner.queue_chunks([(session, upto) for _, session, upto in rows])):
            results[i] = chunk if isinstance(chunk, BaseException) else [results[i][0], chunk]
        return [r if isinstance(r, BaseException) else tuple(r) for r in results]

    def _adopt(self, session: Session, plan: Plan, prefix: tuple[list | None, int]) -> int:
        """Cut the session's cache back to what plan.target keeps (or take `prefix`); returns tokens reused."""
        target, keep = plan.target, self._keep(session, plan.target)
        if session.held_point is not None and session.held_point[0] > keep:  # tokens it was taken over part
            session.held_point = None
        reused = 0
        held = session.held_point
        if self.needs_fresh_cache(session, target, keep):
            # back to the held point unless a stored prefix restored more (wants_prefix chose: the store's point was
            # deeper; it may have given less after all, a point that did not verify)
            if held is not None and session.cache is not None and 0 < held[0] <= keep and prefix[1] < held[0]:
                reused = points.back_to_held(session)  # reused from a point, as a stored one's tokens are
                self.points.count_held(reused)
                self.counters.add("tokens_reused", reused)
            else:
                session.cache, session.processed, session.held_point = None, 0, None  # cannot be rewound
        elif keep < session.processed:
            trim_prompt_cache(session.cache, session.processed - keep)
            session.processed = keep
        session.restored = min(session.restored, keep, session.processed) if session.cache is not None else 0
        if session.cache is None:
            cache, reused = prefix
            session.cache = cache if cache is not None else self.make_cache()
            session.processed = reused
            self.counters.add("tokens_reused", reused)
        session.mode, session.messages, session.tools, session.tokens = plan.mode, plan.messages, plan.tools, target
        return reused

    def prefill(self, session: Session, upto: int, mlx: Mlx = direct, should_stop: ShouldStop = None,
                chunk: slices.Chunk | None = None) -> int:
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
                    planner = self.planner
                    chunk = mlx(Packed(planner.chunk, planner.next_chunks, (session, upto)) if planner.pack_prefill
                                else lambda: planner.chunk(session, upto))
                since = chunk.start_of(session)
                try:
                    while not chunk.done:
                        mlx(chunk.step_job)  # a packed chunk's callers: one job for those queued together
                finally:
                    if not chunk.done:  # a slice's job did not run to its end: nothing may wait on the rest
                        mlx(chunk.abandon)
                chunk = None
                # at a wanted block boundary: the planner stopped there, or (rings alone) the chunk passed it
                self.points.take(session, upto, mlx, since)
                self.persist(session, mlx)
        finally:
            self.counters.add("tokens_prefilled", session.processed - start)
        self.planner.build_ahead(session, upto - start, mlx)
        return upto - start


    def generate(self, session: Session, params: GenerateParams, on_event: OnEvent | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerateResult:
        """Generate from the session's pending tokens, alone; the reply becomes part of the session (and a
        restore point where it crossed a block boundary: model/reply_points.py)."""
        reply_start = len(session.tokens)
        result = run_alone(self.decoder, self.start_call(session, params, on_event, should_stop))
        self.reply_points.offer(session, reply_start)
        return result

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
            prefix = self.stored_prefix(plan.target, mlx) if self.wants_prefix(session, plan.target) else (None, 0)
            self.apply(session, plan, prefix, mlx, should_stop)
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
            session.restored = min(session.restored, session.processed)
        else:
            raise InvalidParamsError(f"session {session.id} has nothing to generate from: append input first",
                                     session_id=session.id)
