"""The OpenAI-compatible HTTP API, through the official `openai` package, against a real daemon.

Also: the bearer token (made once, 0600, found by `kvwake http` and openai_config),
sessions over HTTP (named, and found by longest prefix for stateless clients, also
across a restart), usage.prompt_tokens_details.cached_tokens, and OpenAI's error shapes.
"""

from __future__ import annotations

import http.client
import json
import stat
import subprocess
import sys
import threading
import time

import urllib.error
import urllib.request

import openai
import pytest

from kvwake.client import openai_config
from testkit.daemon import REPO, Daemon, RpcError, get, openai_client, serving_http, track

SYSTEM = "You are a careful agent. Answer briefly and name your sources. " * 4


def in_threads(target, n: int) -> list[threading.Thread]:
    """`target(i)` for i in range(n), each on its own started thread."""
    workers = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for w in workers:
        w.start()
    return workers


client_for = openai_client  # testkit.daemon's


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model_dir):
    yield from serving_http(tmp_path_factory.mktemp("http"), model_dir)


@pytest.fixture(scope="module")
def api(daemon):
    return client_for(daemon)


def chat(api: openai.OpenAI, messages: list[dict], **options):
    options = {"max_tokens": 6, "temperature": 0, **options}
    return api.chat.completions.create(model="any", messages=messages, **options)


def test_token_is_made_once_private_and_found(daemon, api):
    token_file = daemon.data_dir / "http-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    config = openai_config(daemon.socket)
    assert config["api_key"] == token_file.read_text().strip()
    shown = subprocess.run([sys.executable, "-m", "kvwake.client.cli", "--socket", str(daemon.socket), "http", "--json"],
                           cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(shown.stdout) == config
    assert [m.id for m in api.models.list()] == [daemon.model_dir.name]


def test_wrong_or_missing_token_is_refused(daemon):
    base = openai_config(daemon.socket)["base_url"]
    with pytest.raises(openai.AuthenticationError) as refused:
        track(openai.OpenAI(base_url=base, api_key="not-the-token", max_retries=0)).models.list()
    assert refused.value.body["code"] == "invalid_api_key"
    assert get(f"{base}/models")[0] == 401


def test_chat_streamed_and_not_give_the_same_reply(api):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "stream or not?"}]
    whole = chat(api, messages, max_tokens=12)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    chunks = list(chat(api, messages, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 12
    # The same request again continues the session the first one made: its whole prompt is cached
    # (but the pending last token, which yields the first logits).
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_ten_turns_prefill_only_each_turns_new_tokens(api):
    messages = [{"role": "system", "content": SYSTEM + "ten turns"}]
    previous = None
    for turn in range(10):
        messages.append({"role": "user", "content": f"turn {turn}: what next?"})
        reply = chat(api, messages)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if previous is not None:  # the previous prompt (and reply) are in the cache: only this turn is new
            assert cached >= previous.usage.prompt_tokens, (turn, cached, previous.usage.prompt_tokens)
            assert reply.model_extra["kvwake"]["session_id"] == previous.model_extra["kvwake"]["session_id"]
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        previous = reply


def test_status_says_where_each_turns_first_token_went(daemon, api):
    messages = [{"role": "system", "content": SYSTEM + "phases"}, {"role": "user", "content": "go"}]
    sent = time.time()
    reply = chat(api, messages)
    with daemon.client() as rpc:
        turns = rpc.call("status")["turns"]
    mine = [t for t in turns if t["session"] == reply.model_extra["kvwake"]["session_id"]]
    assert len(mine) == 1 and mine[0]["at"] >= sent - 1, turns
    phases = mine[0]
    assert set(phases) >= {"render_ms", "match_ms", "match_store_ms", "claim_ms", "append_ms", "first_token_ms",
                           "prefilled"}
    assert all(phases[k] >= 0 for k in phases if k.endswith("_ms")) and phases["prefilled"] > 0
    assert 0 <= phases["match_store_ms"] <= phases["match_ms"]  # the store asked (when a session sleeps), within the finding
    assert phases["append_ms"] > 0 and phases["first_token_ms"] > 0
    # how the matcher found it: a conversation no session had (new, or branched from another test's
    # session on the same system prompt: the daemon is the module's)
    assert phases["match"] in ("new", "branched")
    messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "on"}]
    again = chat(api, messages)
    with daemon.client() as rpc:
        turn = rpc.call("status")["turns"][-1]
    assert turn["session"] == again.model_extra["kvwake"]["session_id"] and turn["match"] == "continued"


def test_a_branch_copies_the_shared_prefix_and_leaves_the_source(api):
    base = [{"role": "system", "content": SYSTEM + "branches"}, {"role": "user", "content": "first question"}]
    first = chat(api, base)
    trunk = [*base, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "second question"}]
    second = chat(api, trunk)
    source = second.model_extra["kvwake"]["session_id"]
    # A retry of the first question with another wording branches before the source's last reply.
    branch = chat(api, [base[0], {"role": "user", "content": "first question, reworded"}])
    info = branch.model_extra["kvwake"]
    assert info["match"] == "branched" and info["session_id"] != source
    assert branch.usage.prompt_tokens_details.cached_tokens == info["shared_tokens"] > 0
    # The source is as it was: its conversation goes on fully cached.
    trunk += [{"role": "assistant", "content": second.choices[0].message.content}, {"role": "user", "content": "3rd"}]
    third = chat(api, trunk)
    assert third.model_extra["kvwake"]["session_id"] == source
    assert third.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens


def test_logit_bias_and_penalties_reach_the_sampler(api):
    messages = [{"role": "user", "content": "bias"}]
    forced = chat(api, messages, max_tokens=5, logit_bias={"65": 100})  # byte-level tokenizer: id 65 is "A"
    assert forced.choices[0].message.content == "AAAAA"
    # A frequency penalty larger than the bias's margin stops the repetition, within the 20-token window.
    penalized = chat(api, messages, max_tokens=5, logit_bias={"65": 5}, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized.choices[0].message.content != "AAAAA"
    with pytest.raises(openai.BadRequestError) as bad:
        chat(api, messages, logit_bias={"99999999": 1})
    assert bad.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as bad:
        chat(api, messages, frequency_penalty=3)
    assert bad.value.body["param"] == "frequency_penalty"


def test_a_named_session_appends_only_new_messages(daemon, api):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "named"}]
    first = chat(api, messages, extra_headers={"X-Kvwake-Session": "agent-7"})
    assert first.model_extra["kvwake"] == {"session_id": "agent-7", "match": "named"}
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "more"}]
    second = chat(api, messages, extra_body={"kvwake_session": "agent-7"})
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    with daemon.client() as rpc:
        assert rpc.call("session.info", session_id="agent-7")["messages"] == 5  # the 4 sent and the reply


def test_completions_streamed_and_not(api):
    whole = api.completions.create(model="any", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 8
    pieces = list(api.completions.create(model="any", prompt="Once upon a time", max_tokens=8, temperature=0,
                                         stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"


def test_errors_come_in_openais_shape(daemon, api):
    messages = [{"role": "user", "content": "errors"}]
    with pytest.raises(openai.BadRequestError) as bad:
        chat(api, messages, n=2)
    assert bad.value.body["param"] == "n" and bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        chat(api, messages, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        chat(api, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    config = openai_config(daemon.socket)
    auth = {"Authorization": f"Bearer {config['api_key']}"}
    status, body = get(f"{config['base_url']}/nothing", auth)
    assert status == 404 and "message" in body["error"]
    status, body = get(f"{config['base_url']}/chat/completions", auth, b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_a_prompt_over_the_context_is_refused_before_any_session(daemon, api):
    with daemon.client() as rpc:
        before = len(rpc.call("session.list")["sessions"])
        with pytest.raises(openai.BadRequestError) as bad:  # the tiny model's context: 4096 tokens
            chat(api, [{"role": "user", "content": "x" * 5000}])
        assert bad.value.body["code"] == "context_length_exceeded"
        assert bad.value.body["message"].startswith("prompt is too long: ")
        assert len(rpc.call("session.list")["sessions"]) == before
        rpc.call("session.create", session_id="full")
        with pytest.raises(RpcError) as refused:  # over RPC too, before any prefill
            rpc.call("session.chat", session_id="full", messages=[{"role": "user", "content": "x" * 5000}])
        assert refused.value.code == "CONTEXT_TOO_LONG" and refused.value.data["limit"] == 4096


def test_a_busy_named_session_is_a_conflict(api):
    messages = [{"role": "user", "content": "busy"}]
    started, errors = threading.Event(), []

    def long_call():
        stream = chat(api, messages, max_tokens=400, stream=True, extra_headers={"X-Kvwake-Session": "busy-1"})
        for _ in stream:
            started.set()

    worker = threading.Thread(target=long_call)
    worker.start()
    assert started.wait(60)
    try:
        chat(api, messages, extra_headers={"X-Kvwake-Session": "busy-1"})
    except openai.ConflictError as exc:
        errors.append(exc.body)
    worker.join(120)
    assert errors and errors[0]["code"] == "busy"


def test_a_client_that_leaves_mid_stream_stops_its_generation(daemon, api):
    stream = chat(api, [{"role": "user", "content": "leave"}], max_tokens=2000, stream=True,
                  extra_headers={"X-Kvwake-Session": "leaver"})
    next(iter(stream))
    stream.close()
    with daemon.client() as rpc:
        for _ in range(600):
            info = rpc.call("session.info", session_id="leaver")
            if info["busy"] is None:
                break
            threading.Event().wait(0.05)
        assert info["busy"] is None and info["tokens"] < 1000


def test_stateless_conversation_continues_across_a_restart(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    messages = [{"role": "system", "content": SYSTEM + "restart"}, {"role": "user", "content": "before"}]
    first = chat(client_for(d), messages)
    assert d.stop() == 0
    d.start()
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "after"}]
    second = chat(client_for(d), messages)  # a new port, the same token
    assert second.model_extra["kvwake"]["session_id"] == first.model_extra["kvwake"]["session_id"]
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert d.stop() == 0 and d.log_problems() == []


def test_no_token_only_on_loopback(tmp_path, model_dir):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    refused = Daemon(tmp_path / "a", model_dir, extra=["--http", "0.0.0.0:0", "--http-no-token"])
    with pytest.raises(RuntimeError, match="exited 2"):
        refused.start()
    assert "loopback addresses only" in refused.log.read_text()
    d = Daemon(tmp_path / "b", model_dir, extra=["--http", "127.0.0.1:0", "--http-no-token"]).start()
    assert not (d.data_dir / "http-token").exists()
    base = openai_config(d.socket)["base_url"]
    assert get(f"{base}/models")[0] == 200
    assert d.stop() == 0


def test_the_token_can_be_given(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("KVWAKE_HTTP_TOKEN", "a-given-token-1234")  # the daemon's and the client's environment
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    assert openai_config(d.socket)["api_key"] == "a-given-token-1234"
    assert [m.object for m in client_for(d).models.list()] == ["model"]
    assert not (d.data_dir / "http-token").exists()
    assert d.stop() == 0


# -- tool calls: the scripted model (tinymodel.make_scripted_model) always answers with one call --

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


def scripted_api(tmp_path_factory, name: str, *script):
    """An openai client of a daemon serving a scripted model (tinymodel.make_scripted_model); stops it after."""
    from testkit.tinymodel import make_scripted_model

    model = make_scripted_model(tmp_path_factory.mktemp("models") / name, *script)
    for d in serving_http(tmp_path_factory.mktemp(f"http-{name}"), model):
        yield client_for(d)


@pytest.fixture(scope="module")
def tool_api(tmp_path_factory):
    yield from scripted_api(tmp_path_factory, "scripted")


def test_tool_calls_come_back_structured(tool_api):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = chat(tool_api, messages, tools=[WEATHER_TOOL], max_tokens=20)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # The tool's result goes back as a role-tool message; the conversation goes on in the same session,
    # every earlier token cached (the template renders the call as the model wrote it).
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    after = chat(tool_api, messages, tools=[WEATHER_TOOL], max_tokens=20)
    assert after.model_extra["kvwake"]["session_id"] == reply.model_extra["kvwake"]["session_id"]
    assert after.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens + 2


def test_streamed_tool_calls_arrive_as_deltas(tool_api):
    chunks = list(chat(tool_api, [{"role": "user", "content": "Stream the call"}], tools=[WEATHER_TOOL],
                       max_tokens=20, stream=True))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].index == 0 and calls[0][0].function.name == "get_weather"
    assert json.loads(calls[0][0].function.arguments) == {"city": "Paris"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # markup never as content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_renders_no_tools_and_a_forced_unknown_tool_is_refused(tool_api):
    messages = [{"role": "user", "content": "No tools"}]
    with pytest.raises(openai.BadRequestError, match="not among the tools") as bad:
        chat(tool_api, messages, tools=[WEATHER_TOOL],
             tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert bad.value.body["param"] == "tool_choice"
    reply = chat(tool_api, messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=20)
    assert reply.usage.prompt_tokens < chat(tool_api, messages, tools=[WEATHER_TOOL], max_tokens=20).usage.prompt_tokens


def test_old_stateless_sessions_expire_and_named_ones_stay(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    api = client_for(d)
    stateless = chat(api, [{"role": "user", "content": "expire me"}]).model_extra["kvwake"]["session_id"]
    chat(api, [{"role": "user", "content": "keep me"}], extra_headers={"X-Kvwake-Session": "named-1"})
    assert d.stop() == 0  # both sleep: their last change is now
    (tmp_path / "none.toml").write_text("stateless_ttl_s = 0.5\ngc_interval_s = 0.2\nlifecycle_interval_s = 0.1\n")
    time.sleep(0.6)
    d.start()
    with d.client() as rpc:
        for _ in range(300):
            ids = {s["session_id"] for s in rpc.call("session.list")["sessions"]}
            if stateless not in ids:
                break
            time.sleep(0.1)
    assert stateless not in ids and "named-1" in ids
    assert d.stop() == 0 and d.log_problems() == []

# -- fields frameworks send (seen from the OpenAI Agents SDK, langchain-openai and pydantic-ai) --

def test_fields_kvwake_cannot_honour_are_refused_by_name(api):
    messages = [{"role": "user", "content": "refusals"}]
    refused = {"functions": [{"name": "f", "parameters": {}}], "function_call": "auto",
               "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
               "web_search_options": {}, "parallel_tool_calls": "yes", "response_format": {"type": "yaml"}}
    for name, value in refused.items():
        with pytest.raises(openai.BadRequestError) as bad:
            chat(api, messages, extra_body={name: value})
        assert bad.value.body["param"] == name, name
    for role in ("wizard", "function"):  # a template would render an unknown role as if it meant something
        with pytest.raises(openai.BadRequestError) as bad:
            chat(api, [*messages, {"role": role, "name": "f", "content": "x"}])
        assert bad.value.body["param"] == "messages[1].role"


def test_harmless_fields_and_message_shapes_are_accepted(api):
    # An assistant's refusal part is its words (OpenAI's clients send it back); `name`, `refusal: null`
    # and fields that change nothing kvwake does (user, metadata, store, ...) are accepted.
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "hello", "name": "ada"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}], "refusal": None},
                {"role": "user", "content": [{"type": "text", "text": "then this"}]}]
    reply = chat(api, messages, user="ada", metadata={"run": "1"}, store=False, parallel_tool_calls=True,
                 modalities=["text"], extra_body={"service_tier": "auto", "prediction": None})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens > 20


def test_a_refused_request_makes_no_session(daemon, api):
    with daemon.client() as rpc:
        before = len(rpc.call("session.list")["sessions"])
        with pytest.raises(openai.BadRequestError) as bad:  # the vocabulary is checked before a session is made
            chat(api, [{"role": "user", "content": "out of vocabulary"}], logit_bias={"99999999": 1})
        assert bad.value.body["param"] == "logit_bias"
        assert len(rpc.call("session.list")["sessions"]) == before


def test_many_stateless_requests_at_once_are_none_busy(api):
    base = [{"role": "system", "content": SYSTEM + "crowd"}, {"role": "user", "content": "together"}]
    first = chat(api, base)
    turn = [*base, {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "2"}]
    failures: list[Exception] = []

    def one(i: int) -> None:
        try:
            reply = chat(api, turn if i % 2 else base, max_tokens=4, stream=i % 3 == 0)
            list(reply) if i % 3 == 0 else reply
        except Exception as exc:  # noqa: BLE001 (collected, asserted below)
            failures.append(exc)

    for w in in_threads(one, 16):
        w.join(120)
    assert failures == []


def test_a_body_over_the_limit_is_refused_unread(daemon):
    from kvwake.daemon.fronts.http import MAX_BODY_BYTES

    config = openai_config(daemon.socket)
    host, port = config["base_url"].split("//")[1].split("/")[0].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    conn.putrequest("POST", "/v1/chat/completions")  # the headers only: a 413 must not wait for the body
    for name, value in (("Authorization", f"Bearer {config['api_key']}"), ("Content-Type", "application/json"),
                        ("Content-Length", str(MAX_BODY_BYTES + 1))):
        conn.putheader(name, value)
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    conn.close()
    # Without a length (chunked), it is counted as it comes.
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    piece = b" " * (1 << 20)
    chunks = (piece for _ in range(MAX_BODY_BYTES // len(piece) + 2))
    try:
        conn.request("POST", "/v1/chat/completions", body=chunks, encode_chunked=True,
                     headers={"Authorization": f"Bearer {config['api_key']}"})
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the rest was sent
    try:
        assert conn.getresponse().status == 413
    finally:
        conn.close()


def test_the_bearer_scheme_is_case_insensitive_and_a_refusal_names_it(daemon):
    config = openai_config(daemon.socket)
    assert get(f"{config['base_url']}/models", {"Authorization": f"bearer {config['api_key']}"})[0] == 200
    request = urllib.request.Request(f"{config['base_url']}/models", headers={"Authorization": "Basic eDp5"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=20)
    refused.value.close()
    assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"


def test_sse_stream_closed_early_leaves_no_pending_read():
    """A client that leaves while the stream waits for the engine: the queue read it waited on is ended
    (left pending, asyncio reports it as a destroyed pending task once collected)."""
    import asyncio

    from kvwake.daemon.fronts.openai_shapes import Reply
    from kvwake.daemon.fronts.sse import OpenAiEvents, stream

    async def leave_mid_stream() -> bool:
        events: asyncio.Queue = asyncio.Queue()
        first = asyncio.ensure_future(events.get())
        never = asyncio.ensure_future(asyncio.Event().wait())  # a generation still running
        import anyio

        sse = stream(OpenAiEvents(Reply("m", True), False), first, events, never, anyio.Event())
        await sse.__anext__()  # the role chunk
        waiting = asyncio.ensure_future(sse.__anext__())
        await asyncio.sleep(0.05)
        waiting.cancel()  # the client left: Starlette cancels the response task
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0)
        never.cancel()
        return first.cancelled()  # checked here: asyncio.run's own cleanup would cancel it later

    assert asyncio.run(leave_mid_stream())


# -- parallel_tool_calls false: a scripted model that writes two calls --

TWO_CALLS = ("<tool_call>", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>\n",
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}', "</tool_call>")


@pytest.fixture(scope="module")
def two_call_api(tmp_path_factory):
    yield from scripted_api(tmp_path_factory, "two-calls", TWO_CALLS)


def test_parallel_tool_calls_false_ends_the_reply_at_its_first_call(two_call_api):
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    both = chat(two_call_api, messages, tools=[WEATHER_TOOL], max_tokens=20)
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Rome"]
    one = chat(two_call_api, messages, tools=[WEATHER_TOOL], max_tokens=20, parallel_tool_calls=False)
    (call,) = one.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"} and one.choices[0].finish_reason == "tool_calls"
    assert one.usage.completion_tokens == 3  # generation stopped at the first call's end, not after the second
    chunks = list(chat(two_call_api, messages, tools=[WEATHER_TOOL], max_tokens=20, stream=True,
                       parallel_tool_calls=False))
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [t.index for t in calls] == [0] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_sigterm_with_streams_open_ends_them_and_sleeps_their_sessions(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    api, started, ends = client_for(d), threading.Barrier(4), []

    def stream(i: int) -> None:
        chunks = chat(api, [{"role": "user", "content": f"long {i}"}], max_tokens=100000, stream=True,
                      extra_headers={"X-Kvwake-Session": f"open-{i}"})
        got = []
        for chunk in chunks:
            if len(got) == 2:
                started.wait(30)
            got.append(chunk)
        ends.append(got[-1].choices[0].finish_reason)

    workers = in_threads(stream, 3)
    started.wait(60)
    assert d.stop() == 0  # SIGTERM: the generations stop after their current token, the streams end
    for w in workers:
        w.join(30)
    assert ends == ["stop"] * 3 and d.log_problems() == []
    d.start()
    with d.client() as rpc:  # every session slept with what it had generated
        for i in range(3):
            info = rpc.call("session.info", session_id=f"open-{i}")
            assert info["state"] == "asleep" and 10 < info["tokens"] < 100000
    assert d.stop() == 0


def test_a_stateless_session_of_another_model_is_never_continued(tmp_path, model_dir):
    # Invariant 4 over HTTP: after a restart with another model, the stored stateless session of the
    # first is no candidate (waking it would be BUNDLE_MISMATCH); the request starts a new session.
    from testkit.tinymodel import make_model_dir

    messages = [{"role": "system", "content": SYSTEM + "two models"}, {"role": "user", "content": "first"}]
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    first = chat(client_for(d), messages)
    assert d.stop() == 0
    other = Daemon(tmp_path, make_model_dir(tmp_path / "other", seed=9), extra=["--http", "0"]).start()
    again = chat(client_for(other), messages)
    assert again.model_extra["kvwake"]["match"] == "new"
    assert again.model_extra["kvwake"]["session_id"] != first.model_extra["kvwake"]["session_id"]
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert other.stop() == 0
