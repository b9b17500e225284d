"""One server through the fleet's workload: T rounds, every agent's turn of a round sent at once; then the
server restarted and one more round."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from bench.fleet.agents import AnthropicAgent, Fleet, OpenAIAgent, Texts, Turn
from bench.fleet.servers import Life

__all__ = ["DIALECTS", "Round", "Run", "run_server"]

DIALECTS = {"openai": OpenAIAgent, "anthropic": AnthropicAgent}


@dataclass(frozen=True)
class Round:
    turns: tuple[Turn, ...]
    wall_s: float  # the first turn sent to the last one's end


@dataclass(frozen=True)
class Run:
    """A server's whole run: its rounds before the restart, the round after, and its two processes."""

    server: str
    dialect: str
    rounds: tuple[Round, ...]
    after_restart: Round
    lives: tuple[Life, Life]
    restart_first_token_s: float  # the restarted process's start to the after-restart round's first token


class TurnFailed(RuntimeError):
    """An agent's turn raised; the round is not measured."""


def one_round(server: Any, agents: list[Any], dialect: str) -> Round:
    """Every agent's next turn at once (threads behind a barrier), each over its own client."""
    clients = [getattr(server, dialect)() for _ in agents]
    barrier, turns = threading.Barrier(len(agents)), [None] * len(agents)
    failed: list[tuple[int, BaseException]] = []

    def send(i: int) -> None:
        barrier.wait()
        try:
            turns[i] = agents[i].send(clients[i], server.model_name)
        except Exception as exc:  # noqa: BLE001 - reported for the round below, with the agent's number
            failed.append((i, exc))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    if failed:
        i, exc = failed[0]
        raise TurnFailed(f"{server.name} ({dialect}): agent {i}'s turn failed ({len(failed)} of {len(agents)} "
                         f"did): {exc!r}") from exc
    done = [t for t in turns if t is not None]
    return Round(tuple(done), max(t.sent_at + t.wall_s for t in done) - min(t.sent_at for t in done))


def say(line: str) -> None:
    print(line, flush=True)


def run_server(server: Any, dialect: str, fleet: Fleet, texts: Texts, system: str, log: Any = say) -> Run:
    """`server` (stopped) through the fleet in `dialect`: started, T rounds, restarted, one round, stopped."""
    agents = [DIALECTS[dialect](i, fleet, texts, system) for i in range(fleet.agents)]
    try:
        ready = server.start()
        log(f"{server.name} {dialect}: answering {ready:.2f} s after its start")
        rounds = []
        for r in range(fleet.turns):
            rounds.append(one_round(server, agents, dialect))
            log(f"{server.name} {dialect} round {r + 1}: {rounds[-1].wall_s:.2f} s")
        first = server.stop(ready)
        ready = server.start()
        after = one_round(server, agents, dialect)
        log(f"{server.name} {dialect} after the restart ({ready:.2f} s to answer): {after.wall_s:.2f} s")
        restart_first = min(t.first_at for t in after.turns) - server.started
        return Run(server.name, dialect, tuple(rounds), after, (first, server.stop(ready)), restart_first)
    finally:
        server.close()
