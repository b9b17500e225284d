"""`kvwake serve`: open the store, load the model, serve the socket, sleep everything on the way out.

Start: the socket's folder is made 0700 and the socket 0600. A socket file
left by a dead daemon is replaced; one a live daemon answers on makes this one
exit (code 2) with a clear message. The store opens (recovering from any
crash: SQLite rolls back, orphans wait for gc), the model loads on the engine
thread, every stored session is known as asleep, then the socket is served.
A status file next to the socket (`kvwake.json`: pid, socket, version, model)
tells the CLI who is serving.

Stop (SIGTERM, SIGINT or the `shutdown` method): stop accepting, refuse new
requests (CANCELLED), stop running generations after their current token,
wait for operations in flight, sleep every hot session, finish the remote
uploads (the one under way and those queued, within REMOTE_FLUSH_S), close
connections, remove the socket and status file. Exit 0, or 1 if a session could not be
slept (it is named in the log; its previous snapshot is intact).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import fcntl
import functools
import importlib.util
import json
import logging
import os
import signal
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx

import kvwake
from kvwake.daemon import gilwatch
from kvwake.daemon.config import Settings
from kvwake.daemon.sessions.matching import expire
from kvwake.daemon.fronts.rpc import Server, default_allow, unix_listener
from kvwake.daemon.kv import restore_buffers
from kvwake.daemon.kv.hot_set import HotSet
from kvwake.daemon.model.budget import ModelsBudgetError, check_pinned
from kvwake.daemon.model.kernel_cache import keep_compiled_kernels
from kvwake.daemon.model import loader
from kvwake.daemon.model.loader import start_model, stop_model, warm_model
from kvwake.daemon.model.provider import LoadedModel, ModelProvider
from kvwake.daemon.model.registry import Registry
from kvwake.daemon.model.thread import process_age_s
from kvwake.daemon.timing import Phases
from kvwake.daemon.sessions.manager import SessionManager
from kvwake.daemon.sessions.models import BUNDLES_FILE, read_bundles
from kvwake.daemon.sessions.read_ahead import new_reader
from kvwake.store import Store
from kvwake.store.files import write_durable

__all__ = ["DaemonRunningError", "JsonFormatter", "prepare_socket", "run"]

log = logging.getLogger("kvwake.daemon")
SHUTDOWN_WAIT_S = 120.0
HTTP_GRACE_S = 10.0  # at stop, open HTTP responses get this long to end
REMOTE_FLUSH_S = 30.0  # at stop, queued uploads get this long (they stay local either way)
_STD_ATTRS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class DaemonRunningError(RuntimeError):
    """Another daemon answers on the socket."""


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, and the record's extra facts."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                "event": record.getMessage()}
        line.update({k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS})
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("kvwake")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def prepare_socket(path: Path) -> None:
    """Make the folder private; remove a stale socket; refuse if a daemon is alive on it."""
    if not path.parent.exists():  # a folder we make is private; an existing one (a home dir) is left alone
        path.parent.mkdir(mode=0o700, parents=True)
    if not (path.exists() or path.is_symlink()):
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise DaemonRunningError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError, socket.timeout, OSError):
        path.unlink(missing_ok=True)  # nobody listens: a dead daemon's leftover
        return
    finally:
        probe.close()
    raise DaemonRunningError(f"a kvwake daemon is already serving {path}; stop it first (kvwake status shows its pid)")


def write_status(settings: Settings, model: LoadedModel, *, http_url: str | None = None,
                 models: list[str] | None = None) -> None:
    status = {"pid": os.getpid(), "socket": str(settings.socket), "version": kvwake.__version__,
              "model": model.name, "bundle_hash": model.bundle.hash, "started": time.time()}
    if models is not None and len(models) > 1:  # the names served, the default first (`kvwake http --env`)
        status["models"] = models
    if http_url is not None:  # where `kvwake http` and openai_config() find the API (the token stays in its file)
        status["http"] = {"url": http_url, "token_file": str(settings.http_token_file) if settings.http_auth
                          and settings.http_token is None else None, "auth": settings.http_auth}
    write_durable(settings.status_file, json.dumps(status, indent=1).encode())


def remove_own_files(settings: Settings, *, keep_socket: bool = False) -> None:
    with contextlib.suppress(OSError, ValueError):
        if json.loads(settings.status_file.read_text()).get("pid") == os.getpid():
            settings.status_file.unlink()
    if not keep_socket:  # a passed-in socket is the service manager's: it keeps listening on it
        settings.socket.unlink(missing_ok=True)


def hold_daemon_lock(settings: Settings) -> int:
    """Take `<socket>.lock` exclusively for the daemon's life; the fd must stay open.

    Two daemons started at once would both find no socket while loading their
    models (the listener binds later); the lock decides which one serves. The
    kernel releases it when the process dies, kill -9 included.
    """
    path = settings.socket.with_name(settings.socket.name + ".lock")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DaemonRunningError(f"a kvwake daemon is already serving (or starting on) {settings.socket}; "
                                 "stop it first (kvwake status shows its pid)") from None
    return fd


def run(settings: Settings, *, listen_socket: socket.socket | None = None) -> int:
    """Serve until stopped; returns the process exit code."""
    setup_logging(settings.log_level)
    faulthandler.enable(all_threads=True)  # a crash in native code (MLX, CUDA) leaves every thread's stack in the log
    age = process_age_s()
    started = Phases()  # where the start went, logged with "ready" and kept for status
    if age is not None:
        started.ms["process"] = round(age * 1000, 1)  # exec to here: Python and the imports
    try:
        lock_fd = hold_daemon_lock(settings)
        if listen_socket is None:
            prepare_socket(settings.socket)
        http = open_http(settings)  # before the model loads: a port in use fails at once
    except (DaemonRunningError, ValueError, OSError, RuntimeError) as exc:
        print(f"kvwake serve: {exc}", file=sys.stderr)
        return 2
    started.mark("lock")
    keep_compiled_kernels()
    store = Store(settings.store_dir, block_tokens=settings.block_tokens, codec=settings.codec,
                  budget_bytes=settings.store_budget_bytes, keep_history=settings.keep_history,
                  auto_among=restore_buffers.auto_codecs(settings.tuning.restore_mode))
    started.mark("store")
    try:
        registry = Registry.from_settings(settings)
    except ValueError as exc:
        print(f"kvwake serve: {exc}", file=sys.stderr)
        return 2
    hot_set = read_hot_set(settings, store, registry.default.name)  # beside the model's load
    provider = ModelProvider()
    try:
        engine, thread = start_model(settings, store, registry.default, None,  # MLX's limits set on its thread
                                     neighbours=list(registry), ram_tier=hot_set.tier if hot_set else None,
                                     wakes_ahead=hot_set.wakes_ahead if hot_set else None)
    except BaseException:  # a model that does not load: the reading ends (its threads read the store) first
        if hot_set is not None:
            hot_set.stop()
        raise
    provider.add(engine, thread, registry.default.name)
    if hot_set is not None:  # sessions of the model's name whose snapshots another bundle made cannot wake on it
        hot_set.keep_bundle(engine.bundle.hash)
    start = functools.partial(start_model, settings, store, limits=engine.limits)  # later loads: the same limits
    try:  # pinned models are never unloaded: together they must fit the memory budget (model/budget.py)
        check_pinned(registry, settings, engine.weights_bytes, engine.limits)
    except ModelsBudgetError as exc:
        if hot_set is not None:
            hot_set.stop()
        stop_model(LoadedModel(engine, thread, registry.default.name))
        store.close()
        print(f"kvwake serve: {exc}", file=sys.stderr)
        return 2
    for spec in registry:
        if spec.pinned and spec is not registry.default:
            provider.add(*start(spec), spec.name)  # pinned models load before serving
    started.mark("engine")
    started.ms.update({f"engine.{k}": v for k, v in engine.started.ms.items()})
    manager = SessionManager(provider, settings, registry, start)
    manager.started, manager.hot_set = started, hot_set
    if settings.remote is not None:
        from kvwake.daemon.sessions.remote_tier import RemoteTier  # obstore loads only when a remote is configured

        manager.remote = RemoteTier(settings, engine)
    try:
        return anyio.run(_serve, settings, manager, listen_socket, http, backend="asyncio",
                         backend_options={"use_uvloop": _have_uvloop()})
    finally:
        if http is not None:
            http[0].close()
        if manager.remote is not None:
            manager.remote.close()
        if hot_set is not None:  # its reads end before the store closes
            hot_set.stop()
        manager.read_ahead.close()  # and those of the loads' readers
        for model in manager.models:
            stop_model(model)  # each model's writes finished while its engine thread runs, then it stops
        store.close()
        os.close(lock_fd)


def read_hot_set(settings: Settings, store: Store, model_name: str) -> HotSet | None:
    """The reader of the hot set (kv/hot_set.py), started, filling the RAM tier the default model's engine will
    take (`model_name`'s: the sessions of bundles other models had here are left out; sessions/read_ahead.py
    `new_reader`); None where the tuning switches it off."""
    if not settings.tuning.restart_prefetch:
        return None
    others = frozenset(b for b, name in read_bundles(Path(settings.data_dir) / BUNDLES_FILE).items()
                       if name != model_name)
    return new_reader(settings, store, other_bundles=others).start()


def open_http(settings: Settings) -> tuple[socket.socket, str | None] | None:
    """The HTTP API's listening socket and bearer token, when `--http` is set (daemon/fronts/http.py).

    Raises ValueError for a bad address or a token check switched off on a non-loopback one,
    OSError when the port cannot be bound, HttpTokenError for an unsafe token file.
    """
    if settings.http is None:
        return None
    from kvwake.daemon.fronts.http_access import bind, is_loopback, parse_address, read_token

    host, port = parse_address(settings.http)
    if not settings.http_auth and not is_loopback(host):
        raise ValueError(f"--http-no-token serves loopback addresses only, not {host}")
    token = None
    if settings.http_auth:
        token = settings.http_token or read_token(settings.http_token_file, create=True)
    return bind(host, port), token


def _http_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def _have_uvloop() -> bool:
    """uvloop where it is installed (Linux, macOS): it halves the loop's share of a round trip
    (docs/decisions.md, "RPC front (issue 14)"); the stock loop otherwise, with the same behaviour."""
    return importlib.util.find_spec("uvloop") is not None


async def _serve(settings: Settings, manager: SessionManager, listen_socket: socket.socket | None,
                 http: tuple[socket.socket, str | None] | None) -> int:
    await manager.load()
    manager.started.mark("sessions")
    manager.collector.install()  # the garbage collector's runs, timed (status.gc)
    stop = anyio.Event()
    server = Server(manager, allow_uids=default_allow(settings.allow_uids), read_timeout_s=settings.read_timeout_s,
                    out_buffer_bytes=settings.out_buffer_bytes, shutdown=stop.set)
    listener = await asyncio.get_running_loop().create_unix_server(
        server.protocol, sock=listen_socket if listen_socket is not None else unix_listener(settings.socket))
    write_status(settings, manager.model, http_url=_http_url(http[0]) if http else None,
                 models=manager.model_names())
    http_done = anyio.Event()
    try:
        manager.gil_watch = gilwatch.from_tuning(settings.tuning)  # waits for the GIL (status.gil): a diagnostic, off by default
        if manager.gil_watch is not None:
            manager.gil_watch.start()
        async with anyio.create_task_group() as services:
            services.start_soon(_signals, stop)
            services.start_soon(_lifecycle, manager, settings)
            services.start_soon(_warm, manager.models, manager.hot_set)
            if manager.remote is not None:  # connects (retrying) and uploads in the background
                services.start_soon(manager.remote.run)
            if http is not None:
                services.start_soon(_serve_http, manager, http, stop, http_done)
            manager.started.mark("listen")
            log.info("ready", extra={"socket": str(settings.socket), "model": manager.model.name,
                                     "startup_ms": manager.started.ms,
                                     "bundle": manager.model.bundle.hash, "sessions": len(manager.entries),
                                     "http": _http_url(http[0]) if http else None,
                                     "event_loop": type(asyncio.get_running_loop()).__module__})
            await stop.wait()
            if http is not None:  # generations end after their current token; open HTTP streams get to finish
                manager.stopping = True
                with anyio.move_on_after(HTTP_GRACE_S):
                    await http_done.wait()
            services.cancel_scope.cancel()
        listener.close()  # new clients are refused at once, not left unanswered during the drain
        failed = await _drain(manager)
        if manager.remote is not None:
            await manager.remote.flush(REMOTE_FLUSH_S)
        await server.close()
    finally:
        listener.close()
        remove_own_files(settings, keep_socket=listen_socket is not None)
        manager.collector.uninstall()  # a process may serve again (tests do): one watcher at a time
        if manager.gil_watch is not None:
            manager.gil_watch.stop()
    log.info("stopped", extra={"unslept": failed})
    return 1 if failed else 0


async def _serve_http(manager: SessionManager, http: tuple[socket.socket, str | None], stop: anyio.Event,
                      done: anyio.Event) -> None:
    from kvwake.daemon.fronts.http import run_http  # Starlette and Hypercorn load only when --http is set

    try:
        await run_http(manager, http[0], http[1], stop)
    finally:
        done.set()


async def _signals(stop: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("signal", extra={"signal": signal.Signals(signum).name})
            stop.set()
            return


async def _warm(models: ModelProvider, hot_set: HotSet | None) -> None:
    """Each model's warm-up after the daemon answers, one model at a time (model/loader.py `warm_model`);
    a model loaded later warms as it loads (sessions/models.py). After a restart with a hot set, the warm-up
    first waits for its sessions' wakes (at most loader.WARM_HOLD_S in all): their agents come back at once, and
    a warm-up job that began just before them (a job is not cut) held their wakes (docs/benchmarks.md, "fleet")."""
    held = time.monotonic()
    left = (lambda: hot_set.wakes_left() and time.monotonic() - held < loader.WARM_HOLD_S) if hot_set else None
    for name in models.names():  # each taken at its turn: one unloaded meanwhile is not held here (its memory
        if name in models:  # goes with its unload's collection) and not warmed
            await warm_model(models.get(name), left)


async def _lifecycle(manager: SessionManager, settings: Settings) -> None:
    """Sleep idle and over-budget sessions; now and then, expire old stateless sessions and gc the store."""
    last_gc = time.monotonic()
    while True:
        await anyio.sleep(settings.lifecycle_interval_s)
        try:
            await manager.enforce_limits()
            await manager.unload_idle()
            if time.monotonic() - last_gc >= settings.gc_interval_s:
                last_gc = time.monotonic()
                if settings.stateless_ttl_s is not None:  # first: their snapshots' blocks become evictable
                    await expire(manager, settings.stateless_ttl_s)
                report = await anyio.to_thread.run_sync(
                    lambda: manager.store.gc(budget_bytes=settings.store_budget_bytes))
                log.info("gc", extra=dict(report.__dict__))
        except Exception:
            log.exception("lifecycle pass failed")


async def _drain(manager: SessionManager) -> list[str]:
    """Stop generations, wait for operations in flight, sleep every hot session."""
    manager.stopping = True
    with anyio.move_on_after(SHUTDOWN_WAIT_S):
        while manager.entries.models.claims():
            await anyio.sleep(0.02)
    results: dict[str, Any] = await manager.sleep_all()
    failed = [sid for sid, r in results.items() if isinstance(r, dict)]
    for sid in failed:
        log.error("session not slept at shutdown", extra={"session": sid, **results[sid]})
    return failed
