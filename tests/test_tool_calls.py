"""Tool-call parsing on fixed model outputs (Qwen2.5/Qwen3 ``<tool_call>`` JSON and Llama
3's JSON form), the checks on ``tools``/``tool_choice``, and the streaming hold-back."""

from __future__ import annotations

import json

import pytest

from areal_jax.engine.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MAX_ARGUMENT_DEPTH,
    ToolCallStream,
    ToolSpecError,
    check_tools,
    forced_prefix,
    parse_tool_calls,
    template_tool_calls,
    tool_call_format,
)
from tests.tool_fixtures import QWEN25_TEMPLATE, WEATHER_TOOL

NAMES = {"get_weather", "calculator"}
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def calls_of(parsed):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed[1]]


def test_qwen_call_parses_to_openai_shape():
    parsed = parse_tool_calls(QWEN_CALL, HERMES, NAMES)
    assert parsed is not None and parsed[0] is None
    (call,) = parsed[1]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 10
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_qwen_text_before_and_parallel_calls():
    text = ("Let me look both up.\n" + QWEN_CALL + "\n<tool_call>\n"
            '{"name": "calculator", "arguments": {"expression": "17+5"}}\n</tool_call>')
    parsed = parse_tool_calls(text, HERMES, NAMES)
    assert parsed[0] == "Let me look both up."
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"}),
                                ("calculator", {"expression": "17+5"})]
    ids = [c["id"] for c in parsed[1]]
    assert len(set(ids)) == 2


def test_qwen3_thinking_stays_content():
    text = "<think>\nI need the weather.\n</think>\n\n" + QWEN_CALL
    parsed = parse_tool_calls(text, HERMES, NAMES)
    assert parsed[0] == "<think>\nI need the weather.\n</think>"
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]


def test_arguments_written_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}' \
           '</tool_call>'
    assert calls_of(parse_tool_calls(text, HERMES, NAMES)) == [("calculator",
                                                                {"expression": "2+2"})]


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",  # no call
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',  # unclosed
    '<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>',  # not in tools
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # not an object
    QWEN_CALL + " and then I will tell you.",  # text after the calls
    QWEN_CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
])
def test_calls_that_do_not_parse_stay_text(text):
    assert parse_tool_calls(text, HERMES, NAMES) is None


def test_llama3_json_calls():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls_of(parse_tool_calls(one, LLAMA3_JSON, NAMES)) == [("get_weather",
                                                                    {"city": "Paris"})]
    assert parse_tool_calls(one, LLAMA3_JSON, NAMES)[0] is None
    tagged = '<|python_tag|>{"name": "calculator", "arguments": {"expression": "1+1"}}'
    assert calls_of(parse_tool_calls(tagged, LLAMA3_JSON, NAMES)) == [("calculator",
                                                                       {"expression": "1+1"})]
    two = one + '; {"name": "calculator", "parameters": {"expression": "3-1"}}'
    assert [n for n, _ in calls_of(parse_tool_calls(two, LLAMA3_JSON, NAMES))] == \
        ["get_weather", "calculator"]
    for bad in ["It is sunny in Paris.", '{"name": "get_weather", "parameters": {"city": ',
                '{"name": "nope", "parameters": {}}', one + " Done."]:
        assert parse_tool_calls(bad, LLAMA3_JSON, NAMES) is None, bad


def test_format_is_read_from_the_chat_template():
    assert tool_call_format(QWEN25_TEMPLATE) == HERMES
    llama = ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
             "{{- '<|python_tag|>' }}")
    assert tool_call_format(llama) == LLAMA3_JSON
    assert tool_call_format(None) == HERMES


def test_tool_and_choice_checks_name_the_field():
    spec = check_tools([WEATHER_TOOL], None)
    assert spec.choice == "auto" and spec.parse and spec.names == {"get_weather"}
    assert not check_tools([WEATHER_TOOL], "none").parse
    assert check_tools(None, None).choice == "none"
    named = check_tools([WEATHER_TOOL], {"type": "function",
                                         "function": {"name": "get_weather"}})
    assert (named.choice, named.named) == ("named", "get_weather")
    bad = [
        ({"type": "function"}, None, "tools"),
        ([{"type": "retrieval"}], None, "tools"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools"),
        ([WEATHER_TOOL, WEATHER_TOOL], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools"),
        (None, "required", "tool_choice"),
        ([WEATHER_TOOL], "always", "tool_choice"),
        ([WEATHER_TOOL], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
    ]
    for tools, choice, param in bad:
        with pytest.raises(ToolSpecError) as e:
            check_tools(tools, choice)
        assert e.value.param == param, (tools, choice)


def test_assistant_calls_become_template_dicts():
    calls = template_tool_calls(1, [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    assert calls == [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    for bad in [[], [{"function": {"name": "f", "arguments": "{not json"}}],
                [{"function": {"name": "", "arguments": "{}"}}],
                [{"function": {"name": "f", "arguments": "[1, 2]"}}], "x"]:
        with pytest.raises(ToolSpecError, match=r"messages\[1\]"):
            template_tool_calls(1, bad)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_the_server_emits_only_calls_it_accepts_back(fmt):
    """One limit both ways: a call the model writes is returned as ``tool_calls`` exactly
    when the same call, sent back in the next turn's messages, is accepted. Arguments nested
    past MAX_ARGUMENT_DEPTH (81 levels) or holding a lone surrogate (the JSON escape
    \\ud800, in a value or a key) stay text, and are a 400 in a request."""
    key = "arguments" if fmt == HERMES else "parameters"

    def written(args_json):
        body = '{"name": "get_weather", "' + key + '": ' + args_json + '}'
        return f"<tool_call>\n{body}\n</tool_call>" if fmt == HERMES else body

    def nested(depth):
        return '{"a": ' * depth + "1" + "}" * depth

    cases = {nested(d): d <= MAX_ARGUMENT_DEPTH
             for d in (1, MAX_ARGUMENT_DEPTH - 1, MAX_ARGUMENT_DEPTH, MAX_ARGUMENT_DEPTH + 1, 81)}
    cases.update({'{"city": "\\ud800"}': False, '{"\\udcff": 1}': False,
                  '{"city": ["ok", {"x": "\\ud83d"}]}': False,
                  '{"city": "\\ud83d\\ude00"}': True})  # a surrogate pair is text
    for args_json, ok in cases.items():
        parsed = parse_tool_calls(written(args_json), fmt, NAMES)
        assert (parsed is not None) == ok, args_json[:40]
        sent_back = [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": args_json}}]
        if ok:
            (call,) = parsed[1]
            sent_back[0]["function"]["arguments"] = call["function"]["arguments"]
            assert template_tool_calls(2, sent_back)[0]["function"]["arguments"] == \
                json.loads(args_json)
        else:
            with pytest.raises(ToolSpecError, match=r"messages\[2\].tool_calls\[0\].function"
                                                    r".arguments (is nested too deeply|holds a"
                                                    r" lone UTF-16 surrogate)"):
                template_tool_calls(2, sent_back)


def test_forced_prefix_starts_a_call_the_parser_completes():
    named = check_tools([WEATHER_TOOL], {"type": "function",
                                         "function": {"name": "get_weather"}})
    prefix = forced_prefix(HERMES, named)
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert calls_of(parse_tool_calls(prefix + '{"city": "Rome"}}\n</tool_call>', HERMES,
                                     named.names)) == [("get_weather", {"city": "Rome"})]
    assert forced_prefix(HERMES, check_tools([WEATHER_TOOL], "required")) == "<tool_call>\n"
    assert forced_prefix(LLAMA3_JSON, named) == '{"name": "get_weather", "parameters": '
    assert forced_prefix(HERMES, check_tools([WEATHER_TOOL], "auto")) == ""


def stream(text, fmt, pieces=1):
    s = ToolCallStream(fmt, NAMES)
    sent = "".join(s.feed(text[i:i + pieces]) for i in range(0, len(text), pieces))
    tail, calls = s.finish()
    return sent, tail, calls


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_stream_holds_back_calls_and_sends_text(pieces):
    sent, tail, calls = stream("Checking.\n" + QWEN_CALL, HERMES, pieces)
    assert sent + tail == "Checking.\n" and [c["function"]["name"] for c in calls] == \
        ["get_weather"]
    # Text with a '<' that is no call is all sent, and "<tool" at the end is held, then sent.
    sent, tail, calls = stream("a < b and <b>bold</b> <tool", HERMES, pieces)
    assert calls is None and sent + tail == "a < b and <b>bold</b> <tool"
    assert sent == "a < b and <b>bold</b> " and tail == "<tool"
    # An unparseable call comes out as text at the end.
    bad = QWEN_CALL[:-3]
    sent, tail, calls = stream("x" + bad, HERMES, pieces)
    assert calls is None and sent == "x" and tail == bad


def test_stream_llama_holds_a_json_reply_only():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    sent, tail, calls = stream(one, LLAMA3_JSON)
    assert sent == "" and tail == "" and calls[0]["function"]["name"] == "get_weather"
    sent, tail, calls = stream("Sunny, 21 C.", LLAMA3_JSON)
    assert sent == "Sunny, 21 C." and tail == "" and calls is None
