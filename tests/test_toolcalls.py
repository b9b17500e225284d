"""Tool calls in generated text (daemon/model/toolcalls.py through TextOutput): spans, parsing, streamed events.

Tokens are fed to a real `TextOutput` with a real mlx-lm tokenizer: a byte-level
one whose template makes mlx-lm pick the json_tools parser (TOOLS_CHATML), so
the markers arrive one byte at a time and every split of them is exercised;
one without a tool-call format (CHATML); and the scripted model's (markers as
whole tokens). The engine and the daemon are tested with the scripted model in
test_tools_daemon.py.
"""

from __future__ import annotations

import json

import pytest
from mlx_lm.utils import load_tokenizer

from kvwake.daemon.model.generation import GenerateParams, TextOutput
from testkit.tinymodel import CHATML, TOOLS_CHATML, WEATHER_CALL, make_model_dir, write_tokenizer

CALL = f"<tool_call>{WEATHER_CALL}</tool_call>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """{"tools": json_tools tokenizer, "plain": no tool-call format}."""
    made = {}
    for name, template in (("tools", TOOLS_CHATML), ("plain", CHATML)):
        path = tmp_path_factory.mktemp(name)
        write_tokenizer(path, template)
        (path / "config.json").write_text("{}")
        made[name] = load_tokenizer(path)
    return made


def run(tok, text: str, *, eos: bool = True, should_stop=None, **params):
    """Feed `text`'s tokens (then EOS) to a TextOutput; (finish reason, result, events)."""
    events: list[dict] = []
    out = TextOutput(tok, GenerateParams(**params), events.append, should_stop, TOOLS)
    reason = None
    for t in [*tok.encode(text, add_special_tokens=False), *([tok.eos_token_id] if eos else [])]:
        reason = out.add(t)
        if reason is not None:
            break
    result = out.result(reason, 0)
    assert "".join(e.get("text", "") for e in events) == result.text  # the streamed text is the text
    return reason, result, events


def tool_text(events: list[dict]) -> str:
    return "".join(e["text"] for e in events if e.get("tool"))


def content_text(events: list[dict]) -> str:
    return "".join(e["text"] for e in events if "text" in e and not e.get("tool") and not e.get("thinking"))


def test_a_call_between_content_is_parsed_and_its_pieces_are_marked(tokenizers):
    reason, r, events = run(tokenizers["tools"], f"Sure. {CALL} Done.")
    assert reason == "stop" and r.finish_reason == "tool_calls"
    assert r.text == f"Sure. {CALL} Done." and r.content == "Sure.  Done."
    (call,) = r.tool_calls
    assert call["id"].startswith("call_") and len(call["id"]) > 10 and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert tool_text(events) == CALL and content_text(events) == r.content and r.tool_call_errors == []
    (ev,) = [e for e in events if "tool_call" in e]
    assert ev == {"tool_call": call, "index": 0}
    at = events.index(ev)  # right after the span's last byte, before the content that follows
    assert tool_text(events[:at]) == CALL and content_text(events[at:]) == " Done."


def test_text_that_only_begins_like_a_marker_stays_content(tokenizers):
    reason, r, events = run(tokenizers["tools"], "a <tool b <tool_cal x <")
    assert r.finish_reason == "stop" and r.content == r.text and r.tool_calls == []
    assert not any(e.get("tool") for e in events)


def test_a_call_cut_by_max_tokens_is_an_error_not_a_call(tokenizers):
    text = f"Hi {CALL}"
    reason, r, events = run(tokenizers["tools"], text, eos=False, max_tokens=len(text.encode()) - 5)
    assert r.finish_reason == "length" and r.tool_calls == [] and r.content == r.text
    (error,) = r.tool_call_errors
    assert "json_tools" in error and "cut off (length)" in error and "<tool_call>{" in error
    assert tool_text(events) == r.text[3:]  # streamed as tool text before it was known to be cut


def test_invalid_json_in_a_closed_span_is_an_error_and_stays_content(tokenizers):
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'
    reason, r, events = run(tokenizers["tools"], f"x{bad}{CALL}")
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1  # the good one after it still counts
    assert r.content == f"x{bad}" and "JSONDecodeError" in r.tool_call_errors[0] and "json_tools" in r.tool_call_errors[0]
    assert [e["index"] for e in events if "tool_call" in e] == [0]


def test_a_span_with_a_list_gives_calls_in_order(tokenizers):
    two = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"n": 1}}]'
    _, r, events = run(tokenizers["tools"], f"<tool_call>{two}</tool_call>")
    assert [c["function"]["name"] for c in r.tool_calls] == ["a", "b"] and r.content == ""
    assert [(e["index"], e["tool_call"]["function"]["name"]) for e in events if "tool_call" in e] == [(0, "a"), (1, "b")]
    assert r.tool_calls[0]["id"] != r.tool_calls[1]["id"] and r.tool_calls[1]["function"]["arguments"] == '{"n": 1}'


def test_a_stop_string_ends_the_text_before_or_inside_a_call(tokenizers):
    _, r, events = run(tokenizers["tools"], f"Hi{CALL}END more", stop=("END",))
    assert r.text == f"Hi{CALL}" and r.finish_reason == "tool_calls" and r.content == "Hi"
    # Cut inside the span (stop at its end marker): the reply stopped on its own, the body is whole.
    _, r, events = run(tokenizers["tools"], f"Hi{CALL} more", stop=("</tool",))
    assert r.text == f"Hi<tool_call>{WEATHER_CALL}" and r.finish_reason == "tool_calls" and r.content == "Hi"
    # A stop string that begins like the start marker is held back for both reasons, then released.
    _, r, events = run(tokenizers["tools"], "a <toolbox b", stop=("<toolbx",))
    assert r.text == r.content == "a <toolbox b" and not any(e.get("tool") for e in events)


def test_a_cancelled_call_inside_a_span_reports_it_cut(tokenizers):
    tok = tokenizers["tools"]
    seen = {"n": 0}

    def stop() -> bool:
        seen["n"] += 1
        return seen["n"] >= 20

    _, r, _ = run(tok, f"{CALL}", should_stop=stop)
    assert r.finish_reason == "cancelled" and r.tool_calls == [] and "cut off (cancelled)" in r.tool_call_errors[0]


def test_without_a_tool_call_format_markers_are_plain_text(tokenizers):
    _, r, events = run(tokenizers["plain"], f"Sure. {CALL}")
    assert r.finish_reason == "stop" and r.content == r.text and r.tool_calls == [] and r.tool_call_errors == []
    assert all(set(e) == {"text"} for e in events)


def test_whole_marker_tokens_of_the_scripted_model(tmp_path):
    from testkit.tinymodel import TOOL_SCRIPT

    path = make_model_dir(tmp_path / "m", template=TOOLS_CHATML, added=TOOL_SCRIPT)
    tok = load_tokenizer(path)
    assert len(tok.encode(CALL, add_special_tokens=False)) == 3
    _, r, events = run(tok, CALL)
    assert r.finish_reason == "tool_calls" and r.content == "" and len(r.tool_calls) == 1
    assert [e["text"] for e in events if "text" in e] == list(TOOL_SCRIPT)
    assert all(e.get("tool") for e in events if "text" in e)


def test_calls_decoded_together_each_get_their_own_content_and_calls(tmp_path):
    # Content before the call, from the scripted model; two sessions decode in one batch.
    from kvwake.daemon.model.engine import Engine
    from kvwake.daemon.session_state import Session
    from kvwake.store import Store
    from testkit.tinymodel import make_scripted_model

    script = ("Checking the weather.", "<tool_call>", WEATHER_CALL, "</tool_call>")
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, make_scripted_model(tmp_path / "m", script), max_batch=8)
    try:
        events: dict[str, list[dict]] = {"a": [], "b": []}
        calls = []
        for name in events:
            s = Session(name)
            engine.append(s, messages=[{"role": "user", "content": f"Weather for {name}?"}], tools=TOOLS)
            calls.append(engine.start_call(s, GenerateParams(), events[name].append))
        for call in calls:
            engine.decoder.join(call)
        while engine.decoder.active:
            engine.decoder.step()
        assert engine.decoder.counters["max_batch_seen"] == 2
        for call, name in zip(calls, events):
            r = call.future.result()
            assert r.finish_reason == "tool_calls" and r.content == "Checking the weather." and r.text == "".join(script)
            assert events[name][0] == {"text": "Checking the weather."}
            assert [e.get("tool") for e in events[name][1:4]] == [True] * 3 and "tool_call" in events[name][4]
            assert call.session.messages[-1] == {"role": "assistant", "content": "".join(script)}
        assert calls[0].future.result().tool_calls[0]["id"] != calls[1].future.result().tool_calls[0]["id"]
    finally:
        engine.close()
        store.close()


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A json_tools tokenizer whose vocabulary has <think> and </think>: mlx-lm names them its thinking markers."""
    path = tmp_path_factory.mktemp("thinker")
    write_tokenizer(path, TOOLS_CHATML, added=("<think>", "</think>"))
    (path / "config.json").write_text("{}")
    tok = load_tokenizer(path)
    assert tok.has_thinking and (tok.think_start, tok.think_end) == ("<think>", "</think>")
    return tok


def thinking_text(events: list[dict]) -> str:
    return "".join(e["text"] for e in events if e.get("thinking"))


def streamed_reasoning(events: list[dict]) -> str:
    return "".join(e.get("reasoning", "") for e in events)


def test_thinking_is_cut_from_content_and_streamed_as_thinking(thinker):
    reason, r, events = run(thinker, f"<think>\nThe user wants weather.\n</think>\n\nSure. {CALL}")
    assert r.reasoning == "The user wants weather." and r.content == "Sure. "
    assert thinking_text(events) == "<think>\nThe user wants weather.\n</think>\n\n"  # markers and whitespace
    assert content_text(events) == "Sure. " and len(r.tool_calls) == 1 and reason == "stop"
    assert streamed_reasoning(events) == r.reasoning  # byte by byte, markers and blank lines left out


def test_two_thinking_spans_are_one_reasoning_streamed_alike(thinker):
    _, r, events = run(thinker, "<think> first  </think>A<think>\n\nsecond\n</think>\nB")
    assert (r.reasoning, r.content) == ("first\n\nsecond", "AB")
    assert streamed_reasoning(events) == r.reasoning


def test_a_reply_the_template_opened_inside_thinking(thinker):
    events: list[dict] = []
    out = TextOutput(thinker, GenerateParams(), events.append, None, TOOLS, thinking=True)
    for t in [*thinker.encode("Plan first.</think>Answer.", add_special_tokens=False), thinker.eos_token_id]:
        if (reason := out.add(t)) is not None:
            break
    r = out.result(reason, 0)
    assert (r.reasoning, r.content) == ("Plan first.", "Answer.")
    assert thinking_text(events) == "Plan first.</think>" and content_text(events) == "Answer."
    assert streamed_reasoning(events) == "Plan first."


def test_thinking_cut_off_by_max_tokens_is_reasoning_and_no_content(thinker):
    text = "<think>Still weighing the options"
    reason, r, events = run(thinker, text, eos=False, max_tokens=len(thinker.encode(text, add_special_tokens=False)))
    assert reason == "length" and r.reasoning == "Still weighing the options" and r.content == ""
    assert thinking_text(events) == text and streamed_reasoning(events) == r.reasoning


def test_without_thinking_markers_a_think_tag_is_content(tokenizers):
    _, r, _ = run(tokenizers["tools"], "<think>not a marker here</think> ok")
    assert r.reasoning == "" and r.content == "<think>not a marker here</think> ok"
