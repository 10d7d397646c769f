"""OpenAI tool calling without an engine: request checks, the constraint schema, parsing outputs
(whole and streamed, however the stream is split) and rendering tools into the prompt."""

import json
import random

import jsonschema
import pydantic
import pytest
from transformers import AutoTokenizer

from batcher.model_files import embedded_model_dir
from deployments.tool_calls import (
    FunctionCallDelta,
    FunctionDefinition,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    check_tool_choice,
    constraint_schema,
    effective_tool_choice,
    render_chat,
)
from deployments.tool_parsers import TOOL_CALL_PARSERS, calls_from_constrained, constrained_streamer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# ---- request models and checks -------------------------------------------------------------------


def test_function_names_follow_openai_pattern():
    FunctionDefinition(name="a-b_C9")
    for bad in ("has space", "", "x" * 65, "dots.no"):
        with pytest.raises(pydantic.ValidationError):
            FunctionDefinition(name=bad)
    with pytest.raises(pydantic.ValidationError):  # extra="forbid"
        FunctionDefinition(name="f", parametres={})


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
        (None, "required", "at least one tool"),
        ([], {"type": "function", "function": {"name": "get_weather"}}, "no tools"),
        ([WEATHER, WEATHER], "auto", "duplicate function names"),
    ],
)
def test_check_tool_choice_rejects(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        check_tool_choice(tools, choice)


def test_check_tool_choice_accepts_and_defaults():
    for choice in ("none", "auto", "required", NAMED):
        check_tool_choice([WEATHER, CLOCK], choice)
    check_tool_choice(None, "none")
    assert effective_tool_choice([WEATHER], None) == "auto"
    assert effective_tool_choice(None, None) == "none"
    assert isinstance(effective_tool_choice([WEATHER], NAMED), NamedToolChoice)
    choice = pydantic.TypeAdapter(ToolChoice)  # as a request field
    assert choice.validate_python("required") == "required"
    assert choice.validate_python(NAMED).function.name == "get_weather"
    for bad in ("sometimes", {"type": "function", "function": {"name": "f", "x": 1}}):
        with pytest.raises(pydantic.ValidationError):
            choice.validate_python(bad)


def test_response_models_look_like_openai():
    call = ToolCall(function={"name": "f", "arguments": "{}"})
    assert call.id.startswith("call_") and len(call.id) == 29 and call.type == "function"
    assert ToolCall(function={"name": "f", "arguments": "{}"}).id != call.id
    later = ToolCallDelta(index=1, function=FunctionCallDelta(arguments='{"a'))
    assert later.model_dump(exclude_none=True) == {"index": 1, "function": {"arguments": '{"a'}}


# ---- the constraint schema and the constrained output ---------------------------------------------


def test_constraint_schema_named_and_free_modes():
    assert constraint_schema([WEATHER, CLOCK], NAMED) == WEATHER["function"]["parameters"]
    assert constraint_schema([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}}) == {
        "type": "object"
    }
    assert constraint_schema([WEATHER], "auto") is None
    assert constraint_schema([WEATHER], "none") is None


@pytest.mark.parametrize("parallel", [True, False])
def test_constraint_schema_required_accepts_only_calls(parallel):
    schema = constraint_schema([WEATHER, CLOCK], "required", parallel)
    one = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    two = one + [{"name": "get_time", "arguments": {}}]
    jsonschema.validate(one, schema)
    if parallel:
        jsonschema.validate(two, schema)
    bad = [
        [],
        [{"name": "get_weather", "arguments": {}}],
        [{"name": "other", "arguments": {}}],
        [{"name": "get_time", "arguments": {}, "extra": 1}],
        [{"name": "get_time"}],
    ]
    for value in bad + ([] if parallel else [two]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)


def test_calls_from_constrained():
    [call] = calls_from_constrained('{"city": "Paris"}', NAMED)
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    calls = calls_from_constrained(
        '[{"name": "get_weather", "arguments": {"city": "Ré"}}, {"name": "get_time", "arguments": {}}]', "required"
    )
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Ré"}'),
        ("get_time", "{}"),
    ]
    for text, choice in [
        ('{"city": "Par', NAMED),
        ("[1]", NAMED),
        ("[]", "required"),
        ('[{"name": "f", "arguments": {}}', "required"),
        ("{}", "auto"),
    ]:
        with pytest.raises(ValueError):
            calls_from_constrained(text, choice)


# ---- parsing, whole and streamed ------------------------------------------------------------------


def as_tuples(parsed):
    return parsed.content, [(c.function.name, c.function.arguments) for c in parsed.tool_calls]


def assemble(pieces):
    """Streamed pieces -> (content, [(name, arguments)]), checking the deltas' OpenAI shape."""
    calls = {}
    for piece in pieces:
        for delta in piece.tool_calls:
            if delta.id is not None:  # a call's first delta, and only its first
                assert delta.index == len(calls) and delta.type == "function" and delta.function.name
                calls[delta.index] = [delta.function.name, ""]
            else:
                assert delta.index in calls and delta.function.name is None and delta.type is None
            calls[delta.index][1] += delta.function.arguments or ""
    content = "".join(p.content for p in pieces)
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


def stream(streamer, text, cuts):
    bounds = [0, *sorted(cuts), len(text)]
    pieces = [streamer.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    return pieces + [streamer.finish()]


def splits(text):
    rng = random.Random(len(text))
    yield []
    yield range(1, len(text))
    for _ in range(20):
        yield rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))) if len(text) > 1 else []


HERMES_OUTPUTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>",
    '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
    '{"name": "b", "arguments": {"y": [1, 2, {"z": "}{]"}], "w": null}}\n</tool_call>',
    'Sure <tool_call>not json</tool_call> then <tool_call>{"name": 5}</tool_call> and '
    '<tool_call>{"arguments": {}}</tool_call> done',
    '<tool_call>{"name": "run", "arguments": {"code": "if (a) { b = \\"}\\"; }", "t": "\\\\"}}</tool_call>',
    '<tool_call>{"name": "say", "arguments": {"text": "héllo 世界 🎉", "e": "\\u00e9"}}</tool_call> après',
    '<tool_call>{"arguments": {"a": {"b": 1}}, "name": "late_name"}</tool_call>',
    "a < b, <tool but no <tool_call",
    'text <tool_call>{"na',
    '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name": "g"}</tool_call>',
    "",
]

LLAMA_OUTPUTS = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "a", "parameters": {"x": "{;}"}}; {"name": "b", "arguments": {"y": "\\"q\\""}}',
    "The answer is 42.",
    "  \n{not json}",
    '<|python_tag|>print("hi")',
    "<|pyth",
    ' {"name": "say", "parameters": {"text": "日本語 ✓"}}',
    '{"parameters": {"a": [1, {"b": "]"}]}, "name": "late_name"};',
    "",
    "  \n",
]


@pytest.mark.parametrize(
    "parser, text", [("hermes", t) for t in HERMES_OUTPUTS] + [("llama3_json", t) for t in LLAMA_OUTPUTS]
)
def test_streaming_reassembles_to_the_parse(parser, text):
    parser = TOOL_CALL_PARSERS[parser]
    expected = as_tuples(parser.parse(text))
    for cuts in splits(text):
        assert assemble(stream(parser.streamer(), text, cuts)) == expected, cuts


def test_hermes_parse():
    assert as_tuples(TOOL_CALL_PARSERS["hermes"].parse(HERMES_OUTPUTS[2])) == (HERMES_OUTPUTS[2], [])
    assert as_tuples(TOOL_CALL_PARSERS["hermes"].parse(HERMES_OUTPUTS[1])) == (
        None,
        [("a", '{"x": 1}'), ("b", '{"y": [1, 2, {"z": "}{]"}], "w": null}')],
    )
    assert as_tuples(TOOL_CALL_PARSERS["hermes"].parse(HERMES_OUTPUTS[9])) == (None, [("f", '{"a": 1}'), ("g", "{}")])
    content, calls = as_tuples(TOOL_CALL_PARSERS["hermes"].parse(HERMES_OUTPUTS[4]))
    assert content == " après" and json.loads(calls[0][1]) == {"text": "héllo 世界 🎉", "e": "é"}


def test_llama3_json_parse():
    parser = TOOL_CALL_PARSERS["llama3_json"]
    assert as_tuples(parser.parse(LLAMA_OUTPUTS[1])) == (None, [("a", '{"x": "{;}"}'), ("b", '{"y": "\\"q\\""}')])
    for text in ("The answer is 42.", "  \n{not json}", '{"name": "f", "parameters": {}} trailing text'):
        assert as_tuples(parser.parse(text)) == (text, [])
    assert as_tuples(parser.parse("  \n")) == (None, [])


def test_streaming_sends_content_and_arguments_as_they_come():
    streamer = TOOL_CALL_PARSERS["hermes"].streamer()
    assert streamer.feed("Hello <tool").content == "Hello "  # "<tool" held: it may be a tag
    first = streamer.feed('_call>{"name": "get_weather", "arguments": {"ci')
    assert first.content == "" and [d.model_dump(exclude_none=True) for d in first.tool_calls] == [
        {
            "index": 0,
            "id": first.tool_calls[0].id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"ci'},
        }
    ]
    later = streamer.feed('ty": "Paris"}}</tool_call> Bye')
    assert [d.model_dump(exclude_none=True) for d in later.tool_calls] == [
        {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}
    ]
    assert later.content == " Bye" and streamer.finish().content == ""
    assert TOOL_CALL_PARSERS["hermes"].streamer().feed("a <b").content == "a <b"


def test_streaming_commits_a_call_whose_name_was_sent():
    """Documented limit: a call cut after its name streamed (max_tokens) keeps what was sent."""
    text = 'x <tool_call>{"name": "f", "arguments": {"a": 1'
    assert as_tuples(TOOL_CALL_PARSERS["hermes"].parse(text)) == (text, [])
    assert assemble(stream(TOOL_CALL_PARSERS["hermes"].streamer(), text, range(1, len(text)))) == (
        "x ",
        [("f", '{"a": 1')],
    )


@pytest.mark.parametrize(
    "parser, text",
    [
        ("llama3_json", '{"name": "f", "parameters": {"a": tru}}'),
        ("hermes", 'x <tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>'),
    ],
)
def test_a_malformed_call_that_arrives_whole_streams_as_content(parser, text):
    parser = TOOL_CALL_PARSERS[parser]
    assert as_tuples(parser.parse(text)) == (text, [])
    assert assemble(stream(parser.streamer(), text, [])) == (text, [])


@pytest.mark.parametrize(
    "text, choice",
    [
        ('{"city": "Paris", "note": "a \\"}\\" b"}', NAMED),
        (
            '[{"name": "get_weather", "arguments": {"city": "]}, {"}}, {"name": "get_time", "arguments": {}}]',
            "required",
        ),
        ('[\n  {"arguments": {"city": "Ré"}, "name": "get_weather"}\n]', "required"),
    ],
)
def test_constrained_streaming_reassembles_to_the_parse(text, choice):
    expected = [(c.function.name, c.function.arguments) for c in calls_from_constrained(text, choice)]
    for cuts in splits(text):
        assert assemble(stream(constrained_streamer(choice), text, cuts)) == (None, expected), cuts


def test_constrained_streaming_named_sends_the_name_first():
    piece = constrained_streamer(NAMED).feed("")
    assert [d.model_dump(exclude_none=True) for d in piece.tool_calls] == [
        {
            "index": 0,
            "id": piece.tool_calls[0].id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
    ]
    broken = constrained_streamer("required")
    assert broken.feed("not an array").tool_calls == [] and broken.finish().content == "not an array"


# ---- rendering the prompt -------------------------------------------------------------------------

TOOL_AWARE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
]


@pytest.fixture(scope="module")
def smol():
    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


def test_render_without_tools_is_the_template_as_before(smol):
    for messages in (
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        ],
    ):
        expected = smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_chat(smol, messages, None) == expected
        assert render_chat(smol, messages, []) == expected


def test_render_hermes_fallback_for_a_template_without_tools(smol):
    text = render_chat(smol, [{"role": "system", "content": "Be brief."}, *CONVERSATION], [WEATHER])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and "SmolLM" not in text
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in system and "<tool_call>" in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>"
    ) in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    alone = render_chat(smol, CONVERSATION[:1], [WEATHER])  # no system message: ours comes first
    assert alone.startswith("<|im_start|>system\n# Tools") and "SmolLM" not in alone


def test_render_passes_tools_to_a_template_that_knows_them():
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    tokenizer.chat_template = TOOL_AWARE_TEMPLATE
    text = render_chat(tokenizer, CONVERSATION, [WEATHER, CLOCK])
    assert text.startswith("<|im_start|>system\nTOOLS: get_weather get_time<|im_end|>\n")
    assert "<|im_start|>assistant\nCALL get_weather Paris<|im_end|>" in text  # arguments decoded to a dict
    assert "<|im_start|>tool\n18C<|im_end|>" in text
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, messages, None) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
