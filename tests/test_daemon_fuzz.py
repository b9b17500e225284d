"""Hostile input: malformed frames, oversized messages and stalled peers never hurt other clients."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testkit.daemon import Daemon
from tests.test_daemon import SYSTEM, chat
from testkit.tinymodel import make_model_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "cfg.toml").write_text("read_timeout_s = 0.2\n")  # a cut frame is dropped soon: 80 of them
    d = Daemon(root, make_model_dir(root / "tiny"), env={"KVWAKE_CONFIG": str(root / "cfg.toml")}).start()
    bystander = d.client()
    bystander.call("session.create", session_id="bystander", system=SYSTEM)
    before = chat(bystander, "bystander", "hello")["tokens"]
    yield d, bystander, before
    bystander.close()
    assert d.stop() == 0
    assert d.log_problems() == []


PROBE_ID = 2**32 - 1
PROBE = msgpack.packb([0, PROBE_ID, "hello", {"client": "probe"}])


def send_raw(d: Daemon, data: bytes) -> bytes:
    """Send bytes, then a hello probe, on a fresh connection; return what came back until the
    probe's answer, the server closing, or 2 s of quiet."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(d.socket))
    s.settimeout(2.0)
    got = b""
    try:
        s.sendall(data + PROBE)
        while not probe_answered(got):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            got += chunk
    except (TimeoutError, ConnectionResetError, BrokenPipeError):
        pass
    finally:
        s.close()
    return got


def replies(data: bytes) -> list:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    return list(unpacker)


def probe_answered(data: bytes) -> bool:
    try:
        return any(m[:3] == [1, PROBE_ID, None] and m[3].get("server") == "kvwake" for m in replies(data))
    except Exception:  # a reply cut short: not yet
        return False


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
def test_valid_msgpack_never_closes_the_connection(served, message):
    d, bystander, before = served
    reply = send_raw(d, msgpack.packb(message, use_bin_type=True))
    assert probe_answered(reply), reply[:500]  # the connection went on after the message
    for obj in replies(reply):  # whatever comes back is a msgpack-rpc response
        assert isinstance(obj, list) and obj[0] == 1, obj
        if obj[2] is not None:
            assert set(obj[2]) == {"code", "message", "data"}
    still_serving(d, bystander, before)


@pytest.mark.parametrize(("message", "code"), [
    ([2, b"nvim_set_client_info", ["python3-client", {}, "remote", {}, {}]], None),  # pynvim's first message
    ([2, "anything", {"x": 1}], None),
    ([1, 7, None, {"a": 1}], None),  # a response to a request the daemon never made
    (42, None),
    ([9, 1], None),
    ([0, 3, b"hello", [{"client": "bin method, params in an array"}]], "ok"),
    ([0, 3, "hello", []], "ok"),
    ([0, 3, "hello", None], "ok"),
    ([0, 3, "hello", [{}, {}]], "INVALID_PARAMS"),
    ([0, 3, "hello", ["pynvim"]], "INVALID_PARAMS"),
    ([0, 3, "hello", {b"client": "x"}], "INVALID_PARAMS"),
    ([0, 3, "nope", []], "UNKNOWN_METHOD"),
    ([0, 3, 7, {}], "PROTOCOL_ERROR"),
    ([0, 3, b"\xff\xfe", {}], "PROTOCOL_ERROR"),
    ([0, 3, "hello"], "PROTOCOL_ERROR"),
], ids=lambda v: repr(v)[:40])
def test_each_accepted_form_is_answered_and_the_rest_ignored(served, message, code):
    """docs/protocol.md's table of accepted forms, one row each."""
    d, bystander, before = served
    got = [m for m in replies(send_raw(d, msgpack.packb(message, use_bin_type=True))) if m[1] != PROBE_ID]
    if code is None:
        assert got == []
    elif code == "ok":
        assert len(got) == 1 and got[0][2] is None and got[0][3]["server"] == "kvwake"
    else:
        assert len(got) == 1 and got[0][1] == 3 and got[0][2]["code"] == code, got
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
    assert stalled.recv(100) == b""  # closed by the server after read_timeout_s (0.2 s here)
    assert time.monotonic() - start < 5
    stalled.close()
    idle = d.client()
    time.sleep(1.5)  # idle between frames for 7x the timeout
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
