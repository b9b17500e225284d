"""The Anthropic Messages API, through the official `anthropic` package, against a real daemon.

Also: x-api-key and Bearer auth, Anthropic's error shapes, /v1/models in Anthropic's
shape, count_tokens, tool_use / tool_result turns (the scripted model), stateless
continuation with cache_read_input_tokens (a ~20k-token system prompt, across a
restart), Claude Code's billing header left out of the prompt, and [aliases].
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import urllib.request

import anthropic
import mlx.core as mx
import openai
import pytest

from kvwake.client import openai_config
from kvwake.daemon.fronts.anthropic_shapes import MessagesRequest
from testkit.daemon import REPO, Daemon, get, serving_http, track
from testkit.tinymodel import TOOLS_CHATML, make_model_dir, make_scripted_model

SYSTEM = "You are a careful agent. Answer briefly and name your sources. " * 4
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def base_url(d: Daemon) -> str:
    return openai_config(d.socket)["base_url"].removesuffix("/v1")


def client_for(d: Daemon, **auth) -> anthropic.Anthropic:
    auth = auth or {"api_key": openai_config(d.socket)["api_key"]}
    return track(anthropic.Anthropic(base_url=base_url(d), max_retries=0, timeout=300, **auth))


@pytest.fixture(scope="module")
def api(daemon):
    """An anthropic client of the module's daemon, with the token as x-api-key."""
    return client_for(daemon)


GREEDY = {"temperature": 0}  # older clients' field (the SDK no longer has it): still honoured


def ask(api: anthropic.Anthropic, messages: list[dict], **options):
    options = {"max_tokens": 6, "model": "claude-sonnet-4-6", **options}
    options["extra_body"] = {**GREEDY, **options.get("extra_body", {})}
    return api.messages.create(messages=messages, **options)


def total_of(reply) -> int:
    """A reply's whole prompt: the tokens computed and those read from the cache."""
    return reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def billing() -> dict:
    """Claude Code's first system block: new on every request."""
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{secrets.token_hex(3)}; "
                                    "cc_entrypoint=cli;"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model_dir):
    """The module's daemon: the tiny model (4k context), HTTP on a free port."""
    yield from serving_http(tmp_path_factory.mktemp("anthropic"), model_dir)


def test_a_reply_streamed_and_not_is_the_same(api):
    messages = [{"role": "user", "content": "stream or not?"}]
    whole = ask(api, messages, system=SYSTEM, max_tokens=12)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    (block,) = whole.content
    events = list(ask(api, messages, system=SYSTEM, max_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == block.text
    # The same request again continues the session the first made: all its prompt is read from the
    # cache but the pending last token, and message_start already says so.
    start, end = events[0].message.usage, events[-2].usage
    assert start.input_tokens == end.input_tokens == 1 and start.cache_read_input_tokens > 20
    assert end.output_tokens == 12 and events[-2].delta.stop_reason == "max_tokens"
    with api.messages.stream(model="x", max_tokens=12, extra_body=GREEDY, system=SYSTEM, messages=messages) as stream:
        assert "".join(stream.text_stream) == block.text
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == start.cache_read_input_tokens


def test_turns_read_the_earlier_ones_from_the_cache(api):
    messages, previous = [], None
    for turn in range(3):
        messages.append({"role": "user", "content": [{"type": "text", "text": f"turn {turn}"}]})
        reply = ask(api, messages, system=[{"type": "text", "text": SYSTEM + "turns", "cache_control": {
            "type": "ephemeral"}}])
        if previous is not None:  # the previous prompt and reply are in the cache: only this turn is computed
            assert reply.usage.cache_read_input_tokens >= total_of(previous), turn
            assert reply.model_extra["kvwake"]["session_id"] == previous.model_extra["kvwake"]["session_id"]
        messages.append({"role": "assistant", "content": reply.content})
        previous = reply


def test_stop_sequences_and_count_tokens(api):
    messages = [{"role": "user", "content": "stop here"}]
    text = ask(api, messages, max_tokens=12).content[0].text
    stop = text[3:5]
    cut = ask(api, messages, max_tokens=12, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    counted = api.messages.count_tokens(model="any", messages=messages, system=SYSTEM)
    reply = ask(api, messages, system=SYSTEM)
    assert counted.input_tokens == total_of(reply)
    # Claude Code sends both with ?beta=true (the SDK's beta client does too)
    beta = api.beta.messages.count_tokens(model="any", messages=messages, system=SYSTEM, betas=["x-1"])
    assert beta.input_tokens == counted.input_tokens


def test_the_token_as_x_api_key_or_bearer_and_a_wrong_one(daemon):
    token = openai_config(daemon.socket)["api_key"]
    for auth in ({"api_key": token}, {"auth_token": token}):
        assert ask(client_for(daemon, **auth), [{"role": "user", "content": "hi"}]).type == "message"
    with pytest.raises(anthropic.AuthenticationError) as refused:
        ask(client_for(daemon, api_key="not-the-token"), [{"role": "user", "content": "hi"}])
    assert refused.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": refused.value.body["error"]["message"]}}


def test_kvwake_http_exports_what_claude_code_reads(daemon):
    shown = subprocess.run([sys.executable, "-m", "kvwake.client.cli", "--socket", str(daemon.socket), "http", "--env"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    token = openai_config(daemon.socket)["api_key"]
    assert f"export ANTHROPIC_BASE_URL={base_url(daemon)}" in shown and f"export ANTHROPIC_API_KEY={token}" in shown


def test_a_busy_named_session_is_overloaded(api):
    started, ask_busy = threading.Event(), {"extra_headers": {"X-Kvwake-Session": "busy-a"}}

    def long_call() -> None:
        with api.messages.stream(model="m", max_tokens=400, messages=[{"role": "user", "content": "busy"}],
                                 extra_body=GREEDY, **ask_busy) as stream:
            for _ in stream:
                started.set()

    worker = threading.Thread(target=long_call)
    worker.start()
    assert started.wait(60)
    with pytest.raises(anthropic.APIStatusError) as busy:  # Anthropic's clients retry an overloaded error
        ask(api, [{"role": "user", "content": "busy"}], **ask_busy)
    worker.join(120)
    assert busy.value.status_code == 529 and busy.value.body["error"]["type"] == "overloaded_error"


def test_models_in_anthropics_shape_and_any_name_is_served(daemon, api):
    (model,) = api.models.list().data
    assert model.type == "model" and model.id == daemon.model_dir.name
    assert api.models.retrieve("claude-opus-4-1").id == "claude-opus-4-1"
    headers = {"x-api-key": openai_config(daemon.socket)["api_key"]}
    status, plain = get(f"{base_url(daemon)}/v1/models", headers)  # no anthropic-version: OpenAI's shape
    assert status == 200 and plain["object"] == "list" and plain["data"][0]["object"] == "model"
    reply = ask(api, [{"role": "user", "content": "hi"}], model="claude-haiku-4-5-20251001")
    assert reply.model == daemon.model_dir.name


def test_what_kvwake_cannot_honour_is_refused_by_name(api, daemon):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    refusals = [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, image]}]},
         "messages[0].content[1].type"),
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
        ({"tool_choice": {"type": "sometimes"}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),  # forces a call, but names no tools
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"extra_body": {"temperature": 7}}, "temperature"),
        ({"output_config": {"format": {"type": "yaml"}}}, "output_config.format"),
    ]
    for options, name in refusals:
        options = {"messages": [{"role": "user", "content": "refuse"}], **options}
        with pytest.raises(anthropic.BadRequestError) as bad:
            ask(api, **options)
        assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
        assert bad.value.body["error"]["message"].startswith(name), (name, bad.value.body)
    headers = {"x-api-key": openai_config(daemon.socket)["api_key"], "anthropic-version": "2023-06-01"}
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    status, missing = get(f"{base_url(daemon)}/v1/messages?beta=true", headers, body)
    assert status == 400 and missing["error"]["message"].startswith("max_tokens")
    status, nowhere = get(f"{base_url(daemon)}/v1/nothing", headers)
    assert status == 404 and nowhere["error"]["type"] == "not_found_error"


def test_what_changes_nothing_is_accepted(api):
    # What Claude Code sends beside the conversation: ignored, as it changes nothing kvwake does.
    reply = api.beta.messages.create(
        model="claude-sonnet-4-6", max_tokens=4, betas=["interleaved-thinking-2025-05-14"],
        system=[billing(), {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                    {"type": "text", "text": "yes?"}]},
                  {"role": "user", "content": "go on"}],
        metadata={"user_id": "u-1"}, thinking={"type": "enabled", "budget_tokens": 1024},
        output_config={"effort": "high"}, context_management={"edits": []}, speed="fast", inference_geo="us",
        extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9})
    assert reply.stop_reason == "max_tokens"


def test_a_prompt_over_the_context_is_refused_and_max_tokens_is_capped(api):
    # The tiny model's context is 4096 tokens (1 byte = 1 token); Claude Code compacts on this message.
    too_long = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(anthropic.BadRequestError) as bad:
        ask(api, too_long)
    counted = api.messages.count_tokens(model="m", messages=too_long).input_tokens  # counting is not refused
    assert bad.value.body["error"] == {"type": "invalid_request_error",
                                       "message": f"prompt is too long: {counted} tokens > 4095 maximum"}
    near = ask(api, [{"role": "user", "content": "y" * 3990}], max_tokens=1000)
    room = 4096 - total_of(near)
    assert 0 < near.usage.output_tokens <= room
    assert near.stop_reason != "max_tokens" or near.usage.output_tokens == room


def test_the_billing_header_does_not_break_reuse():
    """Two requests that differ only in Claude Code's billing header render the same prompt."""
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
            "system": [billing(), {"type": "text", "text": SYSTEM}]}
    again = {**body, "system": [billing(), {"type": "text", "text": SYSTEM}]}
    drop = ("x-anthropic-billing-header:",)
    assert MessagesRequest.parse(body, None, drop).messages == MessagesRequest.parse(again, None, drop).messages
    kept = MessagesRequest.parse(body, None, ()).messages  # configured off: the block stays
    assert kept[0]["content"].startswith("x-anthropic-billing-header:")


def test_blocks_become_the_chat_messages_templates_know():
    body = {"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "timeout"}]},
                                     {"type": "text", "text": "Try again?"}]}]}
    messages = MessagesRequest.parse(body, None, ()).messages
    assert messages[1] == {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert messages[2:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "Error: timeout"},
                            {"role": "user", "content": "Try again?"}]


# -- tools: the scripted model (tinymodel.make_scripted_model) answers every turn with one get_weather call --

@pytest.fixture(scope="module")
def tool_api(tmp_path_factory):
    model = make_scripted_model(tmp_path_factory.mktemp("models") / "scripted")
    for d in serving_http(tmp_path_factory.mktemp("anthropic-tools"), model):
        yield client_for(d)


def test_tool_use_out_and_tool_result_back_in(tool_api):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = ask(tool_api, messages, tools=[WEATHER], max_tokens=20)
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]}]
    second = ask(tool_api, messages, tools=[WEATHER], max_tokens=20)
    assert second.model_extra["kvwake"]["session_id"] == first.model_extra["kvwake"]["session_id"]
    assert second.usage.cache_read_input_tokens >= total_of(first)
    with tool_api.messages.stream(model="m", max_tokens=20, extra_body=GREEDY, tools=[WEATHER],
                                  messages=[{"role": "user", "content": "Stream the call"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"] and json.loads(deltas[0].partial_json) == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].input == {"city": "Paris"}
    plain = ask(tool_api, [{"role": "user", "content": "No tools"}], tools=[WEATHER], tool_choice={"type": "none"},
                max_tokens=20)
    assert plain.usage.input_tokens + plain.usage.cache_read_input_tokens < total_of(first)


# -- a long system prompt (1 byte = 1 token: ~20k tokens) on a 64k-context model, across a restart --

def test_a_long_system_prompt_is_read_from_the_cache_on_turn_2_and_after_a_restart(tmp_path):
    # One layer: a prefill (the cache, no logits) then computes no attention, so ~20k tokens are linear
    model = make_model_dir(tmp_path / "tiny-64k", template=TOOLS_CHATML, ascii_replies=True, dtype=mx.float32,
                           max_position_embeddings=65536, num_hidden_layers=1)
    (tmp_path / "none.toml").write_text('[aliases]\n"claude-sonnet-4-6" = "tiny-64k"\n')
    d = Daemon(tmp_path, model, block_tokens=128, extra=["--http", "0"]).start()
    system = [{"type": "text", "text": ("Tool manual. " + SYSTEM) * 80, "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "turn 1"}]

    def turn() -> anthropic.types.Message:  # each request with a new billing header, as Claude Code's
        reply = ask(client_for(d), messages, system=[billing(), *system], tools=[WEATHER])
        messages.extend([{"role": "assistant", "content": reply.content},
                         {"role": "user", "content": f"turn {len(messages) // 2 + 1}"}])
        return reply

    first = turn()
    assert first.usage.input_tokens > 20000
    second = turn()
    # Only the new tokens are computed: the reply as re-rendered, the next user turn, the template's.
    assert second.usage.cache_read_input_tokens >= total_of(first) and second.usage.input_tokens < 60
    assert d.stop() == 0
    d.start()
    third = turn()
    assert third.model_extra["kvwake"]["session_id"] == first.model_extra["kvwake"]["session_id"]
    assert third.usage.cache_read_input_tokens >= total_of(second)
    assert third.usage.input_tokens < 60
    # With [aliases], only the names it gives are served; /v1/models lists them.
    with pytest.raises(anthropic.NotFoundError) as unknown:
        ask(client_for(d), messages, model="claude-opus-4-1")
    assert unknown.value.body["error"]["type"] == "not_found_error"
    assert [m.id for m in client_for(d).models.list().data] == ["tiny-64k", "claude-sonnet-4-6"]
    assert d.stop() == 0 and d.log_problems() == []


def test_a_long_prefill_sends_keepalives_before_message_start_and_clients_skip_them(tmp_path, model_dir):
    (tmp_path / "none.toml").write_text("http_keepalive_s = 0.05\n")
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    try:
        config = openai_config(d.socket)
        body = {"model": "m", "max_tokens": 4, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": "long " * 600}]}  # ~3000 tokens to prefill
        request = urllib.request.Request(f"{base_url(d)}/v1/messages", json.dumps(body).encode(),
                                         {"x-api-key": config["api_key"], "content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            lines = [line.decode().rstrip("\n") for line in response]
        opening = lines.index("event: message_start")
        assert ": keepalive" in lines[:opening]  # the stream opened during the prefill
        assert lines[-3:] == ["event: message_stop", 'data: {"type":"message_stop"}', ""]
        body["messages"][0]["content"] = "again " * 600  # a new prompt: a new prefill
        del body["temperature"]  # the SDK has no such argument any more
        events = list(client_for(d).messages.create(**body, extra_body=GREEDY))
        assert [e.type for e in events][0] == "message_start" and events[-1].type == "message_stop"
    finally:
        assert d.stop() == 0


def test_a_thinking_models_reasoning_comes_as_thinking_blocks_when_asked(tmp_path):
    """The scripted model thinks first (<think> and </think> are its tokenizer's thinking markers)."""
    model = make_scripted_model(tmp_path / "thinker", ("<think>", "Weigh it.", "</think>", "Hello there."))
    d = Daemon(tmp_path, model, extra=["--http", "0"]).start()
    try:
        api, messages = client_for(d), [{"role": "user", "content": "hi"}]
        asked = ask(api, messages, max_tokens=20, thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in asked.content] == ["thinking", "text"]
        assert asked.content[0].thinking == "Weigh it." and asked.content[0].signature.startswith("kvwake-")
        assert asked.content[1].text == "Hello there." and asked.stop_reason == "end_turn"
        plain = ask(api, messages, max_tokens=20)  # not asked: the reasoning is left out
        assert [(b.type, b.text) for b in plain.content] == [("text", "Hello there.")]
        with api.messages.stream(model="x", max_tokens=20, extra_body=GREEDY, messages=messages,
                                 thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
            streamed = stream.get_final_message()
        assert ("content_block_delta", "thinking_delta") in kinds and ("content_block_delta", "signature_delta") in kinds
        fields = ("type", "text", "thinking", "signature")  # the SDK's stream adds parsed_output to text blocks
        assert [{k: getattr(b, k, None) for k in fields} for b in streamed.content] == \
            [{k: getattr(b, k, None) for k in fields} for b in asked.content]
        # Chat completions: the reasoning apart, as reasoning_content (whole and streamed).
        chat = track(openai.OpenAI(**openai_config(d.socket), max_retries=0))
        reply = chat.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0)
        message = reply.choices[0].message
        assert message.content == "Hello there." and message.model_extra["reasoning_content"] == "Weigh it."
        chunks = list(chat.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0,
                                                   stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join((delta.model_extra or {}).get("reasoning_content") or "" for delta in deltas) == "Weigh it."
        assert "".join(delta.content or "" for delta in deltas) == "Hello there."
        with d.client() as rpc:  # over RPC: the result's `reasoning`, cut from `content`
            rpc.call("session.create", session_id="r")
            got = rpc.call("session.chat", session_id="r", messages=messages, max_tokens=20, temperature=0)
            assert (got["reasoning"], got["content"]) == ("Weigh it.", "Hello there.")
            assert got["text"] == "<think>Weigh it.</think>Hello there."
    finally:
        assert d.stop() == 0
