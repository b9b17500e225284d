"""Structured output by constrained decoding (model/grammar.py, masks.py), in the engine and through a real daemon.

A random-weight tiny model writes whatever its weights say; under a schema every
reply must still validate (checked with `jsonschema`), alone and batched beside
unconstrained calls. Through the daemon: OpenAI's response_format and forced
tool_choice with the `openai` package, Anthropic's tool_choice any/tool with
`anthropic`, and the RPC params, including refusals before any compute.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from kvwake.client import AsyncClient, Client, openai_config
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams, TextOutput
from kvwake.daemon.model.grammar import Structure
from kvwake.daemon.session_state import Session
from kvwake.errors import InvalidParamsError
from kvwake.store import Store
from testkit.daemon import RpcError, serving_http
from testkit.tinymodel import TOOLS_CHATML, make_model_dir

SHORT = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "flat object": {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer"}},
                    "required": ["name", "age"], "additionalProperties": False},
    "nested objects": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "address": {"type": "object", "properties": {"city": SHORT},
                                                              "required": ["city"], "additionalProperties": False}},
                 "required": ["id", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "bounded array": {"type": "object", "properties": {"tags": {"type": "array", "items": SHORT,
                                                                  "minItems": 2, "maxItems": 4}},
                      "required": ["tags"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                                                 "count": {"type": "integer", "minimum": -5, "maximum": 500}},
                "required": ["ratio", "count"], "additionalProperties": False},
    "bounded string": {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 5},
                                                        "word": {"type": "string", "pattern": "^[a-z]{2,4}$"}},
                       "required": ["code", "word"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                    {"type": "boolean"}, SHORT]}},
              "required": ["value"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 4},
                                                  "score": {"anyOf": [{"type": "integer", "maximum": 10,
                                                                       "minimum": 0}, {"type": "null"}]}},
                 "required": ["note", "score"], "additionalProperties": False},
    "array of objects": {"type": "array", "items": {"type": "object", "properties": {"k": SHORT,
                                                                                      "v": {"type": "boolean"}},
                                                    "required": ["k", "v"], "additionalProperties": False},
                         "minItems": 1, "maxItems": 3},
    "const and booleans": {"type": "object", "properties": {"kind": {"const": "event"}, "ok": {"type": "boolean"},
                                                            "flags": {"type": "array", "items": {"type": "boolean"},
                                                                      "maxItems": 3}},
                           "required": ["kind", "ok", "flags"], "additionalProperties": False},
    "optional properties": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                             "b": SHORT}, "required": ["a"],
                            "additionalProperties": False},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": SHORT, "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """A random tiny llama whose template renders tools and names the json_tools call format."""
    return make_model_dir(tmp_path_factory.mktemp("models") / "tools-llama", template=TOOLS_CHATML)


@pytest.fixture(scope="module")
def engine(tools_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    store = Store(root / "store", block_tokens=16)
    e = Engine(store, root, tools_model, max_batch=8)
    yield e
    e.close()
    store.close()


@pytest.fixture(scope="module")
def merging(tools_model, tmp_path_factory):
    """`engine` with its KV out of pages whatever the default: for a long row leaving a merged batch for its
    padding, which a batch over pages does not have (docs/decisions.md, "Paged KV in the fleet, again")."""
    from kvwake.daemon.config import Tuning

    root = tmp_path_factory.mktemp("merging")
    store = Store(root / "store", block_tokens=16)
    e = Engine(store, root, tools_model, max_batch=8, tuning=Tuning(paged_kv=False))
    yield e
    e.close()
    store.close()


def params(structure: Structure | None, seed: int, **more) -> GenerateParams:
    return GenerateParams(**{"max_tokens": 160, "temperature": 1.0, "seed": seed, "structure": structure, **more})


def generate(engine: Engine, text: str, p: GenerateParams, tools=None):
    s = Session(f"s{id(p)}")
    engine.append(s, messages=[{"role": "user", "content": text}], tools=tools)
    return engine.generate(s, p)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_reply_under_a_schema_validates(engine, name):
    schema = SCHEMAS[name]
    for seed in range(3):
        result = generate(engine, f"answer as {name}", params(Structure.json(schema), seed))
        assert result.finish_reason == "stop", (result.text, result.finish_reason)
        jsonschema.validate(json.loads(result.text), schema)


def test_constrained_and_free_calls_share_one_batch_and_each_validates(engine):
    names = sorted(SCHEMAS)[:4]
    calls = []
    for i in range(8):
        s = Session(f"batch{i}")
        engine.append(s, messages=[{"role": "user", "content": f"call {i} " * (i + 1)}])
        structure = Structure.json(SCHEMAS[names[i // 2]]) if i % 2 == 0 else None
        calls.append(engine.start_call(s, params(structure, i, max_tokens=120)))
    seen_before = engine.decoder.counters["max_batch_seen"]
    engine.decoder.counters["max_batch_seen"] = 0
    for call in calls:
        engine.decoder.join(call)
    while engine.decoder.active:
        engine.decoder.step()
    assert engine.decoder.counters["max_batch_seen"] == 8  # all eight in one forward pass
    engine.decoder.counters["max_batch_seen"] = max(seen_before, 8)
    for i, call in enumerate(calls):
        result = call.future.result()
        if i % 2 == 0:
            assert result.finish_reason == "stop"
            jsonschema.validate(json.loads(result.text), SCHEMAS[names[i // 2]])
    assert engine.decoder.status()["mask_fills"] > 0


def test_a_call_cut_by_max_tokens_or_a_stop_string_finishes_length(engine):
    schema = SCHEMAS["array of objects"]
    cut = generate(engine, "cut", params(Structure.json(schema), 1, max_tokens=5))
    assert cut.finish_reason == "length" and len(cut.tokens) == 5
    with pytest.raises(ValueError):
        json.loads(cut.text)
    stopped = generate(engine, "stop", params(Structure.json(schema), 1, stop=('"k"',)))
    assert stopped.finish_reason == "length" and stopped.stop_sequence == '"k"' and stopped.text == "[{"


def test_a_lark_grammar_constrains_the_text(engine):
    grammar = 'start: "answer: " ("yes" | "no") "." /[0-9]{2}/'
    for seed in range(3):
        result = generate(engine, "lark", params(Structure("lark", grammar), seed))
        assert result.finish_reason == "stop"
        assert result.text[:8] == "answer: " and result.text[8:].split(".")[0] in ("yes", "no")
        assert result.text.split(".")[1].isdigit() and len(result.text.split(".")[1]) == 2


def test_a_forced_tool_call_parses_and_its_arguments_validate(engine):
    tools = [WEATHER, TIME]
    for seed in range(3):
        named = generate(engine, "weather?", params(Structure("tool_call", "get_time", one=True), seed), tools)
        assert named.finish_reason == "tool_calls" and named.tool_call_errors == []
        assert [c["function"]["name"] for c in named.tool_calls] == ["get_time"]
        jsonschema.validate(json.loads(named.tool_calls[0]["function"]["arguments"]), TIME["function"]["parameters"])
        anyone = generate(engine, "anything", params(Structure("tool_call", one=True), seed + 10), tools)
        assert anyone.finish_reason == "tool_calls" and anyone.tool_calls
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        for call in anyone.tool_calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_a_model_loaded_on_demand_builds_llguidances_tokenizer_at_its_first_structure_once(tools_model, tmp_path,
                                                                                          engine, monkeypatch):
    """Any model but the daemon's first loads with `eager_grammars` off (model/loader.py): llguidance's tokenizer,
    whose build holds the GIL for 0.2 s and more, is not built in the load, where another model decodes. The
    first structure builds it, once among threads, and constrains as the eager engine does."""
    import threading

    from kvwake.daemon.model import grammar

    store = Store(tmp_path / "store", block_tokens=16)
    lazy = Engine(store, tmp_path, tools_model, max_batch=8, eager_grammars=False)
    built, real = [], grammar.llg.LLTokenizer
    monkeypatch.setattr(grammar.llg, "LLTokenizer", lambda *a, **k: built.append(1) or real(*a, **k))
    try:
        assert not lazy.grammars.built and engine.grammars.built
        tools = [WEATHER, TIME]
        forced = params(Structure("tool_call", "get_time", one=True), 4)
        schema = params(Structure.json(SCHEMAS["enum"]), 5)
        got = [generate(lazy, "weather?", forced, tools), generate(lazy, "json", schema)]
        assert lazy.grammars.built and built == [1]
        eager = [generate(engine, "weather?", forced, tools), generate(engine, "json", schema)]
        assert [(r.tokens, [c["function"] for c in r.tool_calls]) for r in got] == [
            (r.tokens, [c["function"] for c in r.tool_calls]) for r in eager]
        assert got[0].tool_calls and got[0].finish_reason == "tool_calls"
        # threads asking at once, a build slow enough for all four to ask during it: one build, one object
        import time

        monkeypatch.setattr(grammar.llg, "LLTokenizer", lambda *a, **k: built.append(1) or time.sleep(0.2) or object())
        fresh, gate, got_back = grammar.Grammars(lazy.tokenizer, lazy.kv.vocab_size, eager=False), threading.Barrier(4), []

        def ask() -> None:
            gate.wait()
            got_back.append(fresh.tokenizer)

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert built == [1, 1] and len(got_back) == 4 and len({id(x) for x in got_back}) == 1
    finally:
        lazy.close()
        store.close()


def test_required_may_make_several_calls_each_valid(engine):
    result = generate(engine, "several", params(Structure("tool_call"), 7, max_tokens=300), [WEATHER, TIME])
    # A random model may go on calling until max_tokens: then only the last call, cut, fails to parse.
    assert len(result.tool_calls) >= 2
    assert result.tool_call_errors == [] if result.finish_reason == "tool_calls" else \
        (result.finish_reason == "length" and len(result.tool_call_errors) <= 1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in result.tool_calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_json_or_a_tool_call_when_tools_are_offered(engine):
    schema = SCHEMAS["enum"]
    kinds = set()
    for seed in range(6):
        result = generate(engine, "either", params(Structure.json(schema, or_tools=True, one=True), seed),
                          [WEATHER])
        assert result.finish_reason in ("stop", "tool_calls") and result.tool_call_errors == []
        if result.tool_calls:
            kinds.add("call")
            jsonschema.validate(json.loads(result.tool_calls[0]["function"]["arguments"]),
                                WEATHER["function"]["parameters"])
        else:
            kinds.add("json")
            jsonschema.validate(json.loads(result.text), schema)
    assert kinds  # which one a random model picks is its own affair; each must be valid


def test_bad_schemas_and_grammars_are_refused_naming_the_problem(engine):
    cases = [(Structure.json({"type": "object", "properties": {"a": {"type": "integr"}}}), "integr"),
             (Structure("lark", "start: undefined_rule"), "undefined_rule"),
             (Structure("tool_call", "nope"), "nope")]
    for structure, named in cases:
        with pytest.raises(InvalidParamsError, match=named):
            engine.check_structure(params(structure, 0), [WEATHER])
    with pytest.raises(InvalidParamsError, match="no tools"):
        engine.check_structure(params(Structure("tool_call"), 0), None)


def test_compiled_grammars_are_kept_by_schema(engine):
    before = dict(engine.grammars.counters)
    schema = {"type": "object", "properties": {"fresh": {"type": "integer"}}, "required": ["fresh"]}
    for _ in range(3):
        engine.check_structure(params(Structure.json(schema), 0), None)
    assert engine.grammars.counters["grammar_compiles"] == before["grammar_compiles"] + 1
    assert engine.grammars.counters["grammar_cache_hits"] == before["grammar_cache_hits"] + 2


def test_a_model_logits_wider_than_its_tokenizer_get_a_padded_mask(tmp_path):
    wide = make_model_dir(tmp_path / "wide-vocab", vocab_size=300)  # 41 logits no token has
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, wide, max_batch=4)
    try:
        schema = SCHEMAS["enum"]
        for seed in range(3):
            result = generate(e, "wide", params(Structure.json(schema), seed))
            assert max(result.tokens) < 259
            jsonschema.validate(json.loads(result.text), schema)
    finally:
        e.close()
        store.close()


# -- through a real daemon ------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tools_model):
    yield from serving_http(tmp_path_factory.mktemp("structured"), tools_model)


@pytest.fixture(scope="module")
def api(daemon):
    with openai.OpenAI(**openai_config(daemon.socket), max_retries=0, timeout=120) as client:
        yield client


def test_openai_response_format_json_schema_and_json_object(api):
    schema = SCHEMAS["nested objects"]
    for strict in (True, False):
        reply = api.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "who?"}], max_tokens=160, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "who", "schema": schema, "strict": strict}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    reply = api.chat.completions.create(model="any", messages=[{"role": "user", "content": "obj"}], max_tokens=200,
                                        seed=4, response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":  # an unbounded object may run to max_tokens: then it is cut
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].finish_reason == "length"


def test_openai_completions_take_a_response_format_too(api):
    schema = SCHEMAS["enum"]
    reply = api.completions.create(model="any", prompt="Pick: ", max_tokens=80, seed=2, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), schema)


def test_openai_streamed_json_joins_to_valid_json(api):
    schema = SCHEMAS["bounded array"]
    stream = api.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "tags"}], max_tokens=160, seed=5, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "tags", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_openai_forced_tool_choice_gives_a_parsed_valid_call(api):
    messages = [{"role": "user", "content": "time in Paris?"}]
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "get_weather"}},
                                              "get_weather")):
        reply = api.chat.completions.create(model="any", messages=messages, max_tokens=160, seed=6,
                                            tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and calls
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        assert name is None or calls[0].function.name == name
        jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])


def test_openai_refusals_name_the_problem(api, daemon):
    with daemon.client() as c:
        before = c.call("status")["counters"]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "integr"}}}}}
    with pytest.raises(openai.BadRequestError, match="integr") as err:
        api.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}], response_format=bad)
    assert err.value.body["param"] == "response_format.json_schema.schema"  # the field, whole
    with pytest.raises(openai.BadRequestError, match="no tools were given"):
        api.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}], tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="response_format.type"):
        api.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}],
                                    response_format={"type": "yaml"})
    with daemon.client() as c:
        after = c.call("status")["counters"]
    # refused before any compute: nothing was prefilled, no generation ran
    assert after["tokens_prefilled"] == before["tokens_prefilled"] and after["generations"] == before["generations"]


def test_openai_max_tokens_cut_is_length(api):
    reply = api.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "cut"}], max_tokens=4, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS["array of objects"]}})
    assert reply.choices[0].finish_reason == "length"


def test_anthropic_tool_choice_any_and_tool_and_output_format(daemon):
    config = openai_config(daemon.socket)
    with anthropic.Anthropic(base_url=config["base_url"].removesuffix("/v1"), api_key=config["api_key"],
                             max_retries=0) as client:
        anthropic_tool_choices(client)


def anthropic_tool_choices(client: anthropic.Anthropic) -> None:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        message = client.messages.create(model="any", max_tokens=160, tools=tools, tool_choice=choice,
                                         messages=[{"role": "user", "content": "now?"}])
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and uses
        assert choice["type"] == "any" or uses[0].name == "get_time"
        jsonschema.validate(uses[0].input, {t["name"]: t["input_schema"] for t in tools}[uses[0].name])
    schema = SCHEMAS["enum"]
    message = client.messages.create(model="any", max_tokens=160, messages=[{"role": "user", "content": "pick"}],
                                     extra_body={"output_config": {"format": {"type": "json_schema",
                                                                              "schema": schema}}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_rpc_json_schema_grammar_and_tool_choice(daemon):
    with daemon.client() as c:
        c.call("session.create", session_id="rpc-structured")
        schema = SCHEMAS["numbers"]
        r = c.call("session.chat", session_id="rpc-structured", messages=[{"role": "user", "content": "n"}],
                   json_schema=schema, max_tokens=160, temperature=1.0, seed=2)
        assert r["finish_reason"] == "stop"
        jsonschema.validate(json.loads(r["text"]), schema)
        c.call("session.create", session_id="rpc-raw")
        c.call("session.append", session_id="rpc-raw", text="count: ")
        r = c.call("session.generate", session_id="rpc-raw", grammar='start: "x=" /[0-9]{3}/',
                   max_tokens=40, temperature=1.0, seed=2)
        assert r["text"].startswith("x=") and len(r["text"]) == 5 and r["text"][2:].isdigit()
        r = c.call("session.chat", session_id="rpc-structured", messages=[{"role": "user", "content": "t"}],
                   tools=[WEATHER, TIME], tool_choice={"name": "get_weather"}, max_tokens=160, seed=2,
                   temperature=1.0)
        assert [t["function"]["name"] for t in r["tool_calls"]] == ["get_weather"]
        tokens = c.call("session.info", session_id="rpc-structured")["tokens"]
        for bad, named in (({"json_schema": {"type": "integr"}}, "integr"), ({"grammar": "start: nope"}, "nope"),
                           ({"tool_choice": "sometimes"}, "tool_choice"),
                           ({"json_schema": {"type": "object"}, "grammar": "start: \"a\""}, "at most one")):
            with pytest.raises(RpcError, match=named) as err:
                c.call("session.chat", session_id="rpc-structured", messages=[{"role": "user", "content": "z"}],
                       max_tokens=8, **bad)
            assert err.value.code == "INVALID_PARAMS"
        assert c.call("session.info", session_id="rpc-structured")["tokens"] == tokens  # nothing appended


def test_python_clients_take_a_schema_a_pydantic_model_and_a_tool_name(daemon):
    import pydantic

    class City(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")  # else extra keys are valid, and a random model adds them
        name: str = pydantic.Field(max_length=6)
        population: int = pydantic.Field(ge=0, le=1000)

    with Client(daemon.socket) as client:
        s = client.session("py-structured")
        reply = s.chat("a city", json_schema=City, max_tokens=160, temperature=1.0, seed=1)
        assert reply.finish_reason == "stop", reply.text
        City.model_validate_json(reply.text)
        call = s.chat("weather", tools=[WEATHER, TIME], tool_choice="get_time", max_tokens=160, temperature=1.0,
                      seed=1)
        assert [c["function"]["name"] for c in call.tool_calls] == ["get_time"]


async def test_the_async_client_takes_a_grammar(daemon):
    async with AsyncClient(daemon.socket) as ac:
        s = await ac.session("py-async-structured")
        await s.append(text="pick: ")
        reply = await s.generate(grammar='start: "yes" | "no"', max_tokens=8, temperature=1.0, seed=3)
        assert reply.text in ("yes", "no") and reply.finish_reason == "stop"


def test_a_constrained_call_that_starts_alone_and_joins_the_batch_stays_valid(engine):
    schema = SCHEMAS["nested objects"]
    for steps_alone in (1, 5, 12):
        first = Session(f"alone-{steps_alone}")
        engine.append(first, messages=[{"role": "user", "content": "first"}])
        a = engine.start_call(first, params(Structure.json(schema), steps_alone))
        engine.decoder.join(a)
        for _ in range(steps_alone):
            engine.decoder.step()
        assert a.solo is not None or a.future.done()  # decoding alone (solo), not batched
        second = Session(f"joins-{steps_alone}")
        engine.append(second, messages=[{"role": "user", "content": "second"}])
        b = engine.start_call(second, params(Structure.json(SCHEMAS["enum"]), steps_alone))
        engine.decoder.join(b)
        while engine.decoder.active:
            engine.decoder.step()
        jsonschema.validate(json.loads(a.future.result().text), schema)
        jsonschema.validate(json.loads(b.future.result().text), SCHEMAS["enum"])


def run_staggered(engine: Engine, tag: str) -> list[list[int]]:
    """Eight calls, four constrained, joining at staggered steps (one alone first) and leaving at
    different lengths: every path a mask can take (ahead, after a join, after a leave, solo into batch)."""
    names = sorted(SCHEMAS)
    calls = []
    for i in range(8):
        s = Session(f"{tag}{i}")
        engine.append(s, messages=[{"role": "user", "content": f"staggered {i} " * (i % 3 + 1)}])
        structure = Structure.json(SCHEMAS[names[i]]) if i % 2 == 0 else None
        calls.append(engine.start_call(s, params(structure, 40 + i, max_tokens=20 + 15 * i)))
    for step, call in enumerate(calls):
        engine.decoder.join(call)
        for _ in range(step % 3):
            engine.decoder.step()
    while engine.decoder.active:
        engine.decoder.step()
    results = [call.future.result() for call in calls]
    for i, result in enumerate(results):
        if i % 2 == 0 and result.finish_reason == "stop":
            jsonschema.validate(json.loads(result.text), SCHEMAS[names[i]])
    return [result.tokens for result in results]


@pytest.mark.parametrize("max_batch", [8, 1])
def test_masks_filled_ahead_give_the_tokens_of_masks_filled_in_the_pass(tools_model, tmp_path, max_batch):
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, tools_model, max_batch=max_batch)
    try:
        masks = e.decoder.masks
        masks.ahead_enabled = False
        serial = run_staggered(e, "serial")
        assert masks.timing["ready"] == 0
        masks.ahead_enabled = True
        passes = masks.timing["passes"]
        ahead = run_staggered(e, "ahead")
        assert ahead == serial
        ready = masks.timing["ready"]
        assert ready > 0.8 * (masks.timing["passes"] - passes), masks.timing  # most passes found their mask ready
        assert not masks._ahead  # nothing left waiting
    finally:
        e.close()
        store.close()


def test_solo_decoding_is_constrained_too(tools_model, tmp_path):
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, tools_model, max_batch=1)
    try:
        assert e.decode_mode == "solo"
        for name in ("bounded array", "anyOf"):
            result = generate(e, name, params(Structure.json(SCHEMAS[name]), 4))
            jsonschema.validate(json.loads(result.text), SCHEMAS[name])
    finally:
        e.close()
        store.close()


def test_every_eos_id_ends_a_reply_where_the_grammar_accepts_and_none_before(tmp_path):
    two = make_model_dir(tmp_path / "two-eos", eos_token_id=[256, 258])  # <|endoftext|> and <|im_end|>
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, two, max_batch=2)
    try:
        assert set(e.tokenizer.eos_token_ids) == {256, 258}
        c = e.constraint(params(Structure.json({"enum": ["ab"]}), 0), None)
        c.feed(0)  # the prompt's last token: not the grammar's
        allowed = lambda: {t for t in (ord("a"), ord("b"), ord('"'), 256, 258)  # noqa: E731
                           if e.decoder.masks.fill([c])[0, t // 32] >> (t % 32) & 1}
        assert allowed() == {ord('"')}
        for t in b'"ab"':
            c.feed(t)
        assert allowed() == {256, 258} and c.accepting
        c.feed(256)  # the other EOS id is fed as llguidance's one
        assert c.error is None and c.matcher.is_stopped()
    finally:
        e.close()
        store.close()


MISTRAL_TEMPLATE = (  # mlx-lm names the mistral tool parser from "[TOOL_CALLS]" in a template
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_forced_call_in_the_mistral_format_parses_and_validates(tmp_path):
    model = make_model_dir(tmp_path / "mistral-tools", template=MISTRAL_TEMPLATE, added=("[TOOL_CALLS]", "[ARGS]"))
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, model, max_batch=2)
    try:
        assert e.grammars.tools.name == "mistral"
        for seed in range(3):
            result = generate(e, "call", params(Structure("tool_call", "get_weather", one=True), seed), [WEATHER, TIME])
            assert result.text.startswith("[TOOL_CALLS]get_weather[ARGS]{")
            assert result.finish_reason == "tool_calls" and result.tool_call_errors == [], result.text
            jsonschema.validate(json.loads(result.tool_calls[0]["function"]["arguments"]),
                                WEATHER["function"]["parameters"])
    finally:
        e.close()
        store.close()


def test_a_thinking_model_may_think_before_its_forced_call(engine):
    from types import SimpleNamespace

    import llguidance
    from mlx_lm.tool_parsers import json_tools

    from kvwake.daemon.model.grammar import ToolFormat

    thinker = SimpleNamespace(has_tool_calling=True, tool_parser=json_tools.parse_tool_call,
                              tool_call_start="<tool_call>", tool_call_end="</tool_call>", has_thinking=True,
                              think_start="<think>", think_end="</think>", vocab={}, all_special_tokens=[])
    tools = ToolFormat(thinker)
    llt = engine.grammars.tokenizer
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo","unit":"C"}}</tool_call>'
    cases = [(False, "<think>rain?\nmaybe</think>\n\n" + call, True), (False, call, True),
             (False, "<think>no call</think>", False), (False, "cold, so</think>" + call, False),
             (True, "cold, so</think>\n" + call, True), (True, call, False)]  # True: the prompt opened <think>
    for opened, text, whole in cases:
        lark = tools.lark([WEATHER], "get_weather", True, thinking=opened)
        m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        assert not m.is_error(), m.get_error()
        ok = m.consume_tokens(llt.tokenize_str(text))
        assert (ok and m.is_accepting()) == whole, (text, m.get_error())


def test_a_forced_call_closes_the_thought_its_prompt_opened(tmp_path):
    template = TOOLS_CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")
    # The markers are added tokens, as in Qwen's vocabulary: llguidance matches them only as those tokens.
    model = make_model_dir(tmp_path / "thinker", template=template,
                           added=("<think>", "</think>", "<tool_call>", "</tool_call>"))
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, model, max_batch=2)
    try:
        assert e.grammars.tools.think == ("<think>", "</think>")
        result = generate(e, "think, then call", params(Structure("tool_call", "get_time", one=True), 0,
                                                        max_tokens=1500), [WEATHER, TIME])
        thought, _, rest = result.text.partition("</think>")
        assert rest and "<think>" not in thought and result.finish_reason == "tool_calls"
        assert {e.tokenizer.vocab[t] for t in ("</think>", "<tool_call>", "</tool_call>")} <= set(result.tokens)
        jsonschema.validate(json.loads(result.tool_calls[0]["function"]["arguments"]), TIME["function"]["parameters"])
    finally:
        e.close()
        store.close()


def test_a_failed_matcher_ends_its_call_at_once_and_fails_it_naming_the_error(engine):
    from kvwake.daemon.model.decode_calls import Call
    from kvwake.errors import InternalError

    c = engine.constraint(params(Structure.json({"enum": ["ab"]}), 0), None)
    c.feed(0)  # the prompt's token
    c.feed(ord("x"))  # a token the mask would never have allowed (the grammar wants '"')
    assert c.error
    row = engine.decoder.masks.fill([c])[0]
    eos = engine.grammars.eos
    assert [t for t in range(engine.vocab_size) if row[t // 32] >> (t % 32) & 1] == [eos]  # only EOS
    s = Session("failed-matcher")
    engine.append(s, messages=[{"role": "user", "content": "x"}])
    call = Call(s, s.tokens[-1], TextOutput(engine.tokenizer, params(None, 0)), 1, constraint=c)
    call.finish("stop")
    with pytest.raises(InternalError, match="constrained decoding failed in session failed-matcher"):
        call.future.result()


def test_a_json_reply_on_a_thinking_model_closes_its_thought_and_the_content_validates(tmp_path):
    template = TOOLS_CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")
    model = make_model_dir(tmp_path / "thinker", template=template, added=("<think>", "</think>"))
    store = Store(tmp_path / "store", block_tokens=16)
    e = Engine(store, tmp_path, model, max_batch=2)
    try:
        schema = SCHEMAS["enum"]
        result = generate(e, "think, then answer", params(Structure.json(schema), 0, max_tokens=1500), None)
        assert e.tokenizer.vocab["</think>"] in result.tokens and result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.content), schema)  # the thought is reasoning, not content
        assert "</think>" not in result.content and result.text.endswith(result.content)
    finally:
        e.close()
        store.close()


def two_then_five(engine, monkeypatch, tag: str, constrained: int) -> list:
    """A long call (400 tokens) and a short one decode batched for 4 steps; then five short calls join, which
    would pad the batch more than their tokens (PAD_SLACK lowered to 64). The first `constrained` calls
    are constrained (the nested-objects schema). Returns the calls, after that joining step."""
    from kvwake.daemon.model import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "PAD_SLACK", 64)
    sessions = []
    for i, text in enumerate(["a long question " * 30, "short"] + [f"q{i}" for i in range(5)]):
        s = Session(f"{tag}{i}")
        engine.append(s, messages=[{"role": "user", "content": text}])
        sessions.append(s)
    calls = [engine.start_call(s, params(Structure.json(SCHEMAS["nested objects"]) if i < constrained else None,
                                         20 + i, **({} if i < constrained else {"max_tokens": 30})))
             for i, s in enumerate(sessions)]
    for call in calls[:2]:
        engine.decoder.join(call)
    for _ in range(4):
        engine.decoder.step()
    for call in calls[2:]:
        engine.decoder.join(call)
    engine.decoder.step()
    return calls


def finish_valid(engine, calls: list) -> None:
    while engine.decoder.active:
        engine.decoder.step()
    for call in calls:
        result = call.future.result()
        assert result.finish_reason == "stop", (result.text, result.finish_reason)
        jsonschema.validate(json.loads(result.text), SCHEMAS["nested objects"])


def test_a_constrained_row_that_leaves_the_batch_for_its_length_stays_valid(merging, monkeypatch):
    engine = merging
    """The long constrained call goes on alone when the short calls join: its grammar state moves with it
    (decoder._evict)."""
    calls = two_then_five(engine, monkeypatch, "evict", constrained=1)
    assert calls[0].solo is not None or calls[0].future.done()  # alone now
    finish_valid(engine, calls[:1])


def test_a_long_row_leaves_the_batch_beside_another_constrained_row_and_both_stay_valid(merging, monkeypatch):
    engine = merging
    """A long constrained row is taken out of the batch while another constrained row decodes in it: their
    next masks were being filled together (Masks.prefetch), and the row that stays is fed its token once
    (it was fed twice, a grammar error, before the masks remembered what work settled elsewhere fed)."""
    calls = two_then_five(engine, monkeypatch, "stay", constrained=2)
    assert calls[0].solo is not None or calls[0].future.done()  # alone now
    assert calls[1].solo is None  # still batched
    finish_valid(engine, calls[:2])
