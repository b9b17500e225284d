"""Service definitions and `kvwake service`: rendered files, install/uninstall round trips, socket activation.

Nothing here starts a real service manager: install/uninstall run against a
temporary HOME with fake `systemctl`/`launchctl` scripts (or none) on PATH.
Socket activation is tested as systemd does it: a listening socket moved to
fd 3, LISTEN_FDS=1 and LISTEN_PID set to the pid that then execs the daemon.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvwake.client.service import MANIFEST_NAME, Manifest, plan_install, service
from kvwake.daemon.activation import ActivationError, listen_socket_from_env
from testkit.daemon import REPO, RawClient

# Moves the fds named in argv[1] to 3, 4, ..., sets LISTEN_PID to its own pid and LISTEN_FDS, then execs
# python with the rest of argv: what systemd does between fork and exec.
LAUNCH = textwrap.dedent("""
    import fcntl, os, sys
    fds = [int(a) for a in sys.argv[1].split(",") if a]
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
    for fd in fds:
        os.close(fd)
    for i, fd in enumerate(high):
        os.dup2(fd, 3 + i)
        os.close(fd)
    os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(fds)))
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
""")


def spawn_activated(fds: list[int], args: list[str], **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LAUNCH, ",".join(map(str, fds)), *args], pass_fds=fds,
                            cwd=REPO, **popen)


def listening_socket(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(16)
    return sock


# --- listen_socket_from_env ----------------------------------------------------------------------------------

def test_no_listen_pid_means_nothing_was_passed():
    env = {"LISTEN_FDS": "1"}
    assert listen_socket_from_env(env) is None
    assert env == {}  # unset like sd_listen_fds(1), whatever the outcome


@pytest.mark.parametrize("env", [
    {"LISTEN_PID": "{other}", "LISTEN_FDS": "1"},  # meant for another process (inherited by accident)
    {"LISTEN_PID": "{pid}", "LISTEN_FDS": "0"},
    {"LISTEN_PID": "{pid}"},
    {"LISTEN_PID": "{pid}", "LISTEN_FDS": "0", "LISTEN_FDNAMES": ""},
])
def test_fds_not_for_us_or_none_passed_give_none(env):
    env = {k: v.format(pid=os.getpid(), other=os.getpid() + 1) for k, v in env.items()}
    assert listen_socket_from_env(env) is None
    assert env == {}


@pytest.mark.parametrize(("env", "message"), [
    ({"LISTEN_PID": "abc", "LISTEN_FDS": "1"}, "LISTEN_PID='abc' is not a decimal integer"),
    ({"LISTEN_PID": "0", "LISTEN_FDS": "1"}, "LISTEN_PID='0' is out of range"),
    ({"LISTEN_PID": "{pid}", "LISTEN_FDS": "x"}, "LISTEN_FDS='x' is not a decimal integer"),
    ({"LISTEN_PID": "{pid}", "LISTEN_FDS": "-1"}, "LISTEN_FDS='-1' is out of range"),
    ({"LISTEN_PID": "{pid}", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "kvwake.socket"},
     "LISTEN_FDNAMES names 1 fds but LISTEN_FDS=2"),
])
def test_malformed_variables_raise(env, message):
    env = {k: v.format(pid=os.getpid()) for k, v in env.items()}
    with pytest.raises(ActivationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        listen_socket_from_env(env)
    assert env == {}


CHECK = textwrap.dedent("""
    import os, socket, sys
    from kvwake.daemon.activation import ActivationError, listen_socket_from_env
    try:
        sock = listen_socket_from_env()
    except ActivationError as exc:
        print("error:", exc)
    else:
        print(sock.fileno(), sock.getblocking(), os.get_inheritable(sock.fileno()), sock.getsockname())
    print(sorted(k for k in os.environ if k.startswith("LISTEN_")))
""")


def check_activated(fds: list[int], **env: str) -> list[str]:
    proc = spawn_activated(fds, ["-c", CHECK], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    return out.splitlines()


def test_takes_the_passed_listening_socket_nonblocking_and_close_on_exec(tmp_path):
    with listening_socket(tmp_path / "kvwake.sock") as sock:
        lines = check_activated([sock.fileno()], LISTEN_FDNAMES="kvwake.socket")
    assert lines == [f"3 False False {tmp_path / 'kvwake.sock'}", "[]"]


def test_skips_fds_that_are_not_listening_unix_stream_sockets(tmp_path):
    read_end, write_end = os.pipe()
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a Unix stream socket, but not listening
    with listening_socket(tmp_path / "kvwake.sock") as sock, idle:
        lines = check_activated([read_end, idle.fileno(), sock.fileno()])
    os.close(read_end), os.close(write_end)
    assert lines[0] == f"5 False False {tmp_path / 'kvwake.sock'}"


def test_passed_fds_without_a_listening_socket_raise():
    read_end, write_end = os.pipe()
    lines = check_activated([read_end])
    os.close(read_end), os.close(write_end)
    assert lines == ["error: LISTEN_FDS passed 1 fd(s) (unknown) but none is a listening AF_UNIX stream socket", "[]"]


def test_a_passed_fd_that_is_not_open_raises():
    code = ("import os; os.closerange(3, 4); os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); "
            "from kvwake.daemon.activation import listen_socket_from_env; listen_socket_from_env()")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert "ActivationError: fd 3 (unknown) from LISTEN_FDS is not open: Bad file descriptor" in result.stderr


# --- rendered service files ----------------------------------------------------------------------------------

ODD = "a b, 100% & <odd> \"q\" 's' $HOME \\"  # what each format must escape
EXECUTABLE_ODD = "a b, 100% & <odd> $HOME"  # systemd runs no executable whose path holds quotes or backslashes
ODD_SOCKET = Path("/tmp") / ODD / "kvwake.sock"  # short: sun_path holds 108 bytes (never bound here)


def test_plist_parses_with_every_required_key(tmp_path):
    socket_path, data_dir, home = ODD_SOCKET, tmp_path / ODD / "data", tmp_path / "home"
    plan = plan_install("launchd", python=sys.executable, socket=socket_path, data_dir=data_dir, home=home,
                        socket_activation=False)
    [(path, content)] = plan.files.items()
    assert path == str(home / "Library" / "LaunchAgents" / "com.kvwake.daemon.plist")
    plist = plistlib.loads(content.encode())
    assert plist["Label"] == "com.kvwake.daemon"
    assert plist["ProgramArguments"] == [sys.executable, "-m", "kvwake.client.cli", "serve"]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restart on crash, not after a clean stop
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == str(home / "Library/Logs/kvwake/kvwake.log")
    assert plist["EnvironmentVariables"]["KVWAKE_SOCKET"] == str(socket_path)
    assert plist["EnvironmentVariables"]["KVWAKE_DATA_DIR"] == str(data_dir)
    assert plist["ExitTimeOut"] >= 180  # time to sleep every session after SIGTERM


def systemd_words(line: str) -> list[str]:
    """A systemd ExecStart=/Environment= value as systemd reads it (quotes, %% and $$ undone)."""
    return [w.replace("%%", "%") for w in shlex.split(line.split("=", 1)[1])]


def test_systemd_units_carry_paths_exactly(tmp_path):
    python = tmp_path / EXECUTABLE_ODD / "python"
    plan = plan_install("systemd", python=str(python), socket=ODD_SOCKET,
                        data_dir=tmp_path / ODD / "data", home=tmp_path, socket_activation=True)
    unit = plan.files[str(tmp_path / ".config/systemd/user/kvwake.service")].splitlines()
    assert systemd_words(next(x for x in unit if x.startswith("ExecStart="))) == [
        str(python), "-m", "kvwake.client.cli", "serve"]
    env = dict(systemd_words(x)[0].split("=", 1) for x in unit if x.startswith("Environment="))
    assert env["KVWAKE_SOCKET"] == str(ODD_SOCKET)
    assert env["KVWAKE_DATA_DIR"] == str(tmp_path / ODD / "data")
    sock = plan.files[str(tmp_path / ".config/systemd/user/kvwake.socket")]
    assert f"ListenStream={str(ODD_SOCKET).replace('%', '%%')}\n" in sock


def test_systemd_default_socket_is_the_runtime_dir_specifier(tmp_path):
    plan = plan_install("systemd", python=sys.executable, socket=None, data_dir=tmp_path, home=tmp_path,
                        socket_activation=True)
    service_unit, socket_unit = plan.files.values()
    assert 'Environment="KVWAKE_SOCKET=%t/kvwake/kvwake.sock"' in service_unit
    assert "ListenStream=%t/kvwake/kvwake.sock\n" in socket_unit


@pytest.mark.parametrize("socket_activation", [True, False])
@pytest.mark.parametrize("odd", [False, True])
def test_systemd_units_pass_systemd_analyze_verify(tmp_path, socket_activation, odd):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian: apt-get install -y systemd)")
    base = tmp_path / (ODD if odd else "plain")
    # verify checks that ExecStart names an existing executable: the quoting must be right.
    python = tmp_path / (EXECUTABLE_ODD if odd else "plain") / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    plan = plan_install("systemd", python=str(python), socket=ODD_SOCKET if odd else None,
                        data_dir=base / "data", home=tmp_path / "home", socket_activation=socket_activation)
    for path, content in plan.files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    result = subprocess.run([analyze, "--user", "verify", *plan.files], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "HOME": str(tmp_path / "home"), "XDG_RUNTIME_DIR": str(runtime)})
    assert result.returncode == 0, result.stderr
    assert "kvwake" not in result.stderr, result.stderr  # verify only warns about many mistakes


@pytest.mark.parametrize("python", ["/opt/it's/python", '/opt/"py"/python', "/opt/back\\slash/python"])
def test_systemd_refuses_an_interpreter_path_it_cannot_run(tmp_path, python):
    with pytest.raises(click.ClickException, match="systemd cannot run an executable whose path holds a quote"):
        plan_install("systemd", python=python, socket=None, data_dir=tmp_path, home=tmp_path, socket_activation=False)


def test_refuses_a_socket_path_too_long_for_a_unix_socket(tmp_path):
    with pytest.raises(click.ClickException, match="socket path too long for a Unix socket"):
        plan_install("launchd", python=sys.executable, socket=tmp_path / ("x" * 120), data_dir=tmp_path,
                     home=tmp_path, socket_activation=False)


# --- install / uninstall -------------------------------------------------------------------------------------

FAKE_TOOL = """#!/bin/sh
echo "${0##*/} $*" >> "$TOOL_LOG"
case "$*" in *is-active*) echo active ;; esac
if [ -n "$TOOL_FAIL" ]; then case "$*" in *"$TOOL_FAIL"*) echo "Failed to connect to bus" >&2; exit 1 ;; esac; fi
exit 0
"""


class Home:
    """A temporary HOME and data dir, with fake systemctl/launchctl on PATH (or no tools at all)."""

    def __init__(self, root: Path, *, tools: bool) -> None:
        self.root, self.home, self.data = root, root / "home", root / "data"
        self.bin, self.tool_log = root / "bin", root / "tools.log"
        self.bin.mkdir()
        for name in ("systemctl", "launchctl") if tools else ():
            (self.bin / name).write_text(FAKE_TOOL)
            (self.bin / name).chmod(0o755)
        self.env = {"HOME": str(self.home), "PATH": str(self.bin), "TOOL_LOG": str(self.tool_log),
                    "KVWAKE_DATA_DIR": str(self.data), "KVWAKE_CONFIG": None, "XDG_CONFIG_HOME": None,
                    "KVWAKE_SOCKET": None, "KVWAKE_MODEL": None, "TOOL_FAIL": None}

    def __call__(self, *args: str, **env: str):
        return CliRunner().invoke(service, list(args), env={**self.env, **env}, catch_exceptions=False)

    def tools_ran(self) -> list[str]:
        lines = self.tool_log.read_text().splitlines() if self.tool_log.exists() else []
        self.tool_log.unlink(missing_ok=True)
        return lines

    def files(self) -> set[Path]:
        return {p for p in self.home.rglob("*") if p.is_file()}


def test_systemd_install_uninstall_round_trip(tmp_path, monkeypatch):
    for name in ("KVWAKE_CONFIG", "KVWAKE_MODEL", "XDG_CONFIG_HOME"):  # install carries them into the unit
        monkeypatch.delenv(name, raising=False)
    h = Home(tmp_path, tools=True)
    units = h.home / ".config" / "systemd" / "user"
    units.mkdir(parents=True)
    (units / "other.service").write_text("[Service]\nExecStart=/bin/true\n")  # not ours: must survive
    result = h("install")
    assert result.exit_code == 0, result.output
    assert h.tools_ran() == ["systemctl --user daemon-reload", "systemctl --user enable --now kvwake.socket"]
    expected = plan_install("systemd", python=sys.executable, socket=None, data_dir=h.data, home=h.home,
                            socket_activation=True)
    assert h.files() == {units / "other.service", units / "kvwake.service", units / "kvwake.socket"}
    assert all(Path(p).read_text() == c for p, c in expected.files.items())
    manifest = Manifest.read(h.data / MANIFEST_NAME)
    assert set(manifest.files) == set(expected.files) and manifest.socket_activation

    assert "already installed" in h("install").output
    status = h("status", "--json")
    assert '"kvwake.service": "active"' in status.output and '"ok"' in status.output
    assert h.tools_ran() == ["systemctl --user is-active kvwake.socket", "systemctl --user is-active kvwake.service"]

    result = h("uninstall")
    assert result.exit_code == 0, result.output
    assert h.tools_ran() == ["systemctl --user disable --now kvwake.socket kvwake.service",
                             "systemctl --user daemon-reload"]
    assert h.files() == {units / "other.service"}
    assert not (h.data / MANIFEST_NAME).exists()
    assert "not installed" in h("status").output


def test_uninstall_refuses_a_file_changed_since_install_unless_forced(tmp_path):
    h = Home(tmp_path, tools=True)
    assert h("install", "--no-socket-activation").exit_code == 0
    assert h.tools_ran()[-1] == "systemctl --user enable --now kvwake.service"
    unit = h.home / ".config/systemd/user/kvwake.service"
    unit.write_text(unit.read_text() + "Nice=5\n")  # the user tuned it
    assert "changed" in h("status").output
    h.tools_ran()
    result = h("uninstall")
    assert result.exit_code == 1
    assert f"Error: {unit} changed since install; not removing it (--force removes it anyway)" in result.output
    assert unit.exists() and h.tools_ran() == []  # refused before stopping anything
    result = h("uninstall", "--force")
    assert result.exit_code == 0, result.output
    assert h.tools_ran()[0] == "systemctl --user disable --now kvwake.service"
    assert h.files() == set()


def test_uninstall_keeps_everything_when_the_service_does_not_stop(tmp_path):
    h = Home(tmp_path, tools=True)
    assert h("install").exit_code == 0
    before = h.files()
    result = h("uninstall", TOOL_FAIL="disable")
    assert result.exit_code == 1
    assert "failed (exit 1): Failed to connect to bus; nothing removed" in result.output
    assert h.files() == before and (h.data / MANIFEST_NAME).exists()


def test_launchd_install_uninstall_without_launchctl_prints_the_commands(tmp_path):
    h = Home(tmp_path, tools=False)
    agents = h.home / "Library" / "LaunchAgents"
    agents.mkdir(parents=True)
    (agents / "com.example.other.plist").write_text("<plist/>")
    result = h("install", "--manager", "launchd", "--socket", str(tmp_path / "run" / "kvwake.sock"))
    assert result.exit_code == 0, result.output
    plist = agents / "com.kvwake.daemon.plist"
    assert f"launchctl bootstrap gui/{os.getuid()} {plist}" in result.output
    env = plistlib.loads(plist.read_bytes())["EnvironmentVariables"]
    assert env["KVWAKE_SOCKET"] == str(tmp_path / "run" / "kvwake.sock")
    assert (h.home / "Library/Logs/kvwake").is_dir()  # launchd does not create the log folder
    result = h("uninstall")
    assert result.exit_code == 0, result.output
    assert f"launchctl bootout gui/{os.getuid()}/com.kvwake.daemon" in result.output
    assert h.files() == {agents / "com.example.other.plist"}


def test_launchd_uninstall_boots_out_a_loaded_agent(tmp_path):
    h = Home(tmp_path, tools=True)
    assert h("install", "--manager", "launchd").exit_code == 0
    plist = h.home / "Library/LaunchAgents/com.kvwake.daemon.plist"
    assert h.tools_ran() == [f"launchctl bootstrap gui/{os.getuid()} {plist}"]
    assert h("uninstall").exit_code == 0
    assert h.tools_ran() == [f"launchctl print gui/{os.getuid()}/com.kvwake.daemon",
                             f"launchctl bootout gui/{os.getuid()}/com.kvwake.daemon"]
    assert not plist.exists()


def test_dry_run_changes_nothing(tmp_path):
    h = Home(tmp_path, tools=True)
    result = h("install", "--dry-run")
    assert result.exit_code == 0
    assert "would write" in result.output and "  systemctl --user enable --now kvwake.socket" in result.output
    assert h.files() == set() and not h.data.exists() and h.tools_ran() == []
    assert h("install").exit_code == 0
    h.tools_ran()
    before = h.files()
    result = h("uninstall", "--dry-run")
    assert "would remove" in result.output and "systemctl --user disable --now" in result.output
    assert h.files() == before and h.tools_ran() == []


def test_install_does_not_overwrite_a_file_it_did_not_write(tmp_path):
    h = Home(tmp_path, tools=False)
    unit = h.home / ".config/systemd/user/kvwake.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/usr/local/bin/my-kvwake\n")
    result = h("install")
    assert result.exit_code == 1
    assert f"{unit} exists and install did not write it; --force overwrites it" in result.output
    assert h("install", "--force").exit_code == 0
    assert "-m kvwake.client.cli serve" in unit.read_text()


def test_socket_activation_needs_systemd(tmp_path):
    result = Home(tmp_path, tools=False)("install", "--manager", "launchd", "--socket-activation")
    assert result.exit_code == 1 and "--socket-activation needs systemd" in result.output


# --- a daemon served through a passed socket -----------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from testkit.tinymodel import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny")


# What `kvwake serve` does once it detects activation itself (see test_kvwake_serve_takes_an_activated_socket).
SERVE_ACTIVATED = textwrap.dedent("""
    import sys
    from kvwake.daemon.activation import listen_socket_from_env, socket_path
    from kvwake.daemon.config import load_settings
    from kvwake.daemon.serve import run

    sock = listen_socket_from_env()
    assert sock is not None, "no socket passed"
    flags = {"socket": str(socket_path(sock)), "data_dir": sys.argv[1], "model": sys.argv[2], "block_tokens": 16}
    sys.exit(run(load_settings(flags), listen_socket=sock))
""")


def call(proc: subprocess.Popen, log: Path, conn: RawClient, method: str, **params):
    """A call that fails at once, with the daemon's log, if the daemon exits instead of answering."""
    msgid = conn.send(method, params)
    conn.sock.settimeout(0.2)
    deadline = time.monotonic() + 60
    while True:
        try:
            return conn.receive(msgid)
        except TimeoutError:
            if proc.poll() is not None:
                raise AssertionError(f"daemon exited {proc.returncode}:\n{log.read_text()[-3000:]}") from None
            if time.monotonic() > deadline:
                raise


def start_activated(tmp_path: Path, sock: socket.socket, args: list[str]) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "daemon.log"
    env = {**os.environ, "KVWAKE_CONFIG": str(tmp_path / "none.toml"), "LISTEN_FDNAMES": "kvwake.socket"}
    with open(log, "ab") as out:
        return spawn_activated([sock.fileno()], args, env=env, stdout=out, stderr=out), log


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def test_daemon_serves_a_client_through_an_activated_socket(tmp_path, model_dir):
    path = tmp_path / "run" / "kvwake.sock"
    with listening_socket(path) as sock:
        # The client connects before the daemon even started: the connection waits in the socket's queue.
        with RawClient(path) as client:
            serve = ["-c", SERVE_ACTIVATED, str(tmp_path / "data"), str(model_dir)]
            proc, log = start_activated(tmp_path, sock, serve)
            try:
                assert call(proc, log, client, "hello", client="test", protocol=1)["model"]
                call(proc, log, client, "session.create", session_id="s1", system="You are terse.")
            finally:
                assert stop(proc) == 0
    assert '"event": "ready"' in log.read_text()


def test_kvwake_serve_takes_an_activated_socket(tmp_path, model_dir):
    path = tmp_path / "run" / "kvwake.sock"
    serve = ["-m", "kvwake.client.cli", "serve", "--socket", str(path), "--data-dir", str(tmp_path / "data"),
             "--model", str(model_dir), "--block-tokens", "16"]
    with listening_socket(path) as sock:
        with RawClient(path) as client:
            proc, log = start_activated(tmp_path, sock, serve)
            try:
                call(proc, log, client, "session.create", session_id="s1", system="You are terse.")
            finally:
                assert stop(proc) == 0  # sleeps s1
        assert path.is_socket()  # systemd's socket: the daemon must leave it in place for the next activation
        with RawClient(path) as client:  # the next connection activates a new daemon, which knows s1
            proc, log = start_activated(tmp_path, sock, serve)
            try:
                sessions = call(proc, log, client, "session.list")["sessions"]
                assert [(s["session_id"], s["state"]) for s in sessions] == [("s1", "asleep")]
            finally:
                assert stop(proc) == 0
