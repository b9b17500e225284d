"""Tool calls end to end: a real daemon on the scripted model (tinymodel.make_scripted_model), which
answers every chat turn with one get_weather call in the json_tools format.

The raw msgpack-rpc client checks the wire (results, stream notifications, tool
messages); the Python clients and `kvwake chat` check what users of those see.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvwake.client import AsyncClient, Client, InvalidParamsError
from kvwake.client.cli import main
from testkit.daemon import Daemon, RawClient, RpcError
from testkit.tinymodel import TOOL_SCRIPT, WEATHER_CALL, make_scripted_model

RAW = "".join(TOOL_SCRIPT)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    model = make_scripted_model(tmp_path_factory.mktemp("models") / "scripted")
    d = Daemon(tmp_path_factory.mktemp("tools"), model).start()
    yield d
    d.stop()
    assert d.log_problems() == []


def raw_chat(c: RawClient, sid: str, messages: list, **params):
    """session.chat, streamed; (result, the stream's event maps without msgid)."""
    msgid = c.send("session.chat", {"session_id": sid, "messages": messages, "stream": True, **params})
    result = c.receive(msgid)
    return result, [{k: v for k, v in e.items() if k != "msgid"} for e in c.streamed.pop(msgid, [])]


def test_a_tool_call_comes_back_structured_and_streamed_marked(daemon):
    with daemon.client() as c:
        c.call("session.create", session_id="weather")
        r, events = raw_chat(c, "weather", ASK, tools=TOOLS)
    assert r["text"] == RAW and r["content"] == "" and r["finish_reason"] == "tool_calls"
    assert r["tool_call_errors"] == []
    (call,) = r["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
    assert events == [*({"text": p, "tool": True} for p in TOOL_SCRIPT), {"tool_call": call, "index": 0}]


def test_the_tool_result_continues_the_session_on_its_cache(daemon):
    with daemon.client() as c:
        c.call("session.create", session_id="agent")
        first, _ = raw_chat(c, "agent", ASK, tools=TOOLS)
        before = c.call("session.info", session_id="agent")["tokens"]
        answer = [{"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": '{"sky": "clear"}'}]
        second, _ = raw_chat(c, "agent", answer)
        # The reply was recorded as generated, so its re-render keeps every cached token.
        kept = second["append"]["tokens"] - second["append"]["prefilled"] - 1
        assert kept == before
        assert second["finish_reason"] == "tool_calls" and second["text"] == RAW
        c.call("session.sleep", session_id="agent")  # tool turns survive a snapshot and a wake
        third, _ = raw_chat(c, "agent", [{"role": "tool", "tool_call_id": second["tool_calls"][0]["id"],
                                          "content": "20 C"}])
        assert third["finish_reason"] == "tool_calls" and third["append"]["tokens"] > second["append"]["tokens"]
        assert c.call("session.info", session_id="agent")["messages"] == 6


def test_history_in_openai_shape_renders_as_the_session_that_generated_it(daemon):
    with daemon.client() as c:
        c.call("session.create", session_id="live")
        first, _ = raw_chat(c, "live", ASK, tools=TOOLS)
        answer = {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "sunny"}
        live = c.call("session.append", session_id="live", messages=[answer])
        # What an OpenAI client resends: null content, arguments as JSON text.
        said = {"role": "assistant", "content": None, "tool_calls": first["tool_calls"]}
        c.call("session.create", session_id="replayed")
        replayed = c.call("session.append", session_id="replayed", messages=[*ASK, said, answer], tools=TOOLS)
        assert replayed["tokens"] == live["tokens"]
        stored = c.call("session.info", session_id="replayed")
        assert stored["messages"] == 3


@pytest.mark.parametrize("message, why", [
    ({"role": "tool", "content": "sunny"}, "tool_call_id"),
    ({"role": "assistant", "content": None}, "string 'content'"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "tool_calls\\[0\\]"),
    ({"role": "assistant", "tool_calls": [{"type": "other", "function": {"name": "f", "arguments": "{}"}}]},
     "tool_calls\\[0\\]"),
    ({"role": "user", "content": "x", "tool_calls": []}, "assistant message"),
])
def test_malformed_tool_turns_are_refused_naming_the_message(daemon, message, why):
    with daemon.client() as c:
        c.call("session.create", session_id="strict", exist_ok=True)
        with pytest.raises(RpcError, match=why) as err:
            c.call("session.append", session_id="strict", messages=[*ASK, message])
        assert err.value.code == "INVALID_PARAMS" and err.value.data["index"] == 1
        assert c.call("session.info", session_id="strict").get("messages", 0) == 0  # nothing was kept


def test_a_call_cut_by_max_tokens_is_reported_not_raised(daemon):
    with daemon.client() as c:
        c.call("session.create", session_id="cut")
        r, events = raw_chat(c, "cut", ASK, tools=TOOLS, max_tokens=2)
    assert r["finish_reason"] == "length" and r["tool_calls"] == []
    assert r["text"] == r["content"] == "<tool_call>" + WEATHER_CALL
    (error,) = r["tool_call_errors"]
    assert "json_tools" in error and "cut off (length)" in error and "<tool_call>{" in error
    assert all(e.get("tool") for e in events)


def test_python_clients_give_tool_calls_and_stream_events(daemon):
    with Client(daemon.socket) as client:
        s = client.session("py")
        reply = s.chat(ASK, tools=TOOLS)
        assert reply.finish_reason == "tool_calls" and reply.content == "" and reply.text == RAW
        assert reply.tool_calls[0]["function"]["name"] == "get_weather" and reply.tool_call_errors == []
        stream = s.chat({"role": "tool", "tool_call_id": reply.tool_calls[0]["id"], "content": "sunny"}, stream=True)
        assert list(stream) == list(TOOL_SCRIPT)  # plain iteration: every text piece, as before
        assert stream.tool_calls == stream.result.tool_calls and len(stream.tool_calls) == 1
        again = s.chat({"role": "tool", "tool_call_id": "x", "content": "?"}, stream=True)
        kinds = [("tool_call" if "tool_call" in e else "tool" if e.get("tool") else "text") for e in again.events()]
        assert kinds == ["tool", "tool", "tool", "tool_call"] and again.result.finish_reason == "tool_calls"


async def test_the_async_client_streams_tool_call_events(daemon):
    async with AsyncClient(daemon.socket) as ac:
        s = await ac.session("py-async")
        stream = await s.chat(ASK, tools=TOOLS, stream=True)
        events = [e async for e in stream.events()]
        assert events[-1]["index"] == 0 and stream.result.tool_calls == [events[-1]["tool_call"]]
        assert stream.text == stream.result.text == RAW


def test_kvwake_chat_shows_tool_calls_readably(daemon, tmp_path):
    runner = CliRunner()
    for flag in ("--stream", "--no-stream"):
        sid = f"cli{flag}"
        with Client(daemon.socket) as client:
            client.append(client.session(sid).id, ASK, tools=TOOLS)
        result = runner.invoke(main, ["--socket", str(daemon.socket), "chat", "-s", sid, "-m", "again", flag])
        assert result.exit_code == 0, result.output
        assert '-> get_weather({"city": "Paris"})  [call_' in result.stdout and "<tool_call>" not in result.stdout
    result = runner.invoke(main, ["--socket", str(daemon.socket), "chat", "-m", "cut", "--max-tokens", "2"])
    assert result.exit_code == 0 and "tool call not parsed" in result.stderr


def test_tools_for_a_model_without_a_tool_call_format_are_refused(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir).start()  # the plain tiny model: ChatML, no tool parser
    try:
        with Client(d.socket) as client, pytest.raises(InvalidParamsError, match="tool_parser_type"):
            client.chat(client.session("x").id, ASK, tools=TOOLS)
    finally:
        d.stop()
