"""Clients nobody here wrote, against a real daemon: pynvim's msgpack-rpc session (Python) and a
Node script on `net` + @msgpack/msgpack. Each does create, append, a streamed generate, sleep,
wake and an error round trip, and the daemon's log stays clean."""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import warnings

import pytest
from pynvim.msgpack_rpc import socket_session

from testkit.daemon import REPO, Daemon, RpcError
from tests.test_daemon import SYSTEM
from testkit.tinymodel import make_model_dir

NODE_DIR = REPO / "tests" / "node"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    d = Daemon(root, make_model_dir(root / "tiny")).start()
    yield d
    assert d.stop() == 0
    assert d.log_problems() == []


@pytest.fixture(scope="module")
def node_client() -> list[str]:
    """The command that runs tests/node/client.mjs, its locked packages installed by `npm ci` once per
    checkout (node_modules is kept, and reinstalled when the lock names another version)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "this test needs node (>= 18) and npm on PATH"
    lock = json.loads((NODE_DIR / "package-lock.json").read_text())
    want = lock["packages"]["node_modules/@msgpack/msgpack"]["version"]
    installed = NODE_DIR / "node_modules" / "@msgpack" / "msgpack" / "package.json"
    if not installed.exists() or json.loads(installed.read_text())["version"] != want:
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, capture_output=True,
                       timeout=300)
    return [node, str(NODE_DIR / "client.mjs")]


def test_pynvim_session(daemon):
    with warnings.catch_warnings():
        # pynvim's Session.close() closes its transport, then its event loop without running it once
        # more, so its socket is only closed when collected, with a ResourceWarning: expected here.
        warnings.simplefilter("ignore", ResourceWarning)
        pynvim_scenario(daemon)
        gc.collect()
    assert daemon.log_problems() == []


def pynvim_scenario(daemon: Daemon) -> None:
    session = socket_session(str(daemon.socket))  # its first message: [2, b"nvim_set_client_info", [...]]
    # pynvim's default error_wrapper reads nvim's [type, message] error pairs; kvwake's errors are maps.
    session.error_wrapper = RpcError
    try:
        assert session.request("hello", {"client": "pynvim"})["server"] == "kvwake"
        assert session.request(b"session.create", {"session_id": "nvim", "system": SYSTEM})["created"]
        appended = session.request("session.append", {"session_id": "nvim",
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert appended["tokens"] > 0
        pieces, result = [], {}

        def generate() -> None:  # in pynvim's greenlet: the stream arrives at the handler meanwhile
            result.update(session.request("session.generate", {"session_id": "nvim", "max_tokens": 12,
                                                               "stream": True}))
            session.stop()

        session.run(lambda name, args: None, lambda name, args: pieces.append((name, args)), generate)
        assert pieces and {name for name, _ in pieces} == {"stream"}
        assert "".join(args["text"] for _, args in pieces) == result["text"]
        assert len(result["tokens"]) == result["usage"]["generated_tokens"] > 0
        slept = session.request("session.sleep", {"session_id": "nvim"})
        woken = session.request("session.wake", {"session_id": "nvim"})
        assert woken["snapshot_id"] == slept["snapshot_id"] and woken["tokens"] == slept["tokens"]
        with pytest.raises(RpcError) as err:
            session.request("session.info", {"session_id": "nobody"})
        assert err.value.code == "NOT_FOUND" and err.value.data == {"session_id": "nobody"}
    finally:
        session.close()


def test_node_msgpack_client(daemon, node_client):
    run = subprocess.run([*node_client, str(daemon.socket), "node"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for call in ("hello", "create", "append", "generate", "sleep", "wake", "info"):
        assert out[call]["error"] is None, (call, out[call])
    assert out["hello"]["result"]["server"] == "kvwake"
    assert out["append"]["result"]["tokens"] > 0
    generated = out["generate"]["result"]
    assert out["pieces"] and "".join(out["pieces"]) == generated["text"]
    assert out["wake"]["result"]["tokens"] == out["sleep"]["result"]["tokens"] == out["info"]["result"]["tokens"]
    assert out["error"]["result"] is None
    assert out["error"]["error"]["code"] == "NOT_FOUND"
    assert out["error"]["error"]["data"] == {"session_id": "nobody-node"}
    assert daemon.log_problems() == []
