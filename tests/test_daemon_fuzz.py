"""Hostile input: malformed frames, oversized messages and stalled peers never hurt other clients."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.daemon import Daemon
from tests.test_daemon import SYSTEM, chat
from tests.tinymodel import make_model_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "cfg.toml").write_text("read_timeout_s = 0.5\n")
    d = Daemon(root, make_model_dir(root / "tiny"), env={"KVWAKE_CONFIG": str(root / "cfg.toml")}).start()
    bystander = d.client()
    bystander.call("session.create", session_id="bystander", system=SYSTEM)
    before = chat(bystander, "bystander", "hello")["tokens"]
    yield d, bystander, before
    bystander.close()
    assert d.stop() == 0


def send_raw(d: Daemon, data: bytes, read: bool = True) -> bytes:
    """Send bytes on a fresh connection; return what came back before the server closed or went quiet."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(d.socket))
    s.settimeout(2.0)
    got = b""
    try:
        s.sendall(data)
        while read:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            got += chunk
    except (TimeoutError, ConnectionResetError, BrokenPipeError):
        pass
    finally:
        s.close()
    return got


def still_serving(d: Daemon, bystander, before) -> None:
    assert d.proc.poll() is None, d.log.read_text()[-2000:]
    assert bystander.call("hello", client="bystander", protocol=1)["server"] == "kvwake"
    info = bystander.call("session.info", session_id="bystander")
    assert info["busy"] is None and info["tokens"] >= len(before)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
methods = st.sampled_from(["hello", "session.chat", "session.create", "session.sleep", "session.info", "snapshot.import",
                           "store.gc", "nope", ""]) | st.text(max_size=30)
rpc_like = st.tuples(st.sampled_from([0, 1, 2, 3, -1]), json_like, methods, json_like).map(list) | st.lists(json_like,
                                                                                                            max_size=6)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(min_size=1, max_size=200))
def test_random_bytes(served, data):
    d, bystander, before = served
    send_raw(d, data)
    still_serving(d, bystander, before)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(message=rpc_like)
def test_valid_msgpack_that_is_not_a_valid_request(served, message):
    d, bystander, before = served
    reply = send_raw(d, msgpack.packb(message, use_bin_type=True))
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(reply)
    for obj in unpacker:  # whatever comes back is well-formed msgpack-rpc
        assert isinstance(obj, list) and obj[0] in (1, 2)
        if obj[0] == 1 and obj[2] is not None:
            assert set(obj[2]) == {"code", "message", "data"}
    still_serving(d, bystander, before)


@pytest.mark.parametrize("header", [
    b"\xdd\x7f\xff\xff\xff",  # array of 2**31 elements
    b"\xdf\x7f\xff\xff\xff",  # map of 2**31 pairs
    b"\xdb\x7f\xff\xff\xff",  # str of 2 GB
    b"\xc6\x7f\xff\xff\xff",  # bin of 2 GB
    b"\xc9\x00\x00\x00\x10\x01" + b"x" * 16,  # ext type: not allowed at all
    b"\x91" * 5000,  # nesting bomb
], ids=["array", "map", "str", "bin", "ext", "nesting"])
def test_oversized_or_deep_headers_close_only_that_connection(served, header):
    d, bystander, before = served
    reply = send_raw(d, b"\x94\x00\x01\xa5hello" + header)
    assert b"PROTOCOL_ERROR" in reply or reply == b""
    still_serving(d, bystander, before)


def test_a_frame_over_the_size_limit_is_dropped(served):
    d, bystander, before = served
    huge = msgpack.packb([0, 1, "session.append", {"session_id": "bystander", "text": "x" * (70 << 20)}])
    reply = send_raw(d, huge)
    assert b"PROTOCOL_ERROR" in reply or reply == b""
    still_serving(d, bystander, before)


def test_a_peer_stalled_mid_frame_is_dropped_but_idle_peers_are_kept(served):
    d, bystander, before = served
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(str(d.socket))
    stalled.sendall(b"\x94\x00\x01")  # a request cut short
    stalled.settimeout(10)
    start = time.monotonic()
    assert stalled.recv(100) == b""  # closed by the server after read_timeout_s (0.5 s here)
    assert time.monotonic() - start < 5
    stalled.close()
    idle = d.client()
    time.sleep(1.5)  # idle between frames for 3x the timeout
    assert idle.call("hello")["protocol"] == 1
    idle.close()
    still_serving(d, bystander, before)


def test_huge_values_in_a_valid_request_get_errors(served):
    d, bystander, before = served
    for params in ({"session_id": "x" * 100000}, {"session_id": "bystander", "tokens": [2**40]},
                   {"session_id": "bystander", "tokens": list(range(300000))},
                   {"session_id": "bystander", "text": 12}):
        with pytest.raises(Exception) as err:
            bystander.call("session.append", **params)
        assert getattr(err.value, "code", None) == "INVALID_PARAMS", err.value
    still_serving(d, bystander, before)
