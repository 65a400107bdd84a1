"""Tools on chat through the OpenAI-compatible API of a real worker (tiny Llama whose chat template renders
tools the way Qwen's and Hermes' do): the official ``openai`` SDK and LangChain's ``ChatOpenAI.bind_tools``,
forced calls (a named function, ``required``) whose arguments always validate against the function's schema,
``auto`` and ``none``, streamed deltas equal to the whole reply, a conversation that carries calls and
their results, and the 400s of bad tools."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest

from loraserve.protos.v1 import inference_pb2 as pb
from tests.httpapi.conftest import MODEL

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK_PARAMS = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK_PARAMS}},
]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": CLOCK_PARAMS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _valid(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[call.function.name])
    assert call.type == "function" and call.id.startswith("call_")
    return args


def _template_tokens(served, messages, tools) -> int:
    ids = served.worker.tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return len(ids)


@pytest.mark.parametrize("model", [MODEL, "all-r4"])
def test_a_named_function_is_called_with_arguments_that_match_its_schema(served, model) -> None:
    chat = served.client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=60, temperature=0
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(_valid(call)) == {"city", "days"}
    # the tools were rendered by the chat template: the prompt is exactly the template's tokens
    assert chat.usage.prompt_tokens == _template_tokens(served, MESSAGES, TOOLS)


def test_required_calls_offered_tools_one_or_many(served) -> None:
    for parallel in (False, True):
        chat = served.client.chat.completions.create(
            model="mlp-r16",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=120,
            temperature=0,
        )
        calls = chat.choices[0].message.tool_calls
        assert calls and chat.choices[0].finish_reason == "tool_calls"
        assert len(calls) == 1 or parallel
        for call in calls:
            _valid(call)
        assert len({c.id for c in calls}) == len(calls)


def test_streamed_tool_calls_equal_the_whole_reply(served) -> None:
    for choice in (NAMED, "required"):
        kw = dict(
            model="all-r4", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0
        )
        whole = served.client.chat.completions.create(**kw).choices[0]
        chunks = list(served.client.chat.completions.create(**kw, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert all(not d.content for d in deltas)  # a forced call is never content
        # and no chunk says nothing: the call's text is held back, not sent as empty deltas
        assert all(d.role or d.tool_calls for d in deltas[:-1]), [d for d in deltas if not d.tool_calls]
        streamed = [tc for d in deltas for tc in d.tool_calls or []]
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == [
            (i, tc.function.name, tc.function.arguments) for i, tc in enumerate(whole.message.tool_calls)
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls" == whole.finish_reason


def test_auto_and_none_leave_a_reply_without_calls_as_content(served) -> None:
    """The tiny model writes no calls of its own: with ``auto`` its reply is content, the same text as
    with ``none`` (and without tools, the prompt then differs), streamed or not."""
    kw = dict(model="all-r4", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0)
    auto = served.client.chat.completions.create(**kw, tool_choice="auto").choices[0]
    none = served.client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert auto.message.tool_calls is None and auto.message.content == none.message.content
    assert auto.message.content and auto.finish_reason == none.finish_reason
    streamed = served.client.chat.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == auto.message.content


def test_a_conversation_with_calls_and_their_results(served) -> None:
    """An assistant turn that called a tool and the tool's answer go through the template as the model
    saw them: the prompt is the template's tokens for that conversation."""
    first = served.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=60, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = served.client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    rendered = [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0]}]}, history[2]]
    rendered[1]["tool_calls"][0]["function"] = {
        "name": call.function.name,
        "arguments": json.loads(call.function.arguments),
    }
    assert second.usage.prompt_tokens == _template_tokens(served, rendered, TOOLS)


def test_langchain_bind_tools(served) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a zone."""
        return "12:00"

    llm = ChatOpenAI(
        model="all-r4",
        base_url=f"{served.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    reply = llm.bind_tools([get_time], tool_choice="get_time").invoke("What time is it in Berlin?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_time" and call["args"] == {"zone": call["args"]["zone"]}
    assert call["args"]["zone"] in ("utc", "cet") and call["id"].startswith("call_")
    forced = llm.bind_tools([get_time], tool_choice="any").invoke("What time is it?")  # "any" = required
    assert [c["name"] for c in forced.tool_calls][:1] == ["get_time"]


def _refused(served, body: dict) -> str:
    response = httpx.post(f"{served.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0] must be"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "A-Z, a-z, 0-9"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "parameters must be",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "offered twice"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "at most 128"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
        ({"tool_choice": "required"}, "needs tools"),
        (  # an object schema the grammar compiler refuses (a bad regex): the 400 names the tools
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "string", "pattern": "(("}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools: a function's parameters do not compile",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "both"),
        (
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}],
                    },
                ]
            },
            "not JSON",
        ),
    ],
)
def test_bad_tools_are_refused_with_a_400_naming_them(served, change, says) -> None:
    assert says in _refused(served, {"messages": MESSAGES, "max_tokens": 4, **change})


def test_grpc_tools_are_checked_at_the_worker(served) -> None:
    """A gRPC client's tools get the same checks (a parameters schema nested past the limit, bad JSON)."""
    import grpc

    deep = "[" * 200 + "]" * 200
    for parameters, says in [(f'{{"type": "object", "x": {deep}}}', "nests deeper"), ("{", "not JSON")]:
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2))
        req.chat.messages.add(role="user", content="hi")
        req.chat.tools.add(name="f", parameters=parameters)
        with pytest.raises(grpc.RpcError) as err:
            served.grpc(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()
