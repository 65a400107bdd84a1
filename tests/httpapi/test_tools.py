"""Tools on chat through the OpenAI-compatible API of a real worker (tiny Llama whose chat template renders
tools the way Qwen's and Hermes' do): the official ``openai`` SDK and LangChain's ``ChatOpenAI.bind_tools``,
forced calls (a named function, ``required``) whose arguments always validate against the function's schema,
``auto`` and ``none``, streamed deltas equal to the whole reply, a conversation that carries calls and
their results, and the 400s of bad tools. A call cut short by ``max_tokens`` is content with
``finish_reason: "length"`` in every mode and a whole call's arguments are spelled one way (compact JSON), in
each of n choices, streamed or not; what a reply said is accepted back as history."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest

from loraserve.httpapi.responses import Choice, Shape
from loraserve.httpapi.schemas import ToolUse
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
FORCED = {"required": "required", "named": NAMED}


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


def _compact(value) -> str:
    """The one spelling of a call's arguments (docs/http.md)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _streamed(served, **kw) -> dict[int, dict]:
    """Each choice of a streamed reply put together as a client does (content, tool_calls, finish_reason);
    no chunk may say nothing."""
    out: dict[int, dict] = {}
    for chunk in served.client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            got = out.setdefault(c.index, {"content": None, "tool_calls": [], "finish_reason": None})
            d = c.delta
            assert d.content or d.tool_calls or d.role or c.finish_reason, chunk
            if d.content:
                got["content"] = (got["content"] or "") + d.content
            got["tool_calls"] += [tc.model_dump() for tc in d.tool_calls or []]
            got["finish_reason"] = c.finish_reason or got["finish_reason"]
    return out


@pytest.mark.parametrize("mode", list(FORCED))
def test_a_call_cut_short_by_max_tokens_is_content(served, mode) -> None:
    """max_tokens reached before the call's JSON is whole: ``finish_reason: "length"``, the text generated so
    far as content (exactly the whole call's first tokens) and no tool_calls, streamed or not, in each of n
    choices; ``auto`` does the same (the tiny model writes no call of its own: test_n_choices_... below)."""
    kw = dict(
        model="all-r4",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=FORCED[mode],
        parallel_tool_calls=False,
        temperature=0,
    )
    whole = served.client.chat.completions.create(**kw, max_tokens=120, logprobs=True).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.arguments == _compact(_valid(call))
    tokens = [t.token for t in whole.logprobs.content]
    for cut in (1, 8, len(tokens) - 2):
        text = "".join(tokens[:cut])
        chat = served.client.chat.completions.create(**kw, max_tokens=cut, n=2)
        assert chat.usage.completion_tokens == 2 * cut
        assert [c.index for c in chat.choices] == [0, 1]
        for choice in chat.choices:
            assert choice.finish_reason == "length" and choice.message.tool_calls is None
            assert choice.message.content == text
        with pytest.raises(ValueError):
            json.loads(text)
        cut_short = {"content": text, "tool_calls": [], "finish_reason": "length"}
        assert _streamed(served, **kw, max_tokens=cut, n=2) == {0: cut_short, 1: cut_short}


def test_a_whole_call_s_arguments_are_spelled_alike_in_every_mode(served) -> None:
    """The same call (one tool, one allowed value) from ``required`` and from a named tool_choice, streamed
    and not: the same arguments text, compact JSON."""
    utc = {
        "type": "object",
        "properties": {"zone": {"enum": ["utc"]}},
        "required": ["zone"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": utc}}]
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(
        model="all-r4",
        messages=MESSAGES,
        tools=tools,
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    seen = []
    for choice in ("required", named):
        whole = served.client.chat.completions.create(**kw, tool_choice=choice).choices[0]
        (streamed,) = _streamed(served, **kw, tool_choice=choice).values()
        assert whole.finish_reason == streamed["finish_reason"] == "tool_calls"
        assert whole.message.content is None and streamed["content"] is None
        seen += [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        seen += [(c["function"]["name"], c["function"]["arguments"]) for c in streamed["tool_calls"]]
    assert seen == [("get_time", '{"zone":"utc"}')] * 4


def test_each_of_n_choices_is_a_call_or_cut_short_on_its_own(served) -> None:
    """n sampled choices under one max_tokens: those whose call fits are calls, the others content cut short
    (this seed draws both: a get_time call is shorter than a get_weather one), the stream saying the same."""
    kw = dict(
        model="all-r4",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=56,
        temperature=1.0,
        seed=7,
        n=8,
    )
    chat = served.client.chat.completions.create(**kw)
    streamed = _streamed(served, **kw)
    assert sorted(streamed) == [c.index for c in chat.choices] == list(range(8))
    for choice in chat.choices:
        got = streamed[choice.index]
        assert got["finish_reason"] == choice.finish_reason and got["content"] == choice.message.content
        if choice.finish_reason == "tool_calls":
            (call,) = choice.message.tool_calls
            assert choice.message.content is None and call.function.arguments == _compact(_valid(call))
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in got["tool_calls"]] == [
                (call.function.name, call.function.arguments)
            ]
        else:
            assert choice.finish_reason == "length" and choice.message.tool_calls is None
            assert choice.message.content.startswith('[{"name":"get_') and got["tool_calls"] == []
            with pytest.raises(ValueError):
                json.loads(choice.message.content)
    assert {c.finish_reason for c in chat.choices} == {"tool_calls", "length"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_what_a_reply_said_is_accepted_back_as_history(served, stream) -> None:
    """The assistant turn as the client got it (the SDK's ``message.model_dump()``, None fields and all, or
    the streamed deltas put together), sent back: a cut call's content, or the calls with their results. The
    prompt is the template's tokens for that conversation."""
    for mode, max_tokens in (("named", 8), ("named", 60), ("required", 8), ("required", 120)):
        kw = dict(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=FORCED[mode],
            max_tokens=max_tokens,
            temperature=0,
        )
        if stream:
            got = _streamed(served, **kw)[0]
            turn = {"role": "assistant", "content": got["content"], "tool_calls": got["tool_calls"] or None}
        else:
            turn = served.client.chat.completions.create(**kw).choices[0].message.model_dump()
        calls = turn["tool_calls"] or []
        assert bool(calls) == (max_tokens > 8) and bool(turn["content"]) == (max_tokens == 8)
        results = [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in calls]
        again = served.client.chat.completions.create(
            model=MODEL, messages=[*MESSAGES, turn, *results], tools=TOOLS, max_tokens=2, temperature=0
        )
        rendered: dict = {"role": "assistant", "content": turn["content"] or ""}
        if calls:
            rendered["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in calls
            ]
        expected = _template_tokens(served, [*MESSAGES, rendered, *results], TOOLS)
        assert again.usage.prompt_tokens == expected, (mode, max_tokens)


# one call of get_weather as each mode's reply may spell it
REPLIES = {
    "auto": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
    "required": '[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
    "named": '{"city":"Oslo","days":2}',
}


@pytest.mark.parametrize("mode", list(REPLIES))
def test_n_choices_each_a_call_or_cut_short_in_every_mode(mode) -> None:
    """The responses built for two choices, one whose call is whole and one cut short by max_tokens, from
    the worker's messages as they come (interleaved when streamed): the tiny model writes no call of its own
    with ``auto``, so its messages are given here."""
    use = ToolUse(tuple(pb.Tool(name=t["function"]["name"]) for t in TOOLS), mode, None)
    if mode == "named":
        use = ToolUse(use.tools, mode, "get_weather")
    shape = Shape(id="chatcmpl-1", model=MODEL, chat=True, logprobs=False, tools=use)
    whole_text = REPLIES[mode]
    cut = whole_text[: whole_text.index("Oslo") + 2]
    replies = [(whole_text, pb.FINISH_REASON_EOS), (cut, pb.FINISH_REASON_LENGTH)]
    messages = []
    for text, finish in replies:
        msgs = [pb.GenerateResponse(text=text[i : i + 5]) for i in range(0, len(text), 5)]
        msgs[-1].finish_reason = finish
        messages.append(msgs)
    arguments = '{"city":"Oslo","days":2}'  # in every mode

    choices = [Choice() for _ in messages]
    for c, msgs in zip(choices, messages, strict=True):
        for m in msgs:
            c.add(m)
    called, cut_short = shape.whole([(0, c) for c in choices], (1, 2))["choices"]
    (call,) = called["message"].pop("tool_calls")
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": arguments}
    assert called["message"] == {"role": "assistant", "content": None}
    assert called["finish_reason"] == "tool_calls"
    assert cut_short["message"] == {"role": "assistant", "content": cut}
    assert cut_short["finish_reason"] == "length"

    streams = [shape.call_stream() for _ in messages]
    said: list[list[dict]] = [[], []]
    for k in range(max(len(m) for m in messages)):
        for i, msgs in enumerate(messages):
            if k < len(msgs):
                said[i].append(shape.chunk(msgs[k], 0, k == 0, i, 0, streams[i])["choices"][0])
    for i, chunks in enumerate(said):
        assert {c["index"] for c in chunks} == {i}
        assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    called_deltas, cut_deltas = ([c["delta"] for c in chunks] for chunks in said)
    assert not "".join(d.get("content") or "" for d in called_deltas)
    streamed_calls = [tc for d in called_deltas for tc in d.get("tool_calls", [])]
    assert [(tc["index"], tc["type"], tc["function"]) for tc in streamed_calls] == [
        (0, "function", {"name": "get_weather", "arguments": arguments})
    ]
    assert said[0][-1]["finish_reason"] == "tool_calls"
    assert "".join(d["content"] for d in cut_deltas) == cut
    assert all("tool_calls" not in d for d in cut_deltas) and said[1][-1]["finish_reason"] == "length"


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
