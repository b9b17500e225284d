"""A client that leaves during a long prefill stops it, over RPC and HTTP, as one that leaves mid-generation
stops its generation; the session stays consistent and continues exactly.

The prompt is about 3,900 tokens (the tiny model's context is 4,096), prefilled in 16-token chunks: seconds
of engine work on a CPU, less on a GPU. "Stopped" is read from the daemon's own counter of
prefilled tokens. Each client leaves a fraction of the way into the prefill as this daemon times it
(`whole`), so the test means the same on any machine (with fixed delays it failed on a GPU: a delay
that is a fraction of the prefill on a CPU was most of it there).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse

import openai
import pytest

from kvwake.client import openai_config
from testkit.daemon import Daemon, RawClient, track

KEEPALIVE_S = 0.2  # http_keepalive_s: a stream opens on keep-alive comments when its prefill takes longer
LONG = "a long document. " * 228  # 3,876 byte-level tokens, after a tag naming the test (no prefix shared)
PREFILL_STEP = 16


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("prefill-cancel")
    (root / "none.toml").write_text(f"prefill_step = {PREFILL_STEP}\nhttp_keepalive_s = {KEEPALIVE_S}\n")
    d = Daemon(root, model_dir, extra=["--http", "0"]).start()
    yield d
    assert d.stop() == 0
    assert d.log_problems() == []


@pytest.fixture(scope="module")
def whole(daemon) -> tuple[float, int]:
    """Seconds and tokens this daemon takes to prefill the long prompt (the faster of two runs: the
    first may compile kernels)."""
    runs = []
    for k in range(2):
        with daemon.client() as c:
            c.call("session.create", session_id=f"timing-{k}")
            before = prefilled(daemon)
            began = time.monotonic()
            c.call("session.append", session_id=f"timing-{k}", messages=[{"role": "user", "content": f"t{k}: {LONG}"}])
            runs.append((time.monotonic() - began, prefilled(daemon) - before))
    return min(runs)


def bound(whole: tuple[float, int]) -> int:
    """Tokens a stopped prefill stays under: three quarters of the whole prompt."""
    return int(whole[1] * 0.75)


def prefilled(d: Daemon) -> int:
    with d.client() as c:
        return c.call("status")["counters"]["tokens_prefilled"]


def wait_free(d: Daemon, sid: str, timeout: float = 60.0) -> float:
    """Seconds until the session is no longer busy."""
    began = time.monotonic()
    with d.client() as c:
        while c.call("session.info", session_id=sid)["busy"] is not None:
            assert time.monotonic() - began < timeout, f"session {sid} still busy after {timeout} s"
            time.sleep(0.02)
    return time.monotonic() - began


def leave_when_busy(d: Daemon, method: str, params: dict, after_s: float) -> None:
    """Send the call on its own connection, wait until its session is busy (the prefill runs), then hang up
    `after_s` later."""
    leaver = RawClient(d.socket)
    leaver.send(method, params)
    with d.client() as c:
        deadline = time.monotonic() + 30
        while c.call("session.info", session_id=params["session_id"])["busy"] is None:
            assert time.monotonic() < deadline, "the call never claimed its session"
            time.sleep(0.005)
    time.sleep(after_s)  # some chunks in
    leaver.close()


def twin_reply(d: Daemon, sid: str, text: str) -> list[int]:
    """What the session would say had its prefill never been stopped: a twin that ran it whole."""
    with d.client() as c:
        c.call("session.create", session_id=sid)
        full = c.call("session.chat", session_id=sid, messages=[{"role": "user", "content": text}], max_tokens=8)
        return full["tokens"]


@pytest.mark.parametrize("method", ["session.chat", "session.append"])
def test_an_rpc_client_that_leaves_stops_the_prefill_and_the_session_goes_on_exactly(daemon, whole, method):
    sid = f"leaver-{method.split('.')[1]}"
    with daemon.client() as c:
        c.call("session.create", session_id=sid)
    text = f"{method}: {LONG}"
    before = prefilled(daemon)
    params = {"messages": [{"role": "user", "content": text}], **({"max_tokens": 8} if method == "session.chat" else {})}
    leave_when_busy(daemon, method, {"session_id": sid, **params}, after_s=min(0.2, whole[0] / 8))
    wait_free(daemon, sid)
    done = prefilled(daemon) - before
    assert done < bound(whole), f"{done} of {whole[1]} prompt tokens prefilled after the client left"

    # The input stays in the session, through a sleep too; the next call prefills the rest, and the
    # reply is the twin's.
    expected = twin_reply(daemon, f"twin-{sid}", text)
    with daemon.client() as c:
        info = c.call("session.info", session_id=sid)
        assert info["busy"] is None and info["tokens"] > 3800
        slept = c.call("session.sleep", session_id=sid)
        assert slept["tokens"] < bound(whole) + 64 and slept["tokens"] + slept["pending"] == info["tokens"]
        assert c.call("session.wake", session_id=sid)["tokens"] == info["tokens"]
        assert c.call("session.generate", session_id=sid, max_tokens=8)["tokens"] == expected


def leave_raw(d: Daemon, sid: str, messages: list[dict]) -> None:
    """A streamed request whose client hangs up 0.1 s after sending it, before anything comes back."""
    config = openai_config(d.socket)
    url = urllib.parse.urlsplit(config["base_url"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    body = json.dumps({"model": "any", "messages": messages, "max_tokens": 8, "stream": True})
    conn.request("POST", f"{url.path}/chat/completions", body, headers={
        "Authorization": f"Bearer {config['api_key']}", "Content-Type": "application/json", "X-Kvwake-Session": sid})
    time.sleep(0.1)
    conn.close()


@pytest.mark.parametrize("how", ["waiting for the body", "before the stream opens", "on an open stream"])
def test_an_http_client_that_leaves_stops_the_prefill(daemon, whole, how):
    sid = f"http-leaver-{how.replace(' ', '-')}"
    messages = [{"role": "user", "content": f"{sid}: {LONG}"}]
    before = prefilled(daemon)
    if how == "waiting for the body":  # not streamed: the client's read timeout hangs up mid-prefill
        api = track(openai.OpenAI(**openai_config(daemon.socket), max_retries=0, timeout=min(0.6, whole[0] / 4)))
        with pytest.raises(openai.APITimeoutError):
            api.chat.completions.create(model="any", messages=messages, max_tokens=8,
                                        extra_headers={"X-Kvwake-Session": sid})
    elif how == "before the stream opens":  # within http_keepalive_s: nothing sent yet
        leave_raw(daemon, sid, messages)
    else:  # past http_keepalive_s the stream opens on keep-alive comments; the client closes it
        api = track(openai.OpenAI(**openai_config(daemon.socket), max_retries=0, timeout=30))
        began = time.monotonic()
        stream = api.chat.completions.create(model="any", messages=messages, max_tokens=8, stream=True,
                                             extra_headers={"X-Kvwake-Session": sid})
        opened = time.monotonic() - began
        stream.close()
        assert opened >= KEEPALIVE_S, opened  # the headers came with the first keep-alive, mid-prefill
    wait_free(daemon, sid)
    done = prefilled(daemon) - before
    assert done < bound(whole), f"{done} of {whole[1]} prompt tokens prefilled after the client left"

    patient = track(openai.OpenAI(**openai_config(daemon.socket), max_retries=0, timeout=120))  # it asks again
    again = patient.chat.completions.create(model="any", messages=messages, max_tokens=8,
                                            extra_headers={"X-Kvwake-Session": sid})
    assert again.usage.prompt_tokens_details.cached_tokens >= done  # what was prefilled before is kept


def test_a_call_whose_client_is_gone_before_the_prefill_prefills_nothing(daemon):
    with daemon.client() as c:
        c.call("session.create", session_id="late")
    before = prefilled(daemon)
    leaver = RawClient(daemon.socket)
    leaver.send("session.append", {"session_id": "late", "text": f"late: {LONG}"})
    leaver.close()  # gone at once: its append may start, but stops before the first chunk
    time.sleep(0.5)
    wait_free(daemon, "late")
    assert prefilled(daemon) - before <= PREFILL_STEP
