"""Codex CLI's requests on the Responses API: namespace tools, OpenAI's built-in tools (left out by default,
refused by name with `--http-hosted-tools refuse`) and `GET /v1/responses/{id}/input_items`, against a real
daemon.

tests/fixtures/codex-0.171.0-request.json is the first request Codex CLI 0.171.0 sent for `codex exec
"Say hello"` (with the provider docs/http.md gives), captured on the wire by bench/codex_capture.py: 7
function tools, the `multi_agent_v1` namespace tool (5 function tools) and `web_search`;
codex-0.171.0-request-2.json is the request Codex sent next, after it was answered with a call of
`multi_agent_v1`'s `close_agent` and ran it: the same input, then the call (with its `namespace`) and
Codex's output for it. They are replayed through raw HTTP (the real CLI runs against kvwake in
bench/codex_cli.py); their long developer texts are cut so the CPU prefill stays short, all else is as
captured. The scripted model makes that same call after a user's words and answers in words after a
tool's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from openai.types.responses import ResponseItem
from pydantic import TypeAdapter

from kvwake.client import openai_config
from kvwake.daemon.fronts.openai_shapes import ApiError
from kvwake.daemon.fronts.responses_shapes import ResponsesRequest
from testkit.daemon import Daemon, get, openai_client
from tests.test_responses import cached, replayed, session_of, validated_stream
from testkit.tinymodel import after_tool_template, make_scripted_model

FIXTURES = Path(__file__).parent / "fixtures"
CLOSE = '{"name": "multi_agent_v1__close_agent", "arguments": {"target": "agent-7"}}'
ANSWER = ("Closed", " it.")
# The tools by name only: the prompt says which names the model is offered, and stays short.
NAMES_ONLY = after_tool_template("{% for t in tools %}{{ t.function.name }} {% endfor %}")
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
          "tools": [{"type": "function", "name": "close_agent", "description": "Close an agent.",
                     "parameters": {"type": "object", "properties": {"target": {"type": "string"}},
                                    "required": ["target"]}},
                    {"type": "function", "name": "wait_agent", "parameters": {"type": "object", "properties": {}}}]}


def codex_request(suffix: str = "") -> dict:
    """A captured request, its messages' texts cut to 300 characters."""
    body = json.loads((FIXTURES / f"codex-0.171.0-request{suffix}.json").read_text())
    for item in body["input"]:
        for part in item.get("content") or []:
            part["text"] = part["text"][:300]
    return body


def serving(root: Path, model: Path, *extra: str):
    d = Daemon(root, model, extra=["--http", "0", *extra]).start()
    yield d
    assert d.stop() == 0
    assert d.log_problems() == []


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_scripted_model(tmp_path_factory.mktemp("models") / "closer", ("<tool_call>", CLOSE, "</tool_call>"),
                               template=NAMES_ONLY, more=[("\t", ANSWER)])


@pytest.fixture(scope="module")
def refusing(tmp_path_factory, model):
    """OpenAI's built-in tools refused by name (`--http-hosted-tools refuse`)."""
    yield from serving(tmp_path_factory.mktemp("refusing"), model, "--http-hosted-tools", "refuse")


@pytest.fixture(scope="module")
def omitting(tmp_path_factory, model):
    """The default: OpenAI's built-in tools left out of the prompt (no flag)."""
    yield from serving(tmp_path_factory.mktemp("omitting"), model)


def post(d: Daemon, body: dict) -> tuple[int, dict]:
    config = openai_config(d.socket)
    return get(f"{config['base_url']}/responses", {"Authorization": f"Bearer {config['api_key']}",
                                                   "Content-Type": "application/json"}, json.dumps(body).encode())


# Two tests validate Codex's streams against the SDK's own types, which know namespace tools (the test extra
# pins an `openai` package that has them).
def test_codex_clis_request_is_refused_with_refuse_naming_its_web_search_tool(refusing):
    status, body = post(refusing, codex_request())
    error = body["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == "tools[8].type"
    assert "'web_search'" in error["message"] and "--http-hosted-tools omit" in error["message"]
    assert 'web_search = "disabled"' in error["message"]  # how to turn it off in Codex
    # Without the web_search tool (Codex's web_search = "disabled") the same request is served.
    request = codex_request()
    request["tools"] = [t for t in request["tools"] if t["type"] != "web_search"]
    events = validated_stream(refusing, request)
    assert events[-1].type == "response.completed" and events[-1].response.output[0].namespace == "multi_agent_v1"


def test_codex_clis_turns_with_a_namespace_call_continue_the_cache(omitting):
    """Codex's two captured requests, its default config's web_search and all, to a daemon with its default
    settings: the first, then the next one, which resends the whole input, the call (with its namespace) and
    Codex's output for it."""
    request, headers = codex_request(), {}
    events = validated_stream(omitting, request, headers)
    assert headers["x-kvwake-omitted-tools"] == "web_search"
    first = events[-1].response
    assert len(first.output) == 1, first.output
    (call,) = first.output
    assert (call.type, call.name, call.namespace) == ("function_call", "close_agent", "multi_agent_v1")
    assert json.loads(call.arguments) == {"target": "agent-7"}
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.namespace == "multi_agent_v1" and added.item.name == "close_agent"
    assert [t.type for t in first.tools] == ["function"] * 4 + ["namespace"] + ["function"] * 3  # no web_search
    assert [t.name for t in first.tools[4].tools] == ["close_agent", "resume_agent", "send_input", "spawn_agent",
                                                      "wait_agent"]
    after = codex_request("-2")
    assert after["input"][:4] == request["input"] and after["input"][4]["namespace"] == "multi_agent_v1"
    second = validated_stream(omitting, after)[-1].response
    assert second.output_text == "Closed it." and session_of(second) == session_of(first)
    # The call renders as the model wrote it (its three tokens): all of the first turn is cached.
    assert cached(second) >= first.usage.input_tokens + 3


def test_namespace_tools_through_the_openai_package(omitting):
    api = openai_client(omitting)
    first = api.responses.create(model="gpt-5-codex", input="Close agent 7", tools=[AGENTS], temperature=0,
                                 max_output_tokens=20, store=False)
    (call,) = first.output
    assert (call.name, call.namespace, call.call_id) == ("close_agent", "multi_agent_v1", call.call_id)
    assert first.tools[0].type == "namespace" and first.tools[0].name == "multi_agent_v1"
    items = [{"role": "user", "content": "Close agent 7"}, *replayed(first),
             {"type": "function_call_output", "call_id": call.call_id, "output": "closed"}]
    second = api.responses.create(model="gpt-5-codex", input=items, tools=[AGENTS], temperature=0,
                                  max_output_tokens=20, store=False)
    assert second.output_text == "Closed it." and session_of(second) == session_of(first)
    assert cached(second) >= first.usage.input_tokens + 3
    # The same call resent without its namespace names another tool: the prompt differs from the call on.
    bare = [{**item, "namespace": None} if item.get("type") == "function_call" else item for item in items]
    other = api.responses.create(model="gpt-5-codex", input=bare, tools=[AGENTS], temperature=0,
                                 max_output_tokens=20, store=False)
    assert cached(other) < first.usage.input_tokens + 3


def test_built_in_tools_left_out_by_default_say_so(omitting):
    api = openai_client(omitting)
    raw = api.responses.with_raw_response.create(model="m", input="Close agent 7", temperature=0, max_output_tokens=20,
                                                 tools=[{"type": "web_search"}, AGENTS, {"type": "file_search",
                                                                                         "vector_store_ids": ["vs_1"]}])
    assert raw.headers["x-kvwake-omitted-tools"] == "web_search, file_search"
    said = [line for line in omitting.log.read_text().splitlines() if "left out of the prompt" in line]
    assert said and "web_search, file_search" in said[-1]  # the daemon's log says so too
    made = raw.parse()
    assert [t.type for t in made.tools] == ["namespace"] and made.output[0].namespace == "multi_agent_v1"
    plain = api.responses.with_raw_response.create(model="m", input="hi", tools=[AGENTS], max_output_tokens=4)
    assert "x-kvwake-omitted-tools" not in plain.headers
    # A tool of the client's own that kvwake cannot offer is refused in either mode.
    with pytest.raises(openai.BadRequestError) as bad:
        api.responses.create(model="m", input="hi", tools=[{"type": "custom", "name": "apply_patch"}])
    assert bad.value.param == "tools[0].type" and "'custom'" in bad.value.message


def test_namespace_tools_refused_by_name_where_they_cannot_be_offered():
    member = AGENTS["tools"][0]
    for tools, param, says in (
            ([{**AGENTS, "tools": [{"type": "custom", "name": "x"}]}], "tools[0].tools[0].type", "'custom'"),
            ([{**AGENTS, "tools": []}], "tools[0].tools", "array of function tools"),
            ([{**AGENTS, "name": ""}], "tools[0].name", "needs a name"),
            ([{**member, "name": "multi_agent_v1__close_agent"}, AGENTS], "tools[1].tools[0].name", "second tool"),
            ([{"type": "web_search_preview"}], "tools[0].type", "built-in")):
        with pytest.raises(ApiError) as bad:
            ResponsesRequest.parse({"model": "m", "input": "x", "tools": tools}, None, "refuse")
        assert bad.value.status == 400 and bad.value.param == param and says in bad.value.message, param
    # Unless refused, a built-in tool is left out and named: what the X-Kvwake-Omitted-Tools header says.
    kept = ResponsesRequest.parse({"model": "m", "input": "x", "tools": [{"type": "web_search"}, member]}, None)
    assert kept.offered.omitted == ["web_search"] and [t["name"] for t in kept.offered.echo] == ["close_agent"]
    with pytest.raises(ApiError) as bad:
        ResponsesRequest.parse({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                                                         "arguments": "{}", "namespace": 3}]}, None)
    assert bad.value.param == "input[0].namespace"


def test_input_items_list_a_chains_items_in_openais_shape(omitting):
    api = openai_client(omitting)
    first = api.responses.create(model="m", input=[{"role": "developer", "content": "Be brief."},
                                                   {"role": "user", "content": "Close agent 7"}],
                                 tools=[AGENTS], temperature=0, max_output_tokens=20)
    answer = [{"type": "function_call_output", "call_id": first.output[0].call_id, "output": "closed"}]
    second = api.responses.create(model="m", input=answer, tools=[AGENTS], temperature=0, max_output_tokens=20,
                                  previous_response_id=first.id)
    assert second.output_text == "Closed it."
    page = api.responses.input_items.list(second.id)  # newest first, as OpenAI's default
    kinds = [(i.type, getattr(i, "role", None)) for i in page.data]
    assert kinds == [("function_call_output", None), ("function_call", None), ("message", "user"),
                     ("message", "developer")] and page.has_more is False
    assert page.data[1].namespace == "multi_agent_v1" and page.data[1].id == first.output[0].id
    assert page.data[2].content[0].type == "input_text" and page.data[2].content[0].text == "Close agent 7"
    assert page.first_id == page.data[0].id and page.last_id == page.data[-1].id
    ids = [i.id for i in page.data]
    assert len(set(ids)) == 4 and all(ids)
    # Ascending, a page at a time: the SDK follows `after` through the pages.
    pages = api.responses.input_items.list(second.id, order="asc", limit=1)
    assert len(pages.data) == 1 and pages.has_more is True
    assert [i.id for i in pages] == ids[::-1]  # every page, iterated
    after = api.responses.input_items.list(second.id, order="asc", after=ids[-1], limit=2)
    assert [i.id for i in after.data] == ids[::-1][1:3] and after.has_more is True
    # Each item validates as the SDK's own ResponseItem; the first response lists its own input only.
    config = openai_config(omitting.socket)
    status, raw = get(f"{config['base_url']}/responses/{first.id}/input_items",
                      {"Authorization": f"Bearer {config['api_key']}"})
    assert status == 200 and raw["object"] == "list" and len(raw["data"]) == 2
    for item in raw["data"]:
        TypeAdapter(ResponseItem).validate_python(item)
    for query, param in (("order=up", "order"), ("limit=0", "limit"), ("limit=101", "limit"), ("after=x", "after")):
        status, raw = get(f"{config['base_url']}/responses/{first.id}/input_items?{query}",
                          {"Authorization": f"Bearer {config['api_key']}"})
        assert status == 400 and raw["error"]["param"] == param, query
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list("resp_unknown")


def test_a_record_stored_before_input_items_were_kept_still_reads(store):
    """Records written before input items were kept hold the bare response object: read, with no items."""
    from types import SimpleNamespace

    from anyio import run

    from kvwake.daemon.sessions.responses import ResponseRecord, ResponseRecords

    records = ResponseRecords(SimpleNamespace(store=store))
    old = {"id": "resp_old", "object": "response", "output": []}
    store.responses.put("resp_old", "s", 3, [{"role": "user", "content": "hi"}], old)
    got = run(records.get, "resp_old")
    assert got.response == old and got.input_items is None and got.position == 3
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    run(records.put, ResponseRecord("resp_new", "s", 5, [], {**old, "id": "resp_new"}, items))
    new = run(records.get, "resp_new")
    assert new.response["id"] == "resp_new" and new.input_items == items


def test_the_hosted_tools_setting_takes_refuse_or_omit_only(tmp_path):
    from kvwake.daemon.config import load_settings

    none = tmp_path / "none.toml"
    assert load_settings({}, none).http_hosted_tools == "omit"
    assert load_settings({"http_hosted_tools": "refuse"}, none).http_hosted_tools == "refuse"
    with pytest.raises(ValueError, match="http_hosted_tools must be \"refuse\" or \"omit\", not 'drop'"):
        load_settings({"http_hosted_tools": "drop"}, none)
