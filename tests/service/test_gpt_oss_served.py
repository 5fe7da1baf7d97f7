"""`tokenmill-server --model` a tiny gpt-oss checkpoint whose tokenizer has harmony's control tokens: chats
are rendered with openai-harmony, and the answer's analysis channel comes back apart from the final one,
as ``reasoning_content`` through the OpenAI SDK (whole and streamed) and as ``reasoning_text`` over gRPC.
The random model is steered into a harmony answer by a grammar (its control tokens included). Tools are
offered, called and answered as openai-harmony renders them; a forced tool_choice makes the random model
call one, and the call comes back in OpenAI's shape and over gRPC. A JSON schema or a regex constrains the
final channel's text, which comes back as the answer; the schema is described to the model in the developer
message, as harmony's guide writes it.

Needs o200k_base.tiktoken in .tools/tiktoken (`make tools`), which openai-harmony reads."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tests.server_process import ServerProcess
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tokenmill_client import ChatMessage, Client, FinishReason
from tokenmill_service.contract.chat import harmony
from tokenmill_service.contract.tokenizer.load import load_tokenizer
from tokenmill_service.front.proto import pb
from tokenmill_service.front.validation import InvalidRequest, prompt_ids

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
oh = pytest.importorskip("openai_harmony")

VOCABULARY = Path(__file__).resolve().parents[2] / ".tools" / "tiktoken"
CONTROL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
REASONING, ANSWER = "Hm.", "Hi."
# A harmony answer: the analysis channel, then the final one, then the end of the turn.
GRAMMAR = (
    f'start: <|channel|> "analysis" <|message|> "{REASONING}" <|end|> '
    f'<|start|> "assistant" <|channel|> "final" <|message|> "{ANSWER}" <|return|>'
)


@pytest.fixture(scope="module", autouse=True)
def harmony_vocabulary() -> None:
    if not (VOCABULARY / harmony.VOCABULARY).is_file():
        pytest.fail(f"{VOCABULARY / harmony.VOCABULARY} is missing: run `make tools`")
    mp = pytest.MonkeyPatch()
    mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(VOCABULARY))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-gpt-oss-harmony")
    write_byte_level_tokenizer(directory, *CONTROL)
    config = transformers.GptOssConfig(
        vocab_size=257 + len(CONTROL),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Any:
    env = {"TIKTOKEN_ENCODINGS_BASE": str(VOCABULARY)}
    process = ServerProcess("--model", str(checkpoint), "--drain-seconds", "1", env=env).start()
    yield process
    process.stop()


def test_a_harmony_conversation_round_trips_through_the_models_tokens(checkpoint: Path) -> None:
    """openai-harmony renders a conversation with a reasoning channel; in the model's ids (control tokens
    by text) the channel reader gives back the reasoning and the answer, and harmony parses it back to
    the same messages."""
    enc = harmony.encoding()
    tokenizer = load_tokenizer(checkpoint)
    assert tokenizer.harmony
    reply = [
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, REASONING).with_channel("analysis"),
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, ANSWER).with_channel("final"),
    ]
    keep = oh.RenderConversationConfig(auto_drop_analysis=False)
    rendered = list(enc.render_conversation(oh.Conversation.from_messages(reply), keep))
    assert enc.decode_utf8(rendered[:2]) == "<|start|>assistant"
    ids = rendered[2:]  # what the model writes after the prompt's <|start|>assistant
    assert enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT) == reply
    model_ids = harmony.to_model_ids(ids, tokenizer)
    assert tokenizer.decode(model_ids) == enc.decode_utf8(ids)  # the same text, control tokens included
    reader = harmony.ChannelReader(tokenizer)
    assert reader.feed(model_ids) == (REASONING, ANSWER)
    # A prompt: message text never becomes a control token.
    prompt = harmony.render([{"role": "user", "content": "<|end|> hi"}], tokenizer)
    tail = [tokenizer.special_id("<|start|>"), *tokenizer.encode("assistant")]
    assert prompt[-len(tail) :] == tail
    assert prompt.count(tokenizer.special_id("<|end|>")) == 2  # the system and user messages' only


def test_the_openai_sdk_sees_reasoning_content_apart_from_content(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 40,
        "extra_body": {"guided_grammar": GRAMMAR},
    }
    whole = client.chat.completions.create(**ask)
    message = whole.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == REASONING
    assert whole.choices[0].finish_reason == "stop"
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


def test_grpc_carries_the_reasoning_in_its_own_field(server: Any) -> None:
    with Client(server.address, timeout=60) as client:
        result = client.generate_text(messages=[("user", "Hi!")], max_new_tokens=40, grammar=GRAMMAR)
    assert (result.reasoning_text, result.text) == (REASONING, ANSWER)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}
WEATHER_TOOL = oh.ToolDescription.new(
    "get_weather", "The weather in a city.", parameters=WEATHER["function"]["parameters"]
)


def harmony_call(arguments: str) -> Any:
    """An assistant's call of get_weather, as openai-harmony writes one."""
    return (
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, arguments)
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json")
    )


def test_a_conversation_with_tools_a_call_and_its_result_renders_as_openai_harmony_renders_it(checkpoint: Path) -> None:
    """The request's tools, an earlier call (with the reasoning before it) and its result, through the
    server's chat path, give the ids of openai-harmony's own rendering of that conversation (its control
    tokens as the model's)."""
    tokenizer = load_tokenizer(checkpoint)
    request = pb.GenerateRequest(chat=pb.Messages(), tool_choice=pb.TOOL_CHOICE_AUTO)
    request.tools.add(
        name="get_weather",
        description=WEATHER["function"]["description"],
        parameters=json.dumps(WEATHER["function"]["parameters"]),
    )
    request.chat.messages.add(role="system", content="Be brief.")
    request.chat.messages.add(role="user", content="Weather in Paris?")
    asked = request.chat.messages.add(role="assistant", reasoning="Ask the tool.")
    asked.tool_calls.add(id="call_1", name="get_weather", arguments='{"city":"Paris"}')
    request.chat.messages.add(role="tool", tool_call_id="call_1", content='{"celsius": 21}')
    ours = prompt_ids(request, tokenizer, tokenizer.vocab_size)

    developer = oh.DeveloperContent.new().with_instructions("Be brief.").with_function_tools([WEATHER_TOOL])
    result = oh.Author.new(oh.Role.TOOL, "functions.get_weather")
    conversation = oh.Conversation.from_messages(
        [
            oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new()),
            oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer),
            oh.Message.from_role_and_content(oh.Role.USER, "Weather in Paris?"),
            oh.Message.from_role_and_content(oh.Role.ASSISTANT, "Ask the tool.").with_channel("analysis"),
            harmony_call('{"city":"Paris"}'),
            oh.Message.from_author_and_content(result, '{"celsius": 21}')
            .with_channel("commentary")
            .with_recipient("assistant"),
        ]
    )
    enc = harmony.encoding()
    theirs = list(enc.render_conversation_for_completion(conversation, oh.Role.ASSISTANT))
    assert ours == harmony.to_model_ids(theirs, tokenizer)
    text = enc.decode_utf8(theirs)
    assert "type get_weather = (_: {" in text and "to=functions.get_weather" in text and "Ask the tool." in text
    # A tool message that answers no call it can name is refused, saying what to give.
    request.chat.messages[-1].tool_call_id = "call_2"
    with pytest.raises(InvalidRequest, match="answers no earlier call"):
        prompt_ids(request, tokenizer, tokenizer.vocab_size)
    # A called function's name goes into a header, where a space would change what it says.
    asked.tool_calls[0].name = "get weather"
    with pytest.raises(InvalidRequest, match=r"tool_calls\[0\]'s function name must be"):
        prompt_ids(request, tokenizer, tokenizer.vocab_size)


def test_a_commentary_message_to_a_function_is_read_as_a_tool_call_and_ends_the_turn(checkpoint: Path) -> None:
    """openai-harmony's encoding of an answer that reasons, then calls get_weather: the reader gives the
    reasoning, no answer text, and the call; <|call|> is one of the tokenizer's stop tokens, as harmony's
    stop tokens for assistant actions say."""
    enc = harmony.encoding()
    tokenizer = load_tokenizer(checkpoint)
    reply = [
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, REASONING).with_channel("analysis"),
        harmony_call('{"city": "Oslo"}'),
    ]
    rendered = list(enc.render_conversation(oh.Conversation.from_messages(reply)))
    ids = rendered[2:]  # after the prompt's <|start|>assistant
    assert enc.decode_utf8(ids[-1:]) == "<|call|>"
    assert enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT) == reply
    reader = harmony.ChannelReader(tokenizer, calls=True)
    assert reader.feed(harmony.to_model_ids(ids, tokenizer)) == (REASONING, "")
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_weather", '{"city": "Oslo"}')]
    assert reader.calls[0].id.startswith("call_")
    # The recipient after the channel (as gpt-oss writes it, and as the forced-call grammar does).
    after = enc.encode(
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        allowed_special="all",
    )
    assert enc.parse_messages_from_completion_tokens(after, oh.Role.ASSISTANT) == [harmony_call('{"city": "Paris"}')]
    reader = harmony.ChannelReader(tokenizer, calls=True)
    assert reader.feed(harmony.to_model_ids(after, tokenizer)) == ("", "")
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_weather", '{"city": "Paris"}')]
    stops = {tokenizer.special_id(enc.decode_utf8([t])) for t in enc.stop_tokens_for_assistant_actions()}
    assert None not in stops and stops <= tokenizer.stop_token_ids


def test_the_openai_sdk_gets_the_call_a_forced_tool_choice_makes(server: Any, checkpoint: Path) -> None:
    """tool_choice naming get_weather: the call is made in harmony's syntax under the grammar, and the
    SDK reads it back (whole and streamed) with finish_reason tool_calls; then the conversation goes on
    with the call and its result in the history."""
    end = load_tokenizer(checkpoint).special_id("<|end|>")
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": messages,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 150,
        "temperature": 0,
        "logit_bias": {str(end): 30},
    }
    with ThreadPoolExecutor(2) as pool:  # side by side: one batch, half the decoding steps
        streaming = pool.submit(lambda: list(client.chat.completions.create(**ask, stream=True)))
        whole = client.chat.completions.create(**ask)
        chunks = streaming.result()
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert choice.message.content is None
    streamed: dict[int, dict[str, str]] = {}
    finish, reasoning = None, ""
    for chunk in chunks:
        for c in chunk.choices:
            assert not c.delta.content
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            for d in c.delta.tool_calls or []:
                one = streamed.setdefault(d.index, {"name": "", "arguments": ""})
                one["name"] += d.function.name or ""
                one["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls", chunks
    assert streamed == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert reasoning == (choice.message.model_extra or {}).get("reasoning_content", "")
    # The answer's turn goes back with its reasoning, which the model sees again before its call.
    turn = {**choice.message.model_dump(exclude_none=True), "content": "", "reasoning_content": "Ask the tool."}
    messages += [turn, {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
    goes_on = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=1)
    tokenizer = load_tokenizer(checkpoint)
    assert goes_on.usage.prompt_tokens == len(tokenizer.encode_chat(messages, tools=[WEATHER]))
    assert goes_on.usage.prompt_tokens > len(
        tokenizer.encode_chat([*messages[:1], {**turn, "reasoning_content": ""}, *messages[2:]], tools=[WEATHER])
    )


def test_grpc_returns_the_call_tool_choice_required_makes(server: Any, checkpoint: Path) -> None:
    """Over gRPC the call comes in the last response's tool_calls; the client's answer turn (its calls and
    reasoning) and the tool's result continue the conversation, rendered as harmony renders them."""
    tokenizer = load_tokenizer(checkpoint)
    with Client(server.address, timeout=60) as client:
        result = client.generate_text(
            messages=[("user", "Weather?")],
            tools=[WEATHER],
            tool_choice="required",
            max_new_tokens=150,
            temperature=0,
            logit_bias={tokenizer.special_id("<|end|>"): 30},
        )
        assert result.finish_reason == FinishReason.TOOL_CALLS
        (call,) = result.tool_calls
        assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
        assert result.text == ""
        turn = result.message()
        assert (turn.tool_calls, turn.reasoning) == ((call,), result.reasoning_text)
        history = [("user", "Weather?"), turn, ChatMessage("tool", "21 C", tool_call_id=call.id)]
        goes_on = client.generate_text(messages=history, tools=[WEATHER], max_new_tokens=1, temperature=0)
    calls = [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]
    rendered = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": calls, "reasoning_content": result.reasoning_text},
        {"role": "tool", "content": "21 C", "tool_call_id": call.id},
    ]
    assert goes_on.usage.prompt_tokens == len(tokenizer.encode_chat(rendered, tools=[WEATHER]))


ORDER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


# The "# Response Formats" section OpenAI's harmony guide (docs/format.md, "Structured output") puts at the end of
# the developer message: the format's name, its description as a comment, the schema as compact JSON.
ORDER_SECTION = (
    "# Response Formats\n\n## order\n\n// A trip to book.\n"
    '{"type":"object","properties":{"city":{"type":"string","enum":["Paris","Oslo"]},'
    '"days":{"type":"integer","minimum":1,"maximum":9}},"required":["city","days"],"additionalProperties":false}'
)


def developer_text(text: str) -> Any:
    """A developer message of plain text, as openai-harmony renders one."""
    return oh.Message.from_role_and_content(oh.Role.DEVELOPER, text)


def order_request(*messages: tuple[str, str]) -> pb.GenerateRequest:
    request = pb.GenerateRequest(json_schema=json.dumps(ORDER), json_schema_name="order")
    request.json_schema_description = "A trip to book."
    for role, content in messages:
        request.chat.messages.add(role=role, content=content)
    return request


def test_a_json_schema_is_described_at_the_end_of_the_developer_message_as_harmonys_guide_writes_it(
    checkpoint: Path,
) -> None:
    """The prompt of a chat whose answer must match a JSON schema is openai-harmony's rendering of the same
    conversation with the guide's section at the end of the developer message: after the instructions (a
    blank line between, as harmony joins sections), after the tools when tools are offered, or alone in a
    developer message of its own when the caller gave none."""
    tokenizer = load_tokenizer(checkpoint)
    enc = harmony.encoding()
    system = oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new())
    user = oh.Message.from_role_and_content(oh.Role.USER, "A trip?")

    def reference(*messages: Any) -> list[int]:
        conversation = oh.Conversation.from_messages([system, *messages, user])
        return harmony.to_model_ids(enc.render_conversation_for_completion(conversation, oh.Role.ASSISTANT), tokenizer)

    request = order_request(("system", "Be brief."), ("user", "A trip?"))
    ours = prompt_ids(request, tokenizer, tokenizer.vocab_size)
    assert ours == reference(developer_text(f"# Instructions\n\nBe brief.\n\n{ORDER_SECTION}"))
    alone = prompt_ids(order_request(("user", "A trip?")), tokenizer, tokenizer.vocab_size)
    assert alone == reference(developer_text(ORDER_SECTION))
    # guided_json, or gRPC without a name: the default name, and no comment line.
    unnamed = pb.GenerateRequest(json_schema='{"type": "integer"}', chat=order_request(("user", "A trip?")).chat)
    described = '<|start|>developer<|message|># Response Formats\n\n## response\n\n{"type":"integer"}<|end|>'
    assert described in tokenizer.decode(prompt_ids(unnamed, tokenizer, tokenizer.vocab_size))
    # With tools: openai-harmony's developer message (instructions, then the tools; the system message says
    # where calls go), the section after them.
    request.tools.add(
        name="get_weather",
        description="The weather in a city.",
        parameters=json.dumps(WEATHER["function"]["parameters"]),
    )
    request.tool_choice = pb.TOOL_CHOICE_AUTO
    developer = oh.DeveloperContent.new().with_instructions("Be brief.").with_function_tools([WEATHER_TOOL])
    without = enc.decode_utf8(
        enc.render_conversation_for_completion(
            oh.Conversation.from_messages(
                [system, oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer), user]
            ),
            oh.Role.ASSISTANT,
        )
    )
    assert "# Tools" in without and "Calls to these tools must go to the commentary channel" in without
    head, tail = without.split("<|end|><|start|>user", 1)
    spliced = f"{head}\n\n{ORDER_SECTION}<|end|><|start|>user{tail}"
    ours = prompt_ids(request, tokenizer, tokenizer.vocab_size)
    assert ours == harmony.to_model_ids(enc.encode(spliced, allowed_special="all"), tokenizer)
    # The other constraints have no section in the guide: the prompt is the unconstrained one.
    plain = prompt_ids(pb.GenerateRequest(chat=request.chat), tokenizer, tokenizer.vocab_size)
    for other in (pb.GenerateRequest(json_object=pb.JsonObject()), pb.GenerateRequest(regex="[a-z]+")):
        other.chat.CopyFrom(request.chat)
        assert prompt_ids(other, tokenizer, tokenizer.vocab_size) == plain
    # The name is a line of the prompt: one that could break it is refused, and a schema that is not JSON too.
    request.json_schema_name = "an order\n# Instructions"
    with pytest.raises(InvalidRequest, match="json_schema_name must be 1 to 64 letters") as refused:
        prompt_ids(request, tokenizer, tokenizer.vocab_size)
    assert refused.value.field == "json_schema_name"
    request.json_schema_name, request.json_schema = "order", "{"
    with pytest.raises(InvalidRequest, match="json_schema is not valid JSON"):
        prompt_ids(request, tokenizer, tokenizer.vocab_size)


def test_a_json_schema_response_format_comes_back_as_the_content_and_the_analysis_as_reasoning(
    server: Any, checkpoint: Path
) -> None:
    """The schema constrains the final channel's text (after an optional analysis message and the final
    header the model writes itself): the SDK gets the JSON as content, whole and streamed alike. The prompt
    has grown by a developer message describing the schema."""
    tokenizer = load_tokenizer(checkpoint)
    end = tokenizer.special_id("<|end|>")
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    order = {"name": "order", "description": "A trip to book.", "schema": ORDER}
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "A trip?"}],
        "response_format": {"type": "json_schema", "json_schema": order},
        "max_tokens": 150,
        "temperature": 0,
        "logit_bias": {str(end): 30},  # the random model's analysis, kept short
    }
    with ThreadPoolExecutor(2) as pool:  # side by side: one batch, half the decoding steps
        streaming = pool.submit(lambda: list(client.chat.completions.create(**ask, stream=True)))
        whole = client.chat.completions.create(**ask)
        chunks = streaming.result()
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), ORDER)
    section = harmony.to_model_ids(harmony.encoding().render(developer_text(ORDER_SECTION)), tokenizer)
    assert whole.usage.prompt_tokens == len(tokenizer.encode_chat(ask["messages"])) + len(section)
    reasoning = (choice.message.model_extra or {}).get("reasoning_content") or ""
    assert "<|" not in reasoning + choice.message.content
    streamed = {"content": "", "reasoning": "", "finish": None}
    for chunk in chunks:
        for c in chunk.choices:
            streamed["content"] += c.delta.content or ""
            streamed["reasoning"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
            streamed["finish"] = c.finish_reason or streamed["finish"]
    assert streamed == {"content": choice.message.content, "reasoning": reasoning, "finish": "stop"}


def test_a_regex_constraint_over_grpc_is_the_answers_text_matched_whole(server: Any, checkpoint: Path) -> None:
    """The answer goes through an analysis message (the bias on "a" picks the analysis channel over the
    final one) and then the final channel's header, which the model writes; only the final text is the
    answer, matched whole."""
    pattern = r"(yes|no): [0-9]{1,3}"
    tokenizer = load_tokenizer(checkpoint)
    (a,) = tokenizer.encode("a")
    with Client(server.address, timeout=60) as client:
        result = client.generate_text(
            messages=[("user", "Well?")],
            regex=pattern,
            max_new_tokens=150,
            temperature=0,
            logit_bias={a: 10, tokenizer.special_id("<|end|>"): 30},
        )
    assert result.finish_reason == FinishReason.EOS, result
    assert re.fullmatch(pattern, result.text), result.text
    assert tokenizer.decode([t.id for t in result.tokens]) == (
        f"<|channel|>analysis<|message|>{result.reasoning_text}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{result.text}<|return|>"
    )


def test_without_its_vocabulary_a_harmony_chat_is_refused_saying_why(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tokenizer = load_tokenizer(checkpoint)
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    monkeypatch.chdir(tmp_path)  # no .tools/tiktoken here either
    harmony.encoding.cache_clear()
    try:
        with pytest.raises(ValueError, match="o200k_base.tiktoken.*TIKTOKEN_ENCODINGS_BASE.*make tools"):
            tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    finally:
        harmony.encoding.cache_clear()


def test_from_the_checkout_the_vocabulary_is_found_without_the_variable(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = load_tokenizer(checkpoint)
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    monkeypatch.chdir(VOCABULARY.parents[1])  # the checkout, where `make tools` wrote .tools/tiktoken
    harmony.encoding.cache_clear()
    try:
        assert tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
        assert os.environ["TIKTOKEN_ENCODINGS_BASE"] == str(VOCABULARY)
    finally:
        monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
        harmony.encoding.cache_clear()
