"""The OpenAI Responses API, through the official `openai` package (and the OpenAI Agents SDK), against a
real daemon.

Also: the stream's events in order, function calls with the scripted model, previous_response_id
chains (a fork from an older response, across a restart), store false resends reusing the cache,
prompt_cache_key lineages, GET and DELETE, and the errors (refused fields by name, a prompt over the
context, an unknown previous response).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import urllib.request

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvwake.client import openai_config
from kvwake.daemon.fronts.openai_shapes import ApiError
from kvwake.daemon.fronts.responses_shapes import ResponsesReply, ResponsesRequest
from testkit.daemon import Daemon, openai_client, serving_http
from testkit.tinymodel import TOOLS_CHATML, make_model_dir, make_scripted_model

INSTRUCTIONS = "You are a careful agent. Answer briefly and name your sources. " * 4
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


client_for = openai_client  # testkit.daemon's


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model_dir):
    """The module's daemon: the tiny model (4k context), HTTP on a free port."""
    yield from serving_http(tmp_path_factory.mktemp("responses"), model_dir)


@pytest.fixture(scope="module")
def api(daemon):
    return client_for(daemon)


def create(api: openai.OpenAI, input, **options):
    options = {"model": "gpt-5-codex", "max_output_tokens": 6, "temperature": 0, "instructions": INSTRUCTIONS,
               **options}
    return api.responses.create(input=input, **options)


def session_of(response) -> str:
    return response.model_extra["kvwake"]["session_id"]


def cached(response) -> int:
    return response.usage.input_tokens_details.cached_tokens


def replayed(response) -> list[dict]:
    """A response's output items as a client sends them back in `input`."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def test_a_response_streamed_and_not_is_the_same(api):
    whole = create(api, "stream or not?", max_output_tokens=12)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens" and whole.usage.output_tokens == 12
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert whole.output_text == message.content[0].text and whole.instructions == INSTRUCTIONS
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12
    events = list(create(api, "stream or not?", max_output_tokens=12, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.id == events[0].response.id != whole.id
    assert events[-2].item.id == final.output[0].id and events[-2].item.status == "incomplete"
    # The same request again continues the first one's session: all of the prompt but its last token is cached.
    assert final.usage.input_tokens == whole.usage.input_tokens and cached(final) == final.usage.input_tokens - 1
    with api.responses.stream(model="m", input="stream or not?", instructions=INSTRUCTIONS, max_output_tokens=12,
                              temperature=0) as stream:  # the SDK's helper (an incomplete reply: no final response)
        events = list(stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas[-1].snapshot == whole.output_text and events[-1].response.output_text == whole.output_text


def validated_stream(d: Daemon, body: dict, headers: dict | None = None) -> list:
    """The raw server-sent events of a streamed request, each validated (not just parsed, as the SDK
    does) against the `openai` package's event types; each `event:` names its data's type. `headers`,
    when given, gets the response's headers (names in lower case)."""
    config, events = openai_config(d.socket), []
    request = urllib.request.Request(f"{config['base_url']}/responses", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Authorization": f"Bearer {config['api_key']}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
        (headers if headers is not None else {}).update((k.lower(), v) for k, v in reply.headers.items())
        lines = [line.decode().rstrip("\n") for line in reply if line.strip()]
    for name, data in zip(lines[::2], lines[1::2]):
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(TypeAdapter(ResponseStreamEvent).validate_python(event))
    return events


def test_every_event_and_response_validates_against_the_sdks_types(daemon, tool_daemon):
    for d in (daemon, tool_daemon):
        body = {"model": "m", "input": "validate", "max_output_tokens": 8, "temperature": 0,
                "tools": [WEATHER] if d is tool_daemon else [], "metadata": {"k": "v"}}
        events = validated_stream(d, body)
        Response.model_validate(events[-1].response.model_dump())
        assert events[-1].response.metadata == {"k": "v"}
        whole = client_for(d).responses.with_raw_response.create(**body)
        Response.model_validate(json.loads(whole.text))


def test_a_failure_after_the_stream_began_is_response_failed_then_error():
    reply = ResponsesReply("m", ResponsesRequest.parse({"model": "m", "input": "x"}, None))
    events = reply.piece({"append": {"tokens": 3, "computed": 3}}) + reply.piece({"text": "partial"})
    events += reply.failure(ApiError(503, "the daemon is stopping", code="cancelled", kind="server_error"))
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in parsed][-5:] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.failed", "error"]
    failed, error = parsed[-2:]
    assert failed.response.status == "failed" and failed.response.error.code == "server_error"
    assert failed.response.error.message == "the daemon is stopping"
    assert failed.response.output[0].content[0].text == "partial" and error.code == "cancelled"
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))


def test_a_previous_response_id_chain_computes_only_each_turns_new_tokens(api):
    first = create(api, "turn 0 of a chain")
    previous = first
    for turn in range(1, 4):
        reply = create(api, [{"role": "user", "content": f"turn {turn}"}], previous_response_id=previous.id)
        assert reply.previous_response_id == previous.id
        assert session_of(reply) == session_of(first) and reply.model_extra["kvwake"]["match"] == "continued"
        assert cached(reply) >= previous.usage.input_tokens, turn  # the previous prompt and reply are cached
        assert reply.usage.input_tokens - cached(reply) < 60, turn  # the reply re-rendered, the new turn (bytes)
        previous = reply


def test_an_older_response_forks_and_leaves_the_newer_state(api):
    one = create(api, "the root of a fork")
    two = create(api, "go left", previous_response_id=one.id)
    other = create(api, "go right", previous_response_id=one.id)
    assert session_of(two) == session_of(one) and session_of(other) != session_of(one)
    assert other.model_extra["kvwake"]["match"] == "branched" and cached(other) >= one.usage.input_tokens
    three = create(api, "and on", previous_response_id=two.id)  # the newer state was left as it was
    assert session_of(three) == session_of(one) and three.model_extra["kvwake"]["match"] == "continued"
    assert cached(three) >= two.usage.input_tokens
    on_other = create(api, "and on", previous_response_id=other.id)
    assert session_of(on_other) == session_of(other) and cached(on_other) >= other.usage.input_tokens


def test_store_false_resends_continue_the_longest_prefix_and_keep_nothing(api):
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "store false 0"}]}]
    previous = None
    for turn in range(1, 4):
        reply = create(api, items, store=False)
        assert reply.store is False
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(reply.id)
        if previous is not None:
            assert session_of(reply) == session_of(previous) and cached(reply) >= previous.usage.input_tokens
        items += [*replayed(reply), {"role": "user", "content": f"store false {turn}"}]
        previous = reply


def test_prompt_cache_key_keeps_two_lineages_apart(api):
    """Two conversations that begin alike: without keys the second would continue the first's session."""
    start = [{"role": "user", "content": "the same first words"}]
    a = create(api, start, store=False, prompt_cache_key="thread-a")
    b = create(api, start, store=False, prompt_cache_key="thread-b")
    assert session_of(b) != session_of(a) and b.model_extra["kvwake"]["match"] == "branched"
    assert cached(b) > 0  # its prefix still comes from a's session
    for key, first in (("thread-a", a), ("thread-b", b)):
        more = create(api, [*start, *replayed(first), {"role": "user", "content": key}], store=False,
                      prompt_cache_key=key)
        assert session_of(more) == session_of(first) and cached(more) >= first.usage.input_tokens


def test_get_and_delete_a_stored_response(api):
    made = create(api, "keep me")
    got = api.responses.retrieve(made.id)
    assert got.model_dump(exclude={"kvwake"}) == made.model_dump(exclude={"kvwake"})
    assert got.model_extra.get("kvwake") is None and got.store is True
    assert api.responses.delete(made.id) is None
    with pytest.raises(openai.NotFoundError) as gone:
        api.responses.retrieve(made.id)
    assert gone.value.body["type"] == "not_found_error" and made.id in gone.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(made.id)
    with pytest.raises(openai.BadRequestError) as unknown:
        create(api, "after a deleted one", previous_response_id=made.id)
    assert unknown.value.code == "previous_response_not_found" and unknown.value.param == "previous_response_id"


def test_what_kvwake_cannot_honour_is_refused_by_name(daemon, api):
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    refusals = [
        ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type", "'custom'"),  # built-in: left out
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "'xml'"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": 3}}}},
         "text.format.schema", "properties"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "look"}, image]}]},
         "input[0].content[1].type", "'input_image'"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "'item_reference'"),
        ({"background": True}, "background", "background"),
        ({"truncation": "auto"}, "truncation", "disabled"),
    ]
    with daemon.client() as rpc:
        before = len(rpc.call("session.list")["sessions"])
        for options, param, named in refusals:
            options = {"input": "refuse", **options}
            with pytest.raises(openai.BadRequestError) as bad:
                create(api, **options)
            body = bad.value.body
            assert body["type"] == "invalid_request_error" and body["param"] == param, (param, body)
            assert body["message"].startswith(param) and named in body["message"], (param, body)
        assert len(rpc.call("session.list")["sessions"]) == before  # a refused request makes no session


def test_a_prompt_over_the_context_is_refused_at_once(api):
    # The tiny model's context is 4096 tokens (1 byte = 1 token).
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as bad:
            create(api, "x" * 5000, stream=stream)
        assert bad.value.code == "context_length_exceeded" and "prompt is too long" in bad.value.message


def test_items_become_the_chat_messages_templates_know():
    body = {"model": "m", "instructions": "Be brief.", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Use the tool."}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "Twice."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "19 C"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "21 and 19.",
                                                               "annotations": []}]}]}
    messages = ResponsesRequest.parse(body, None).messages
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": json.dumps({"city": city})}}
             for i, city in ((1, "Paris"), (2, "Lyon"))]
    assert messages == [{"role": "system", "content": "Be brief.\n\nSandbox: none."},
                        {"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.\nTwice.",
                         "tool_calls": calls},
                        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
                        {"role": "tool", "tool_call_id": "call_2", "content": "19 C"},
                        {"role": "assistant", "content": "21 and 19."}]


# -- function calls: the scripted model (tinymodel.make_scripted_model) answers every turn with one get_weather call --

@pytest.fixture(scope="module")
def tool_daemon(tmp_path_factory):
    model = make_scripted_model(tmp_path_factory.mktemp("models") / "scripted")
    yield from serving_http(tmp_path_factory.mktemp("responses-tools"), model)


def test_function_calls_out_and_their_outputs_back_in(tool_daemon):
    api = client_for(tool_daemon)
    first = create(api, "Weather in Paris?", tools=[WEATHER], max_output_tokens=20)
    assert first.status == "completed" and first.output_text == ""
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]
    second = create(api, answer, tools=[WEATHER], max_output_tokens=20, previous_response_id=first.id)
    assert session_of(second) == session_of(first) and cached(second) >= first.usage.input_tokens
    events = list(create(api, "Stream the call", tools=[WEATHER], max_output_tokens=20, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "response.completed"]
    added, delta, done, item_done, completed = events[2:]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.item.status == "in_progress"
    assert delta.delta == done.arguments == item_done.item.arguments == '{"city": "Paris"}'
    assert completed.response.output == [item_done.item]
    # With tool_choice none the template gets no tools, and the prompt is shorter.
    plain = create(api, "No tools", tools=[WEATHER], tool_choice="none", max_output_tokens=20)
    assert plain.usage.input_tokens < first.usage.input_tokens


def test_the_agents_sdk_runs_an_agent_with_its_default_responses_model(tool_daemon):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers
    agents.set_default_openai_api("responses")  # its default; said here so a changed default cannot hide
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        seen.append(city)
        return f"21C in {city}"

    agent = agents.Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather],
                         tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=20))

    async def run() -> tuple[agents.RunResult, agents.RunResult, list[str]]:
        async with openai.AsyncOpenAI(**openai_config(tool_daemon.socket), max_retries=0) as client:
            agents.set_default_openai_client(client, use_for_tracing=False)
            result = await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
            # The SDK's own server-side conversation: only the new input, and the previous response's id.
            later = await agents.Runner.run(agent, "And tomorrow?", max_turns=3,
                                            previous_response_id=result.last_response_id)
            streamed = agents.Runner.run_streamed(agent, "Weather in Paris, streamed?", max_turns=3)
            kinds = [event.data.type async for event in streamed.stream_events()
                     if event.type == "raw_response_event"]
            assert streamed.final_output == "21C in Paris"
            return result, later, kinds

    result, later, kinds = asyncio.run(run())
    assert isinstance(agents.models.get_default_model(), str)  # the SDK's own model name, served by any name
    assert result.final_output == later.final_output == "21C in Paris" and seen == ["Paris"] * 3
    (response,) = result.raw_responses
    assert response.response_id.startswith("resp_") and response.usage.input_tokens > 0
    (continued,) = later.raw_responses
    assert continued.usage.input_tokens_details.cached_tokens >= response.usage.input_tokens
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_what_codex_cli_sends_is_served(tool_daemon):
    """Codex CLI's request, as seen on the wire: items, developer and user roles, store false, its thread id
    as prompt_cache_key, reasoning and include, streamed; each turn resends the whole input, its calls and
    their outputs."""
    api = client_for(tool_daemon)
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env>/repo</env>"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the bug"}]}]
    previous = None
    for turn in range(3):
        with api.responses.stream(model="gpt-5-codex", instructions=INSTRUCTIONS, input=items, tools=[WEATHER],
                                  tool_choice="auto", parallel_tool_calls=False, store=False,
                                  reasoning={"effort": "medium", "summary": "auto"},
                                  include=["reasoning.encrypted_content"], prompt_cache_key="codex-thread-1",
                                  extra_body={"temperature": 0}) as stream:
            final = stream.get_final_response()
        (call,) = final.output
        assert call.type == "function_call" and final.store is False
        if previous is not None:
            assert session_of(final) == session_of(previous) and cached(final) >= previous.usage.input_tokens
        items += [{"type": "reasoning", "id": f"rs_{turn}", "summary": [], "encrypted_content": "opaque"},
                  *replayed(final), {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}]
        previous = final


def test_a_streamed_response_is_stored_in_the_order_it_was_streamed(tmp_path):
    """Text, a call, more text: the stream's items, the completed response and the stored one agree."""
    script = ("Checking.", "<tool_call>", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "</tool_call>",
              "\n\n", "Done.")
    d = Daemon(tmp_path, make_scripted_model(tmp_path / "talky", script), extra=["--http", "0"]).start()
    api = client_for(d)
    events = list(create(api, "Weather in Oslo?", tools=[WEATHER], max_output_tokens=20, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, getattr(i, "content", None) and i.content[0].text) for i in done] == [
        ("message", "Checking."), ("function_call", None), ("message", "\n\nDone.")]
    final = events[-1].response
    assert final.output == done and api.responses.retrieve(final.id).output == done
    whole = create(api, "Weather in Oslo?", tools=[WEATHER], max_output_tokens=20)  # not streamed: text, then calls
    assert [i.type for i in whole.output] == ["message", "function_call"]
    assert whole.output_text == "Checking.\n\nDone."
    assert d.stop() == 0 and d.log_problems() == []


def test_whitespace_around_calls_opens_no_message():
    reply = ResponsesReply("m", ResponsesRequest.parse({"model": "m", "input": "x"}, None))
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    events = [e for piece in ({"append": {"tokens": 3}}, {"text": "\n"}, {"tool_call": call, "index": 0},
                              {"text": "\n\n"}, {"text": " "}) for e in reply.piece(piece)]
    assert [e["type"] for e in events][2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                                               "response.function_call_arguments.done", "response.output_item.done"]
    assert [i["type"] for i in reply.items] == ["function_call"]


def test_a_thinking_models_reasoning_is_a_reasoning_item(tmp_path):
    """The scripted model thinks first (<think> and </think> are its tokenizer's thinking markers)."""
    model = make_scripted_model(tmp_path / "thinker", ("<think>", "Weigh it.", "</think>", "Hello there."))
    d = Daemon(tmp_path, model, extra=["--http", "0"]).start()
    try:
        api = client_for(d)
        whole = create(api, "hi", max_output_tokens=20)
        assert [i.type for i in whole.output] == ["reasoning", "message"] and whole.output_text == "Hello there."
        assert whole.output[0].content[0].text == "Weigh it." and whole.output[0].summary == []
        events = validated_stream(d, {"model": "m", "input": "hi", "max_output_tokens": 20, "temperature": 0})
        kinds = [e.type for e in events]
        assert kinds[2:6] == ["response.output_item.added", "response.content_part.added",
                              "response.reasoning_text.delta", "response.reasoning_text.done"]
        final = events[-1].response
        assert [i.model_dump(exclude={"id"}) for i in final.output] == [
            i.model_dump(exclude={"id"}) for i in whole.output]
        # Continued: the reasoning goes back to the template with the reply (reasoning_content), as resent.
        after = create(api, "and then?", previous_response_id=whole.id, max_output_tokens=20)
        resent = create(api, [{"role": "user", "content": "hi"}, *replayed(whole),
                              {"role": "user", "content": "and then?"}], store=False, max_output_tokens=20)
        assert resent.usage.input_tokens == after.usage.input_tokens
    finally:
        assert d.stop() == 0 and d.log_problems() == []


# -- durable response ids: across a restart --

def test_a_previous_response_id_continues_after_a_restart(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    one = create(client_for(d), "before the restart")
    two = create(client_for(d), "still before", previous_response_id=one.id)
    assert d.stop() == 0
    d.start()
    api = client_for(d)
    assert api.responses.retrieve(two.id).output_text == two.output_text
    three = create(api, "after the restart", previous_response_id=two.id)
    assert session_of(three) == session_of(one) and three.model_extra["kvwake"]["match"] == "continued"
    assert cached(three) >= two.usage.input_tokens
    # An older response of the session that moved on: a new session, its prefix from stored blocks.
    fork = create(api, "a fork after the restart", previous_response_id=one.id)
    assert session_of(fork) != session_of(one) and fork.model_extra["kvwake"]["match"] == "branched"
    assert cached(fork) >= one.usage.input_tokens - 16  # whole stored blocks (16 tokens here) of the shared prefix
    assert d.stop() == 0 and d.log_problems() == []


def test_stored_responses_expire_with_the_stateless_sessions(tmp_path, model_dir):
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    made = create(client_for(d), "expire me")
    assert d.stop() == 0
    (tmp_path / "none.toml").write_text("stateless_ttl_s = 0.5\ngc_interval_s = 0.2\nlifecycle_interval_s = 0.1\n")
    time.sleep(0.6)
    d.start()
    api = client_for(d)
    for _ in range(300):
        try:
            api.responses.retrieve(made.id)
        except openai.NotFoundError:
            break
        time.sleep(0.1)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(made.id)
    assert d.stop() == 0 and d.log_problems() == []


def test_a_stored_response_survives_kill_9_whole(tmp_path, model_dir):
    """The record is committed before the reply is sent: after kill -9 (no session slept) the chain
    continues with the whole conversation, as a resend of it renders."""
    d = Daemon(tmp_path, model_dir, extra=["--http", "0"]).start()
    one = create(client_for(d), "before the crash")
    two = create(client_for(d), "just before", previous_response_id=one.id)
    d.stop(signal.SIGKILL)
    d.start()
    api = client_for(d)
    three = create(api, "after the crash", previous_response_id=two.id)
    assert three.status in ("completed", "incomplete") and three.previous_response_id == two.id
    items = [{"role": "user", "content": "before the crash"}, *replayed(one), {"role": "user", "content": "just before"},
             *replayed(two), {"role": "user", "content": "after the crash"}]
    resent = create(api, items, store=False)
    assert resent.usage.input_tokens == three.usage.input_tokens  # the same prompt, token for token
    assert cached(resent) >= three.usage.input_tokens - 1  # and it continues the chain's session
    assert d.stop() == 0 and d.log_problems() == []


def test_nulls_read_as_defaults_and_wrong_types_are_refused_by_name():
    body = {"model": "m", "input": "x", "store": None, "stream": None, "parallel_tool_calls": None,
            "temperature": None, "top_p": None, "metadata": None, "tools": [WEATHER]}
    req = ResponsesRequest.parse(body, None)
    assert req.store is True and req.stream is False and req.one_call is False
    assert (req.echo["temperature"], req.echo["top_p"], req.echo["parallel_tool_calls"]) == (1.0, 1.0, True)
    for field, value, says in (("stream", "yes", "true or false"), ("store", 1, "true or false"),
                               ("metadata", [], "an object"), ("instructions", 3, "a string"),
                               ("max_output_tokens", -1, "max_output_tokens")):
        with pytest.raises(ApiError) as bad:
            ResponsesRequest.parse({**body, field: value}, None)
        assert bad.value.status == 400 and bad.value.param == field and says in bad.value.message, field


def test_structured_output_by_text_format_and_a_forced_call(api, tmp_path):
    """text.format json_schema (and the SDK's responses.parse with a pydantic model) yields JSON that validates;
    tool_choice required (and a named function) yields a call: the grammar of chat completions' structured output."""
    import jsonschema
    from pydantic import BaseModel, ConfigDict, Field

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    made = create(api, "Plan a trip", max_output_tokens=120,
                  text={"format": {"type": "json_schema", "name": "trip", "schema": schema, "strict": True}})
    assert made.status == "completed" and made.text.format.type == "json_schema"
    jsonschema.validate(json.loads(made.output_text), schema)

    class Trip(BaseModel):
        model_config = ConfigDict(extra="forbid")
        city: str = Field(max_length=12)  # a random model writes until a bound (or max_tokens) stops it
        days: int = Field(ge=1, le=7)

    parsed = api.responses.parse(model="m", input="Plan another", text_format=Trip, max_output_tokens=120,
                                 temperature=0)
    assert isinstance(parsed.output_parsed, Trip)
    # A random model whose template has a tool-call format (json_tools): the grammar writes its call markup.
    d = Daemon(tmp_path, make_model_dir(tmp_path / "tools-llama", template=TOOLS_CHATML), extra=["--http", "0"]).start()
    try:
        bounded = {**WEATHER, "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                                             "properties": {"city": {"type": "string", "maxLength": 4}}}}
        for choice in ("required", {"type": "function", "name": "get_weather"}):
            forced = create(client_for(d), "Anything", tools=[bounded], tool_choice=choice, max_output_tokens=200)
            calls = [item for item in forced.output if item.type == "function_call"]
            assert calls and len(calls) == (1 if isinstance(choice, dict) else len(calls))  # named: one call
            for call in calls:
                assert call.name == "get_weather"
                jsonschema.validate(json.loads(call.arguments), bounded["parameters"])
    finally:
        assert d.stop() == 0
