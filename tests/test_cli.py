"""The `kvwake` command through click's runner, against a real daemon; --json output is parsed back."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from kvwake.client import Client
from kvwake.client.cli import main
from kvwake.client.codecs import codec_advice
from kvwake.daemon.kv import restore_buffers
from testkit.daemon import REPO, Daemon
from testkit.tinymodel import make_model_dir

DOCS = REPO / "docs" / "cli.md"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model") / "tiny", ascii_replies=True)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model_dir):
    d = Daemon(tmp_path_factory.mktemp("cli"), model_dir).start()
    yield d
    d.stop()


@pytest.fixture
def kvwake(daemon):
    """Run `kvwake --socket SOCKET ARGS...`; assert the exit code; return the result."""
    runner = CliRunner()

    def run(*args: str, input: str | None = None, code: int = 0) -> Result:
        result = runner.invoke(main, ["--socket", str(daemon.socket), *args], input=input)
        assert result.exit_code == code, (result.output, result.exception)
        return result

    return run


def as_json(result: Result):
    return json.loads(result.stdout)


def all_commands(group: click.Group = main, prefix: str = "kvwake") -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        path = f"{prefix} {name}"
        found[path] = command
        if isinstance(command, click.Group):
            found.update(all_commands(command, path))
    return found


def test_every_command_has_help_with_an_example_and_is_in_the_reference():
    docs = DOCS.read_text()
    headings = set(re.findall(r"^#+ `(kvwake[^`]*)`", docs, re.M))
    for path, command in all_commands().items():
        assert command.help and "Example:" in command.help, path
        assert path in headings, f"{path} missing from docs/cli.md"
    assert "bench" in main.commands


def test_every_data_command_has_json():
    # These print logs or the steps they took, not data; a group without a default action prints help.
    no_data = {"kvwake serve", "kvwake service install", "kvwake service uninstall"}
    for path, command in all_commands().items():
        if isinstance(command, click.Group) and not command.invoke_without_command:
            continue
        if path not in no_data:
            assert any(p.name == "as_json" for p in command.params), f"{path} has no --json"


def test_status(kvwake, daemon):
    data = as_json(kvwake("status", "--json"))
    assert data["socket"] == str(daemon.socket) and data["model"] == "tiny" and data["pid"] == daemon.proc.pid
    assert data["version"] and isinstance(data["started"], float)
    text = kvwake("status").stdout
    assert f"pid {daemon.proc.pid}" in text and "tiny" in text
    # codec = "auto" (the default): measured on this machine when the store opened, and said
    assert data["store"]["codec"] == data["store"]["codec_choice"]["codec"] in {"raw", "planes-zstd", "zstd"}
    assert f"{data['store']['codec']} (auto: estimated wake" in text


def test_socket_from_the_environment(daemon):
    result = CliRunner().invoke(main, ["status", "--json"], env={"KVWAKE_SOCKET": str(daemon.socket)})
    assert result.exit_code == 0 and json.loads(result.stdout)["model"] == "tiny"


def test_chat_one_shot(kvwake, daemon):
    first = as_json(kvwake("chat", "-s", "cli-chat", "--system", "Be brief.", "-m", "Hello", "--max-tokens", "8",
                           "--json"))
    assert first["session_id"] == "cli-chat" and len(first["tokens"]) <= 8 and first["append"]["tokens"] > 0
    streamed = kvwake("chat", "-s", "cli-chat", "-m", "-", "--max-tokens", "8", input="From stdin")
    plain = kvwake("chat", "-s", "cli-chat", "-m", "Again", "--max-tokens", "8", "--no-stream")
    assert streamed.stdout.endswith("\n") and plain.stdout.endswith("\n")
    with Client(daemon.socket) as c:
        info = c.session_info("cli-chat")
    assert info["messages"] == 7  # system + three user turns + three replies
    new = kvwake("chat", "-m", "Who am I talking to?", "--max-tokens", "4")
    assert re.search(r"session: s-\w+", new.stderr)


def test_chat_repl_streams_and_runs_slash_commands(kvwake, daemon):
    script = "Hello\n/sleep\n/wake\nAre you awake?\n/checkpoint before-fork\n/fork cli-repl-fork\n/info\n/bogus\n" \
             "On the fork\n/quit\n"
    result = kvwake("chat", "-s", "cli-repl", "--max-tokens", "6", input=script)
    out = result.stdout
    assert "[asleep:" in out and "[awake:" in out and "[checkpoint 'before-fork'" in out
    assert "now chatting in cli-repl-fork" in out and re.search(r"session_id +cli-repl-fork", out)
    assert "Error: unknown command /bogus" in result.stderr
    with Client(daemon.socket) as c:
        assert any(s["label"] == "before-fork" for s in c.list_snapshots("cli-repl"))
        assert c.session_info("cli-repl-fork")["messages"] > c.session_info("cli-repl")["messages"]


def test_chat_repl_keeps_going_after_an_error(kvwake):
    result = kvwake("chat", "-s", "cli-repl-err", "--max-tokens", "0", input="Hi\n/quit\n")
    assert "Error: INVALID_PARAMS: max_tokens=0" in result.stderr


def test_sessions(kvwake):
    created = as_json(kvwake("sessions", "new", "cli-sess", "--system", "Hi.", "--metadata", '{"team": "ops"}',
                             "--json"))
    assert created == {"session_id": "cli-sess", "created": True}
    assert kvwake("sessions", "new").stdout.strip().startswith("s-")
    listed = as_json(kvwake("sessions", "--json"))
    assert "cli-sess" in {s["session_id"] for s in listed}
    assert as_json(kvwake("sessions", "list", "--json")) == listed
    assert "cli-sess" in kvwake("sessions").stdout
    shown = as_json(kvwake("sessions", "show", "cli-sess", "--json"))
    # A new session has one snapshot: the empty one that makes its creation durable.
    assert shown["metadata"] == {"team": "ops"} and [x["n_tokens"] for x in shown["snapshot_list"]] == [0]
    assert "metadata" in kvwake("sessions", "show", "cli-sess").stdout
    kvwake("sessions", "rm", "cli-sess", input="n\n", code=1)  # declined
    removed = as_json(kvwake("sessions", "rm", "cli-sess", "--yes", "--json"))
    assert removed[0]["session_id"] == "cli-sess"
    kvwake("sessions", "new", "cli-sess-bad", "--metadata", "{nope", code=2)


def test_sleep_wake_fork_checkpoint_snapshots(kvwake):
    kvwake("chat", "-s", "cli-ops", "-m", "Remember this.", "--max-tokens", "6")
    slept = as_json(kvwake("sleep", "cli-ops", "--json"))
    assert slept["tokens"] > 0 and "asleep" in kvwake("sleep", "cli-ops").stdout
    woke = as_json(kvwake("wake", "cli-ops", "--json"))
    assert woke["tokens"] == slept["tokens"] and "already awake" in kvwake("wake", "cli-ops").stdout
    mark = as_json(kvwake("checkpoint", "cli-ops", "v1", "--json"))
    assert mark["label"] == "v1" and "checkpoint 'v2'" in kvwake("checkpoint", "cli-ops", "v2").stdout
    forked = as_json(kvwake("fork", "cli-ops", "cli-ops-2", "--snapshot", mark["snapshot_id"], "--json"))
    assert forked["session_id"] == "cli-ops-2"
    assert "forked cli-ops into" in kvwake("fork", "cli-ops").stdout
    snaps = as_json(kvwake("snapshots", "cli-ops", "--json"))
    assert mark["snapshot_id"] in {s["id"] for s in snaps}
    assert "v1" in kvwake("snapshots").stdout


def test_export_import(kvwake, tmp_path):
    kvwake("chat", "-s", "cli-exp", "-m", "Pack this.", "--max-tokens", "6")
    snap = as_json(kvwake("checkpoint", "cli-exp", "export-me", "--json"))["snapshot_id"]
    exported = as_json(kvwake("export", snap, str(tmp_path / "s.kvwake"), "--json"))
    assert (tmp_path / "s.kvwake").is_file() and exported
    imported = as_json(kvwake("import", str(tmp_path / "s.kvwake"), "--session", "cli-imp", "--json"))
    assert imported["session_id"] == "cli-imp"
    kvwake("import", str(tmp_path / "missing.kvwake"), code=2)  # click checks the path exists
    again = kvwake("export", snap, str(tmp_path / "s.kvwake"), code=1)  # exists: the daemon refuses
    assert again.stderr.startswith("Error: INVALID_PARAMS:") and "Traceback" not in again.output


def test_gc_fsck_warm(kvwake):
    assert "bytes_after" in as_json(kvwake("gc", "--json"))
    assert as_json(kvwake("fsck", "--json"))["ok"] in (True, False)
    assert as_json(kvwake("warm", "--system", "A shared tool manual. " * 8, "--json"))["tokens"] > 0
    assert as_json(kvwake("warm", "--text", "Plain shared text. " * 8, "--json"))["blocks"] >= 1
    kvwake("warm", code=2)


def test_bench(kvwake, daemon):
    report = as_json(kvwake("bench", "--sessions", "2", "--cycles", "1", "--system-words", "40", "--max-tokens", "4",
                            "--json"))
    assert report["model"] == "tiny" and len(report["sessions"]) == 2
    summary = report["summary"]
    assert summary["wake_ms_p50"] > 0 and summary["sleep_ms_p50"] > 0 and summary["compression_ratio"] > 0
    assert summary["prefix_reuse_rate"] is not None
    with Client(daemon.socket) as c:  # a daemon whose restores stage (a GPU) says which codecs bench advises among
        store = c.status()["store"]
    among = restore_buffers.auto_codecs()  # None on the CPU (any codec), the staged ones where a GPU computes
    assert store["auto_among"] == (list(among) if among else None)
    codecs = report["codecs"]  # measured on the daemon's own blocks and this disk, and a pick among auto's
    assert codecs["blocks"] > 0 and set(codecs["codecs"]) == set(among or ("planes-zstd", "raw", "zstd"))
    assert codecs["recommended"] in codecs["codecs"] and codecs["codecs"]["raw"]["ratio"] < 1.01
    assert all(r["wake_GBps_estimate"] > 0 and r["disk_read_GBps"] > 0 for r in codecs["codecs"].values())
    staged = codec_advice(store["path"], among=["planes-zstd", "raw"])
    assert set(staged["codecs"]) == {"planes-zstd", "raw"} and staged["recommended"] in {"planes-zstd", "raw"}
    with Client(daemon.socket) as c:  # cleaned up
        assert not [s for s in c.list_sessions() if s["session_id"].startswith("bench-")]
    text = kvwake("bench", "--sessions", "1", "--cycles", "1", "--max-tokens", "2").stdout
    assert "wake p50 / max" in text and "recommended codec: " in text


def test_server_errors_are_one_line(kvwake):
    result = kvwake("sessions", "show", "no-such-session", code=1)
    assert result.stderr == "Error: NOT_FOUND: no session 'no-such-session'\n"
    assert "Traceback" not in result.output
    assert "--json needs a one-shot message" in kvwake("chat", "--json", code=2).stderr
    assert kvwake("wake", "no-such-session", code=1).stderr.startswith("Error: NOT_FOUND")


def test_no_daemon(tmp_path):
    socket = tmp_path / "nobody.sock"
    for args in (["status"], ["sessions"], ["chat", "-m", "hi"], ["gc", "--json"]):
        result = CliRunner().invoke(main, ["--socket", str(socket), *args])
        assert result.exit_code == 1
        assert result.stderr == f"Error: no daemon running at {socket}; start one with `kvwake serve`\n"
    socket.with_suffix(".json").write_text(json.dumps({"pid": 2**22 + 12345, "socket": str(socket)}))
    stale = CliRunner().invoke(main, ["--socket", str(socket), "status"])
    assert stale.exit_code == 1 and "which is gone" in stale.stderr


def test_the_installed_entry_point_fails_cleanly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvwake.client.cli", "--socket", str(tmp_path / "x.sock"), "status"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.startswith("Error: no daemon running") and "Traceback" not in out.stderr


def test_stop(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()
    try:
        result = CliRunner().invoke(main, ["--socket", str(d.socket), "stop", "--json"])
        assert result.exit_code == 0 and json.loads(result.stdout) == {"stopping": True}
        assert d.proc.wait(30) == 0
    finally:
        d.stop()


def test_serve_refuses_a_bad_config(tmp_path):
    (tmp_path / "bad.toml").write_text("no_such_setting = 1\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(tmp_path / "bad.toml"),
                                       "--socket", str(tmp_path / "s.sock")])
    assert result.exit_code == 1 and "unknown settings" in result.stderr


def test_serve_refuses_an_unknown_or_bad_tuning_naming_it(tmp_path):
    for args, named in ((["--tune", "no_such_knob=1"], "unknown tuning 'no_such_knob'"),
                        (["--tune", "slice_of_step=fast"], "--tune: bad tuning slice_of_step='fast'"),
                        (["--tune", "slice_of_step"], "'slice_of_step' is not NAME=VALUE")):
        result = CliRunner().invoke(main, ["serve", "--config", str(tmp_path / "none.toml"),
                                           "--socket", str(tmp_path / "s.sock"), *args])
        assert result.exit_code != 0 and named in result.stderr, (args, result.stderr)


def test_docs_quick_start_is_ten_lines_or_so():
    block = re.search(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert block and len(block.group(1).strip().splitlines()) <= 12
    compile(block.group(1), "quick-start", "exec")
    assert Path(DOCS).read_text().index("```python") < Path(DOCS).read_text().index("## Commands")
