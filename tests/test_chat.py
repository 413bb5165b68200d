"""DeepSeek-V4 prompt encoding: exact strings of the official encoder.

Expected strings are written out by hand from the official ``encoding/encoding_dsv4.py``, its README
and its golden test files (encoding/tests/test_input_{1,2,4}.json / test_output_*.txt in the
DeepSeek-V4-Flash release); they do not reuse the templates in dsv4_jax.chat.
"""

import json

import pytest

from dsv4_jax.chat import encode_messages, parse_completion

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a specific location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
            },
            "required": ["location"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web for information",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "Search query"},
                "num_results": {"type": "integer", "description": "Number of results to return"},
            },
            "required": ["query"],
        },
    },
}

TOOLS_BLOCK = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "description": "Get the weather for a specific location", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, "required": ["location"]}}
{"name": "search", "description": "Search the web for information", "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "Search query"}, "num_results": {"type": "integer", "description": "Number of results to return"}}, "required": ["query"]}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

SYS = {"role": "system", "content": "You are a helpful assistant."}

# Official golden case 2 (encoding/tests/test_input_2.json).
HISTORY = [
    SYS,
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "reasoning_content": "The user said hello, I should greet back.",
     "content": "Hi there! How can I help you?"},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_plain_chat():
    msgs = [{"role": "user", "content": "hi"}]
    assert encode_messages(msgs) == BOS + U + "hi" + A + "</think>"
    assert encode_messages(msgs, thinking_mode="thinking") == BOS + U + "hi" + A + "<think>"


def test_system_prompt_readme_example():
    msgs = [SYS, {"role": "user", "content": "What is 2+2?"}]
    assert encode_messages(msgs, thinking_mode="thinking") == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>"
    )
    assert encode_messages(msgs, thinking_mode="chat") == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜></think>"
    )


def test_multi_turn_chat_mode_never_shows_reasoning():
    assert encode_messages(HISTORY, thinking_mode="chat") == (
        BOS + "You are a helpful assistant."
        + U + "Hello" + A + "</think>Hi there! How can I help you?" + EOS
        + U + "What is the capital of France?" + A + "</think>"
    )


def test_multi_turn_thinking_drops_earlier_reasoning():
    assert encode_messages(HISTORY, thinking_mode="thinking") == (
        BOS + "You are a helpful assistant."
        + U + "Hello" + A + "</think>Hi there! How can I help you?" + EOS
        + U + "What is the capital of France?" + A + "<think>"
    )


def test_official_golden_case_2_full_history():
    msgs = HISTORY + [{"role": "assistant", "reasoning_content": "The user asks about the capital of France. It is Paris.",
                       "content": "The capital of France is Paris."}]
    assert encode_messages(msgs, thinking_mode="thinking") == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I "
        "help you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks about "
        "the capital of France. It is Paris.</think>The capital of France is Paris.<｜end▁of▁sentence｜>"
    )


def test_thinking_keep_reasoning_when_drop_thinking_false():
    assert encode_messages(HISTORY, thinking_mode="thinking", drop_thinking=False) == (
        BOS + "You are a helpful assistant."
        + U + "Hello" + A + "<think>The user said hello, I should greet back.</think>Hi there! How can I help you?" + EOS
        + U + "What is the capital of France?" + A + "<think>"
    )


def test_reasoning_effort_max_prefix():
    msgs = [SYS, {"role": "user", "content": "hi"}]
    assert encode_messages(msgs, thinking_mode="thinking", reasoning_effort="max") == (
        BOS + MAX_EFFORT + "You are a helpful assistant." + U + "hi" + A + "<think>"
    )
    # only in thinking mode; "high" adds nothing
    assert encode_messages(msgs, thinking_mode="chat", reasoning_effort="max") == encode_messages(msgs)
    assert encode_messages(msgs, thinking_mode="thinking", reasoning_effort="high") == (
        encode_messages(msgs, thinking_mode="thinking")
    )


CASE1_CALL_TEXT = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
CASE1 = [
    {**SYS, "tools": [WEATHER_TOOL, SEARCH_TOOL]},
    {"role": "user", "content": "What's the weather in Beijing?"},
    {"role": "assistant",
     "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
     "tool_calls": [{"id": "call_001", "type": "function", "function": {
         "name": "get_weather", "arguments": "{\"location\": \"Beijing\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_001",
     "content": "{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}"},
    {"role": "assistant", "reasoning_content": "Got the weather data. Let me format a nice response.",
     "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."},
]
CASE1_EXPECTED = (
    BOS + "You are a helpful assistant.\n\n" + TOOLS_BLOCK
    + U + "What's the weather in Beijing?" + A
    + "<think>The user wants to know the weather in Beijing. I should use the get_weather tool.</think>"
    + CASE1_CALL_TEXT + EOS
    + U + '<tool_result>{"temperature": 22, "condition": "sunny", "humidity": 45}</tool_result>' + A
    + "<think>Got the weather data. Let me format a nice response.</think>"
    + "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity." + EOS
)


def test_official_golden_case_1_tools_thinking():
    # tools present => earlier reasoning is kept and every user turn opens <think>
    assert encode_messages(CASE1, thinking_mode="thinking") == CASE1_EXPECTED


def test_tools_argument_equals_tools_on_system_message():
    msgs = [SYS] + CASE1[1:]
    assert encode_messages(msgs, thinking_mode="thinking", tools=[WEATHER_TOOL, SEARCH_TOOL]) == CASE1_EXPECTED
    # no system message: one with empty content carries the tools
    got = encode_messages([{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL, SEARCH_TOOL])
    assert got == BOS + "\n\n" + TOOLS_BLOCK + U + "hi" + A + "</think>"


def test_tool_calls_chat_mode_non_string_params():
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": '{"query": "天气", "num_results": 3}'}},
            {"type": "function", "function": {"name": "f", "arguments": '{"flag": true, "xs": [1, "二"], "o": {"a": null}}'}},
        ]},
    ]
    assert encode_messages(msgs) == (
        BOS + U + "go" + A + "</think>Checking.\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="search">\n'
        '<｜DSML｜parameter name="query" string="true">天气</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="num_results" string="false">3</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="flag" string="false">true</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="xs" string="false">[1, "二"]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="o" string="false">{"a": null}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>" + EOS
    )


def test_two_tool_results_merged_sorted_and_user_text_joined():
    msgs = [
        {"role": "user", "content": "weather in A and B?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "A"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "B"}'}},
        ]},
        # results arrive out of order: the encoder sorts them by the call order
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
        {"role": "user", "content": "thanks, and tomorrow?"},
    ]
    calls = (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="location" string="true">A</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="location" string="true">B</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>"
    )
    assert encode_messages(msgs, thinking_mode="chat") == (
        BOS + U + "weather in A and B?" + A + "</think>" + calls + EOS
        + U + "<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>\n\nthanks, and tomorrow?"
        + A + "</think>"
    )
    # thinking mode without tools: the tool-result turn counts as a user turn, reasoning is dropped
    # before the last one and only the last user turn opens <think>
    assert encode_messages(msgs[:4], thinking_mode="thinking") == (
        BOS + U + "weather in A and B?" + A + "</think>" + calls + EOS
        + U + "<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>" + A + "<think>"
    )


def test_tool_result_content_blocks():
    msgs = [
        {"role": "assistant", "content": "x"},
        {"role": "tool", "content": [{"type": "text", "text": "p1"}, {"type": "image"}, {"type": "text", "text": "p2"}]},
    ]
    assert encode_messages(msgs) == (
        BOS + "x" + EOS + U + "<tool_result>p1\n\n[Unsupported image]\n\np2</tool_result>" + A + "</think>"
    )


def test_latest_reminder_and_action_task_official_case_4_shape():
    msgs = [
        {"role": "system", "content": "SYS"},
        {"role": "latest_reminder", "content": "2024-11-15,上海市,App,中文"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "世界著名温泉有哪些", "task": "action"},
        {"role": "assistant", "content": "Search"},
    ]
    assert encode_messages(msgs, thinking_mode="chat") == (
        BOS + "SYS<｜latest_reminder｜>2024-11-15,上海市,App,中文"
        + U + "q1" + A + "</think>answer 1" + EOS
        + U + "世界著名温泉有哪些" + A + "</think><｜action｜>Search" + EOS
    )


def test_query_task_and_title_task():
    assert encode_messages([{"role": "user", "content": "q", "task": "query"}]) == BOS + U + "q<｜query｜>"
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "task": "title"}]
    assert encode_messages(msgs) == BOS + U + "q" + A + "</think>a" + EOS + "<｜title｜>"


def test_developer_role_and_dropped_before_last_user_in_thinking():
    msgs = [
        {"role": "developer", "content": "dev q"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    assert encode_messages(msgs, thinking_mode="chat") == (
        BOS + U + "dev q" + A + "</think>a1" + EOS + U + "q2" + A + "</think>"
    )
    assert encode_messages(msgs, thinking_mode="thinking") == BOS + "a1" + EOS + U + "q2" + A + "<think>"


def test_no_generation_prompt():
    msgs = [SYS, {"role": "user", "content": "hi"}]
    assert encode_messages(msgs, thinking_mode="thinking", add_generation_prompt=False) == (
        BOS + "You are a helpful assistant." + U + "hi"
    )
    assert encode_messages(msgs, add_bos=False) == "You are a helpful assistant." + U + "hi" + A + "</think>"


def test_wo_eos_leaves_assistant_turn_open():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel", "wo_eos": True}]
    assert encode_messages(msgs) == BOS + U + "hi" + A + "</think>Hel"


@pytest.mark.parametrize(
    "kwargs, msgs, needle",
    [
        ({}, [{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ({}, [{"content": "x"}], "unknown role None"),
        ({}, [{"role": "user"}], "messages[0] (user): missing 'content'"),
        ({}, [{"role": "tool"}], "messages[0] (tool): missing 'content'"),
        ({}, [{"role": "user", "content": 3}], "'content' must be a str"),
        ({}, [{"role": "developer", "content": ""}], "'content' must not be empty"),
        ({"thinking_mode": "think"}, [{"role": "user", "content": "x"}], "thinking_mode must be 'chat' or 'thinking'"),
        ({"reasoning_effort": "low"}, [{"role": "user", "content": "x"}], "reasoning_effort must be"),
        ({}, [{"role": "user", "content": "x", "task": "nope"}], "unknown task 'nope'"),
        ({}, [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "function.name"),
        ({}, [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
         "must be a JSON object"),
        ({}, "hello", "messages must be a list"),
        ({"tools": [{"type": "function"}]}, [{"role": "user", "content": "x"}], "each tool must be"),
    ],
)
def test_errors(kwargs, msgs, needle):
    with pytest.raises(ValueError) as info:
        encode_messages(msgs, **kwargs)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_non_json_arguments_fall_back_like_official():
    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}]
    assert encode_messages(msgs) == (
        BOS + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
        '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS
    )


# ---- parse_completion --------------------------------------------------------------------------

def test_parse_readme_example():
    parsed = parse_completion("Simple arithmetic.</think>2 + 2 = 4.<｜end▁of▁sentence｜>", thinking_mode="thinking")
    assert parsed == {"role": "assistant", "reasoning_content": "Simple arithmetic.", "content": "2 + 2 = 4.",
                      "tool_calls": []}
    assert parse_completion("hello" + EOS) == {"role": "assistant", "content": "hello", "reasoning_content": "",
                                              "tool_calls": []}


def test_parse_tool_calls_round_trip_from_encoded_prompt():
    prompt = encode_messages(CASE1, thinking_mode="thinking")
    marker = A + "<think>"
    first = prompt.index(marker) + len(marker)
    parsed = parse_completion(prompt[first:prompt.index(U, first)], thinking_mode="thinking")
    assert parsed["reasoning_content"] == (
        "The user wants to know the weather in Beijing. I should use the get_weather tool.")
    assert parsed["content"] == ""
    [call] = parsed["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == '{"location": "Beijing", "unit": "celsius"}'
    last = parse_completion(prompt[prompt.rindex(marker) + len(marker):], thinking_mode="thinking")
    assert "22°C" in last["content"] and last["tool_calls"] == []


def test_parse_non_string_parameters():
    text = ("ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
            '<｜DSML｜parameter name="n" string="false">3</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="s" string="true">a "q"</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS)
    parsed = parse_completion(text)
    assert parsed["content"] == "ok"
    assert json.loads(parsed["tool_calls"][0]["function"]["arguments"]) == {"n": 3, "s": 'a "q"'}


@pytest.mark.parametrize(
    "text, mode",
    [
        ("no end of reasoning" + EOS, "thinking"),
        ("no eos", "chat"),
        ("a" + EOS + "trailing", "chat"),
        ("x<think>y" + EOS, "chat"),
        ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke nam=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS, "chat"),
    ],
)
def test_parse_errors(text, mode):
    with pytest.raises(ValueError):
        parse_completion(text, thinking_mode=mode)
    with pytest.raises(ValueError, match="thinking_mode"):
        parse_completion("x" + EOS, thinking_mode="fast")


# ---- token ids (encode_message_ids) --------------------------------------------------------------

@pytest.fixture(scope="module")
def default_tok():
    import dsv4_jax
    from dsv4_jax.tokenizer import Tokenizer
    return Tokenizer(dsv4_jax.DEFAULT_MODEL_DIR)


TOOL_TURNS = [
    {"role": "user", "content": "weather in A and B?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "A"}'}},
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"n": 3, "xs": [1, "二"]}'}},
    ]},
    {"role": "tool", "tool_call_id": "c2", "content": "rain."},  # text ending in punctuation before template text
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sun"}, {"type": "image"}]},
    {"role": "user", "content": "thanks!"},
]

ID_CASES = [
    ([{"role": "user", "content": "hi"}], {}),
    ([SYS, {"role": "user", "content": "What is 2+2?"}], {"thinking_mode": "thinking"}),
    (HISTORY, {"thinking_mode": "chat"}),
    (HISTORY, {"thinking_mode": "thinking"}),
    (HISTORY, {"thinking_mode": "thinking", "drop_thinking": False}),
    ([SYS, {"role": "user", "content": "hi"}], {"thinking_mode": "thinking", "reasoning_effort": "max"}),
    (CASE1, {"thinking_mode": "thinking"}),
    ([{"role": "system", "content": "Be brief."}] + CASE1[1:], {"tools": [WEATHER_TOOL, SEARCH_TOOL]}),
    (TOOL_TURNS, {"thinking_mode": "chat"}),
    (TOOL_TURNS[:4], {"thinking_mode": "thinking"}),
    ([{"role": "system", "content": "SYS"}, {"role": "latest_reminder", "content": "2024-11-15,上海市"},
      {"role": "user", "content": "世界著名温泉有哪些", "task": "action"}, {"role": "assistant", "content": "Search"}], {}),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "task": "title"}], {}),
    ([{"role": "developer", "content": "dev q", "response_format": {"type": "object"}},
      {"role": "assistant", "content": "a1", "reasoning_content": "r1"}, {"role": "user", "content": "q2"}],
     {"thinking_mode": "thinking", "drop_thinking": False}),
    ([SYS, {"role": "user", "content": "hi"}], {"add_generation_prompt": False, "add_bos": False}),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel", "wo_eos": True}], {}),
]


@pytest.mark.parametrize("msgs, kwargs", ID_CASES)
def test_message_ids_equal_the_encoded_prompt_string(default_tok, msgs, kwargs):
    # No special-token text in the content: the ids are those of the whole prompt string, raw path.
    from dsv4_jax.chat import encode_message_ids
    prompt = encode_messages(msgs, **kwargs)
    ids = encode_message_ids(default_tok, msgs, **kwargs)
    assert ids == default_tok.encode(prompt, allow_special=True)
    assert default_tok.decode(ids) == prompt


def test_segments_join_to_the_prompt_and_mark_caller_text():
    from dsv4_jax.chat import render_segments
    segments = render_segments(TOOL_TURNS, thinking_mode="chat")
    assert "".join(s.text for s in segments) == encode_messages(TOOL_TURNS, thinking_mode="chat")
    caller = {s.text for s in segments if not s.template}
    assert {"weather in A and B?", "Checking.", "get_weather", "location", "A", "n", "3", "rain.", "sun", "image",
            "thanks!"} <= caller
    assert not {BOS, U, A, EOS, "</think>"} & caller
