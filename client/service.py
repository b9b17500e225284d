"""`kvwake service install|uninstall|status`: keep the daemon running under launchd (macOS) or systemd (Linux).

install renders the templates in systemd-launchd/ with this installation's
interpreter (sys.executable) and paths (socket, data dir: flags > environment >
config file > defaults, as `kvwake serve` resolves them), writes them to
`~/Library/LaunchAgents/` or `~/.config/systemd/user/` (under Path.home(), so
HOME moves it), and starts the service with `launchctl bootstrap` or
`systemctl --user enable --now`. Where that tool is missing, or with
--dry-run, it prints the exact commands instead.

What install wrote is recorded in `<data dir>/service-install.json`
(`Manifest`, version 1: manager, file paths with the sha256 of the content
written, the commands that stop the service). uninstall reads it, stops the
service first (the daemon sleeps every hot session on SIGTERM), then removes
only those files, and refuses to remove one whose content changed since
install unless --force.

Nothing here imports the daemon or mlx.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape as xml_escape

import click

__all__ = ["Manifest", "Plan", "plan_install", "render", "service", "template_dir"]

LABEL = "com.kvwake.daemon"
MANIFEST_NAME = "service-install.json"
MANIFEST_VERSION = 1
SYSTEMD_SOCKET = "%t/kvwake/kvwake.sock"  # the daemon's default socket, as a systemd specifier
MANAGERS = ("systemd", "launchd")
STOP_TIMEOUT_S = 330  # the units give the daemon 300 s to sleep its sessions


# --- templates --------------------------------------------------------------------------------------------

def template_dir() -> Path:
    """systemd-launchd/: from an installed wheel (kvwake.service_templates) or next to this source tree."""
    import importlib.util

    spec = importlib.util.find_spec("kvwake.service_templates")
    candidates = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    candidates.append(Path(__file__).resolve().parent.parent / "systemd-launchd")
    for folder in candidates:
        if (folder / "kvwake.service").is_file():
            return folder
    raise click.ClickException(f"service templates not found (looked in {', '.join(map(str, candidates))})")


def render(name: str, values: dict[str, str]) -> str:
    """The template `name` with every `{placeholder}` replaced; KeyError names a placeholder without a value."""
    text = (template_dir() / name).read_text()
    return re.sub(r"\{([a-z_]+)\}", lambda m: values[m.group(1)], text)


def _checked(value: str) -> str:
    if "\n" in value or "\r" in value or "\0" in value:
        raise click.ClickException(f"{value!r}: a path with a newline or NUL cannot go in a service file")
    return value


def _systemd_specifiers(value: str) -> str:
    return _checked(value).replace("%", "%%")


def _systemd_quoted(value: str) -> str:
    """A double-quoted systemd word (C escapes undone when read); `value` already has its specifiers escaped.

    Not for arguments after ExecStart's executable, where systemd would also expand `$NAME`.
    """
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _systemd_executable(path: str) -> str:
    if any(c in path for c in "\"'\\"):
        raise click.ClickException(f"systemd cannot run an executable whose path holds a quote or backslash: {path}")
    return _systemd_quoted(_systemd_specifiers(path))


def _checked_socket(path: Path) -> Path:
    if len(os.fsencode(path)) >= (104 if sys.platform == "darwin" else 108):  # sun_path, NUL included
        raise click.ClickException(f"socket path too long for a Unix socket ({len(os.fsencode(path))} bytes): {path}")
    return path


def _environment(socket: str, data_dir: Path) -> dict[str, str]:
    """What the service runs with: socket and data dir, and the model and config file if set here."""
    env = {"KVWAKE_SOCKET": socket, "KVWAKE_DATA_DIR": str(data_dir)}
    env.update({k: os.environ[k] for k in ("KVWAKE_MODEL", "KVWAKE_CONFIG") if os.environ.get(k)})
    return env


# --- plans ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """What install writes and runs; `stop` and `after_remove` are what uninstall runs around removing files."""

    manager: str
    files: dict[str, str]  # path -> content
    start: list[list[str]]
    stop: list[list[str]]
    after_remove: list[list[str]]
    socket_activation: bool
    socket: str  # the socket served, or systemd's %t/kvwake/kvwake.sock for the default one


def systemd_unit_dir(home: Path) -> Path:
    config = os.environ.get("XDG_CONFIG_HOME")
    return (Path(config) if config and os.path.isabs(config) else home / ".config") / "systemd" / "user"


def _plan_systemd(python: str, socket: Path | None, data_dir: Path, home: Path, socket_activation: bool) -> Plan:
    listen = SYSTEMD_SOCKET if socket is None else _systemd_specifiers(str(socket))
    env = _environment(listen, data_dir)
    env.update({k: _systemd_specifiers(v) for k, v in env.items() if k != "KVWAKE_SOCKET"})
    environment = "\n".join(f"Environment={_systemd_quoted(f'{k}={v}')}" for k, v in env.items())
    folder = systemd_unit_dir(home)
    files = {str(folder / "kvwake.service"): render("kvwake.service", {
        "python": _systemd_executable(python), "environment": environment})}
    unit = "kvwake.service"
    if socket_activation:
        files[str(folder / "kvwake.socket")] = render("kvwake.socket", {"socket": listen})
        unit = "kvwake.socket"
    ctl, units = ["systemctl", "--user"], [*(["kvwake.socket"] if socket_activation else []), "kvwake.service"]
    return Plan("systemd", files, start=[[*ctl, "daemon-reload"], [*ctl, "enable", "--now", unit]],
                stop=[[*ctl, "disable", "--now", *units]],
                after_remove=[[*ctl, "daemon-reload"]], socket_activation=socket_activation,
                socket=SYSTEMD_SOCKET if socket is None else str(socket))


def _plan_launchd(python: str, socket: Path, data_dir: Path, home: Path) -> Plan:
    env = _environment(str(socket), data_dir)
    environment = "\n".join(f"        <key>{xml_escape(k)}</key>\n        <string>{xml_escape(_checked(v))}</string>"
                            for k, v in env.items())
    plist = home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    content = render(f"{LABEL}.plist", {"python": xml_escape(_checked(python)), "environment": environment,
                                       "log_dir": xml_escape(_checked(str(launchd_log_dir(home))))})
    domain = f"gui/{os.getuid()}"
    return Plan("launchd", {str(plist): content}, start=[["launchctl", "bootstrap", domain, str(plist)]],
                stop=[["launchctl", "bootout", f"{domain}/{LABEL}"]], after_remove=[], socket_activation=False,
                socket=str(socket))


def launchd_log_dir(home: Path) -> Path:
    return home / "Library" / "Logs" / "kvwake"


def plan_install(manager: str, *, python: str, socket: Path | None, data_dir: Path, home: Path,
                 socket_activation: bool) -> Plan:
    """The files and commands for `manager`. socket None: the daemon's default socket."""
    if socket is not None:
        _checked_socket(socket)
    if manager == "systemd":
        return _plan_systemd(python, socket, data_dir, home, socket_activation)
    if socket_activation:
        raise click.ClickException("--socket-activation needs systemd; under launchd the daemon binds its own socket")
    if socket is None:
        from kvwake.client.paths import default_socket

        socket = default_socket()
    return _plan_launchd(python, socket, data_dir, home)


# --- the install record -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Manifest:
    """`<data dir>/service-install.json`: what `kvwake service install` wrote, so uninstall removes only that."""

    version: int
    manager: str
    socket_activation: bool
    socket: str
    data_dir: str
    python: str
    files: dict[str, str]  # path -> sha256 of the content written
    stop: list[list[str]]
    after_remove: list[list[str]]
    installed_at: float

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            data = json.loads(path.read_text())
            if data.get("version") != MANIFEST_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {MANIFEST_VERSION}")
            return cls(**data)
        except FileNotFoundError:
            raise click.ClickException(f"no service install recorded at {path}: nothing to uninstall "
                                       "(pass the --data-dir it was installed with)") from None
        except (OSError, ValueError, TypeError) as exc:
            raise click.ClickException(f"{path}: unreadable install record: {exc}") from None

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, path)


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def file_state(path: str, digest: str) -> str:
    """'ok' (as written), 'changed' or 'missing'."""
    try:
        return "ok" if _digest(Path(path).read_bytes()) == digest else "changed"
    except FileNotFoundError:
        return "missing"


# --- running the service manager --------------------------------------------------------------------------

def _tool(command: list[str]) -> str | None:
    return shutil.which(command[0])


def _run(command: list[str], *, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    click.echo(f"$ {shlex.join(command)}")
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise click.ClickException(f"`{shlex.join(command)}` did not finish in {timeout:.0f} s") from None


def _failure(command: list[str], result: subprocess.CompletedProcess[str]) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return f"`{shlex.join(command)}` failed (exit {result.returncode}): {lines[-1] if lines else 'no output'}"


def _echo_commands(header: str, commands: list[list[str]]) -> None:
    if commands:
        click.echo(header)
        for command in commands:
            click.echo(f"  {shlex.join(command)}")


def _launchd_print() -> subprocess.CompletedProcess[str]:
    """`launchctl print` of the agent: exit 0 (and its state, pid) when loaded."""
    return subprocess.run(["launchctl", "print", f"gui/{os.getuid()}/{LABEL}"], capture_output=True, text=True)


def _stop(manifest: Manifest, force: bool) -> None:
    """Stop and disable the service; blocks while the daemon sleeps its sessions."""
    for command in manifest.stop:
        if manifest.manager == "launchd" and _launchd_print().returncode != 0:
            continue  # not loaded: nothing runs, and bootout would fail
        click.echo("stopping kvwake (the daemon sleeps every hot session first; this can take a while)")
        result = _run(command, timeout=STOP_TIMEOUT_S)
        if result.returncode != 0:
            if not force:
                raise click.ClickException(_failure(command, result) + "; nothing removed (--force removes anyway)")
            click.echo(f"warning: {_failure(command, result)}; going on (--force)", err=True)


# --- commands ---------------------------------------------------------------------------------------------

def _default_manager() -> str:
    return "launchd" if sys.platform == "darwin" else "systemd"


def _data_dir(data_dir: str | None) -> Path:
    from kvwake.client.paths import resolve_data_dir

    try:
        return resolve_data_dir(data_dir).absolute()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def _explicit_socket(ctx: click.Context, socket: str | None) -> Path | None:
    """The socket the user chose (flag, KVWAKE_SOCKET, config file), or None for the daemon's default."""
    from kvwake.client.paths import config_value

    value = socket or getattr(ctx.obj, "socket", None) or os.environ.get("KVWAKE_SOCKET")
    try:
        value = value or config_value("socket")
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    return Path(str(value)).expanduser().absolute() if value else None


data_dir_option = click.option("--data-dir", type=click.Path(file_okay=False),
                               help="The daemon's data dir, where the install record lives (env KVWAKE_DATA_DIR).")
dry_run_option = click.option("--dry-run", is_flag=True, help="Print what would be written and run; change nothing.")


@click.group()
def service() -> None:
    """Run the daemon as a user service: launchd on macOS, systemd on Linux.

    Example: kvwake service install
    """


@service.command()
@click.option("--manager", type=click.Choice(MANAGERS), default=None, help="Default: launchd on macOS, else systemd.")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False), help="Socket to serve (env KVWAKE_SOCKET).")
@data_dir_option
@click.option("--socket-activation/--no-socket-activation", default=None,
              help="systemd only (the default there): systemd holds the socket and starts the daemon on first use.")
@click.option("--force", is_flag=True, help="Overwrite service files that install did not write.")
@dry_run_option
@click.pass_context
def install(ctx: click.Context, manager: str | None, socket_path: str | None, data_dir: str | None,
            socket_activation: bool | None, force: bool, dry_run: bool) -> None:
    """Write the service definition for this installation and start it.

    Example: kvwake service install --dry-run
    """
    manager = manager or _default_manager()
    if socket_activation is None:
        socket_activation = manager == "systemd"
    data = _data_dir(data_dir)
    manifest_path = data / MANIFEST_NAME
    plan = plan_install(manager, python=sys.executable, socket=_explicit_socket(ctx, socket_path), data_dir=data,
                        home=Path.home(), socket_activation=socket_activation)
    if manifest_path.exists():
        raise click.ClickException(f"already installed (recorded in {manifest_path}); "
                                   "run `kvwake service uninstall` first")
    for path, content in plan.files.items():
        if Path(path).exists() and Path(path).read_text() != content and not force:
            raise click.ClickException(f"{path} exists and install did not write it; --force overwrites it")
    if dry_run:
        for path, content in plan.files.items():
            click.echo(f"would write {path}:\n" + "".join(f"    {line}\n" for line in content.splitlines()))
        click.echo(f"would record them in {manifest_path}")
        return _echo_commands("would run:", plan.start)
    _write_files(plan, manifest_path, data)
    if not _tool(plan.start[0]):
        return _echo_commands(f"{plan.start[0][0]} not found: to start kvwake, run:", plan.start)
    for i, command in enumerate(plan.start):
        result = _run(command)
        if result.returncode != 0:
            rest = " && ".join(shlex.join(c) for c in plan.start[i:])
            raise click.ClickException(_failure(command, result) + f"; the files are in place: fix that, then run "
                                       f"`{rest}` (or `kvwake service uninstall`)")
    click.echo(_started_line(plan))


def _write_files(plan: Plan, manifest_path: Path, data: Path) -> None:
    for path, content in plan.files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
        click.echo(f"wrote {path}")
    if plan.manager == "launchd":
        launchd_log_dir(Path.home()).mkdir(parents=True, exist_ok=True)  # launchd does not create it
    Manifest(MANIFEST_VERSION, plan.manager, plan.socket_activation, plan.socket, str(data), sys.executable,
             {p: _digest(c) for p, c in plan.files.items()}, plan.stop, plan.after_remove, time.time()
             ).write(manifest_path)


def _started_line(plan: Plan) -> str:
    if plan.manager == "launchd":
        return f"kvwake runs under launchd ({LABEL}); logs in {launchd_log_dir(Path.home())}/kvwake.log"
    how = f"starts on the first connection to {plan.socket}" if plan.socket_activation else "is running"
    return f"kvwake {how}; logs: journalctl --user -u kvwake"


@service.command()
@data_dir_option
@click.option("--force", is_flag=True,
              help="Remove files even if they changed since install, and go on if stopping the service fails.")
@dry_run_option
def uninstall(data_dir: str | None, force: bool, dry_run: bool) -> None:
    """Stop the service (every hot session is slept first) and remove the files install wrote.

    Example: kvwake service uninstall
    """
    manifest_path = _data_dir(data_dir) / MANIFEST_NAME
    manifest = Manifest.read(manifest_path)
    states = {path: file_state(path, digest) for path, digest in manifest.files.items()}
    changed = [p for p, s in states.items() if s == "changed"]
    if changed and not force:
        raise click.ClickException(f"{changed[0]} changed since install; not removing it (--force removes it anyway)")
    tool = _tool(manifest.stop[0])
    if dry_run or not tool:
        _echo_commands("would run:" if dry_run else f"{manifest.stop[0][0]} not found: run this first if kvwake "
                       "still runs:", manifest.stop)
    else:
        _stop(manifest, force)
    for path, state in states.items():
        if state == "missing":
            click.echo(f"{path} already gone")
        elif dry_run:
            click.echo(f"would remove {path}")
        else:
            Path(path).unlink()
            click.echo(f"removed {path}")
    if dry_run:
        return _echo_commands("then:", manifest.after_remove)
    manifest_path.unlink()
    for command in manifest.after_remove if tool else []:
        result = _run(command)
        if result.returncode != 0:
            click.echo(f"warning: {_failure(command, result)}", err=True)
    click.echo("kvwake service uninstalled (the store and logs are kept)")


def _manager_state(manifest: Manifest) -> dict[str, Any]:
    """What the service manager says, or why it cannot say."""
    if not _tool(manifest.stop[0]):
        return {"state": "unknown", "reason": f"{manifest.stop[0][0]} not found"}
    if manifest.manager == "launchd":
        result = _launchd_print()
        if result.returncode != 0:
            return {"state": "not loaded"}
        found = dict(re.findall(r"^\s*(state|pid) = (\S+)", result.stdout, re.M))
        return {"state": found.get("state", "loaded"), "pid": int(found["pid"]) if "pid" in found else None}
    units = ["kvwake.socket", "kvwake.service"] if manifest.socket_activation else ["kvwake.service"]
    states = {}
    for unit in units:
        result = subprocess.run(["systemctl", "--user", "is-active", unit], capture_output=True, text=True)
        states[unit] = result.stdout.strip() or f"unknown ({(result.stderr.strip().splitlines() or ['?'])[-1]})"
    return {"state": states["kvwake.service"], "units": states}


@service.command()
@data_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts).")
def status(data_dir: str | None, as_json: bool) -> None:
    """Show whether the service is installed, its files, and what the service manager says.

    Example: kvwake service status --json
    """
    manifest_path = _data_dir(data_dir) / MANIFEST_NAME
    if not manifest_path.exists():
        data: dict[str, Any] = {"installed": False, "record": str(manifest_path), "manager": _default_manager()}
    else:
        manifest = Manifest.read(manifest_path)
        data = {"installed": True, "record": str(manifest_path), "manager": manifest.manager,
                "socket_activation": manifest.socket_activation, "socket": manifest.socket,
                "python": manifest.python, "installed_at": manifest.installed_at,
                "files": {p: file_state(p, d) for p, d in manifest.files.items()},
                "service": _manager_state(manifest)}
    if as_json:
        return click.echo(json.dumps(data, indent=2))
    if not data["installed"]:
        return click.echo(f"not installed (no record at {manifest_path}); `kvwake service install` installs it")
    activation = " with socket activation" if data["socket_activation"] else ""
    click.echo(f"installed under {data['manager']}{activation}")
    click.echo(f"service: {data['service']['state']}" + "".join(
        f"\n  {unit}: {state}" for unit, state in data["service"].get("units", {}).items()))
    click.echo(f"socket: {data['socket']}\npython: {data['python']}")
    for path, state in data["files"].items():
        click.echo(f"{state:8} {path}")
