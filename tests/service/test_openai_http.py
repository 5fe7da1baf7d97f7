"""The OpenAI-compatible HTTP API end to end: the real `openai` client (and curl) against a live server.

One server in its default configuration serves the whole module; auth (401) and a full queue (429)
are checked in test_service_lifecycle.py, whose server is configured for them.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from tests.server_process import ServerProcess, reflected_services
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc
from tokenmill_service.contract.config import Settings

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "tokenmill"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pb_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def finished_events(server: ServerProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in server.logs().splitlines() if '"request_finished"' in line]


# -- chat completions --------------------------------------------------------------------------


def test_chat_completion_answers_with_the_assistant_message_and_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")


def test_a_streamed_chat_gives_the_same_text_as_the_whole_answer_and_ends_with_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=FRANCE,  # type: ignore[arg-type]
            max_completion_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_chat_logprobs_come_with_top_alternatives_most_likely_first(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=FRANCE,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(t.token for t in content) == reply.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob


def test_a_seeded_sampled_request_gives_the_same_output_twice(client: openai.OpenAI) -> None:
    def ask() -> str | None:
        return (
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me a story."}],
                max_tokens=8,
                temperature=1.0,
                seed=1234,
                extra_body={"top_k": 50, "repetition_penalty": 1.1},
            )
            .choices[0]
            .message.content
        )

    assert ask() == ask()


def test_a_stop_string_ends_the_answer_before_it(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    text = free.choices[0].text
    word = text.split()[1]  # a word from the middle of the greedy answer
    stopped = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stop=[word]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(word)]


# -- completions --------------------------------------------------------------------------------


def test_completion_streamed_and_not_with_logprobs_in_the_completions_shape(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage is not None and whole.usage.completion_tokens == 5
    lp = choice.logprobs
    assert lp is not None and lp.tokens and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs is not None and len(lp.token_logprobs) == 5
    assert lp.top_logprobs is not None and all(len(alts) == 2 for alts in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    streamed = list(
        client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == "length"


# -- neutral values, penalties and logit bias ---------------------------------------------------


def test_parameters_at_their_neutral_values_are_accepted_as_no_ops(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    neutral = client.chat.completions.create(
        model=MODEL,
        messages=FRANCE,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        parallel_tool_calls=False,
        logit_bias={},
        presence_penalty=0,
        frequency_penalty=0,
        n=1,
        user="someone",
        store=False,
        metadata={"team": "search"},
        seed=5,
        stream_options=None,
        extra_body={"modalities": ["text"]},
    )
    assert neutral.choices[0].message.content == plain.choices[0].message.content
    completion = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, echo=False, best_of=1, suffix="", user="x"
    )
    assert completion.choices[0].finish_reason == "length"


def greedy_tokens(stub: pb_grpc.GenerationStub, prompt: str, n: int, **sampling: Any) -> list[pb.Token]:
    request = pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(**sampling),
        stopping=pb.StoppingParams(max_new_tokens=n, ignore_eos=True),
    )
    return [t for r in stub.Generate(request, timeout=600) for t in r.tokens]


def greedy_ids(stub: pb_grpc.GenerationStub, prompt: str, n: int, **sampling: Any) -> list[int]:
    return [t.id for t in greedy_tokens(stub, prompt, n, **sampling)]


def test_logit_bias_bans_a_token_the_same_over_http_and_grpc(
    client: openai.OpenAI, stub: pb_grpc.GenerationStub
) -> None:
    prompt = "The capital of France is"
    first = greedy_ids(stub, prompt, 1)[0]
    banned = greedy_tokens(stub, prompt, 4, logit_bias={first: -100.0})
    assert first not in [t.id for t in banned]
    reply = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logit_bias={str(first): -100},
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == [t.text for t in banned]


def test_frequency_and_presence_penalties_steer_away_from_repeats_over_http_and_grpc(
    client: openai.OpenAI, stub: pb_grpc.GenerationStub
) -> None:
    prompt = "1 1 1 1 1 1 1 1 1 1 1 1"
    plain = greedy_ids(stub, prompt, 16)
    penalized = greedy_ids(stub, prompt, 16, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(penalized)) > len(set(plain))
    only_frequency = greedy_ids(stub, prompt, 16, frequency_penalty=2.0)
    assert only_frequency != penalized

    def http_text(**penalties: float) -> str:
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}, **penalties
        )
        return reply.choices[0].text

    def grpc_text(**penalties: float) -> str:
        request = pb.GenerateRequest(
            prompt=prompt,
            sampling=pb.SamplingParams(**penalties),
            stopping=pb.StoppingParams(max_new_tokens=16, ignore_eos=True),
        )
        return "".join(r.text for r in stub.Generate(request, timeout=600))

    both = {"frequency_penalty": 2.0, "presence_penalty": 2.0}
    assert http_text(**both) == grpc_text(**both) != grpc_text()


@pytest.mark.parametrize(
    ("params", "names"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        # A schema bound beyond the grammar's 64-bit integers: refused, not clamped (1e400: test_front_door.py).
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": {"properties": {"a": {"type": "integer", "minimum": 1e300}}},
                    },
                }
            },
            "properties.a.minimum is 1e+300: a bound must lie within",
        ),
        # Integers beyond what the request's fields hold: refused by name (they were "Value out of range").
        ({"max_completion_tokens": 10**12}, "'max_completion_tokens' must be <= 4294967295"),
        ({"seed": 2**70}, "'seed' must be <= 18446744073709551615"),
        ({"n": 2**33}, "'n' must be <= 4294967295"),
        ({"extra_body": {"top_k": 2**40}}, "'top_k' must be <= 2147483647"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"logit_bias": {"49152": 1}}, "logit_bias names token 49152, outside the vocabulary"),
        ({"logit_bias": {"5": 101}}, "logit_bias[5] must be in [-100, 100]"),
        ({"logit_bias": {"five": 1}}, "'logit_bias' keys must be token ids"),
        ({"response_format": {"type": "xml"}}, "'response_format.type' must be 'text', 'json_object' or 'json_schema'"),
        ({"tools": [{"type": "function"}]}, "tools[0] must be {'type': 'function', 'function': {'name': ...}}"),
        ({"tool_choice": "required"}, "'tool_choice' asks for a call but no 'tools' are given"),
        ({"functions": [{"name": "f"}]}, "'functions' is not supported"),
    ],
)
def test_a_value_out_of_range_or_not_neutral_is_a_400_naming_it(
    client: openai.OpenAI, params: dict[str, Any], names: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2, **params)  # type: ignore[arg-type]
    assert names in err.value.message


# -- a prompt near the end of the context -------------------------------------------------------


# -- echo, prompt logprobs and lists of prompts (what lm-evaluation-harness sends) -----------------


def grpc_prompt_tokens(stub: pb_grpc.GenerationStub, prompt: str) -> list[pb.Token]:
    request = pb.GenerateRequest(
        prompt=prompt, stopping=pb.StoppingParams(max_new_tokens=1), prompt_logprobs=True, top_logprobs=1
    )
    return list(next(iter(stub.Generate(request, timeout=600))).prompt_tokens)


def test_echo_with_logprobs_scores_the_prompt_in_the_legacy_shape_as_grpc_does(
    client: openai.OpenAI, stub: pb_grpc.GenerationStub
) -> None:
    prompt = "The capital of France is Paris."
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    (choice,) = reply.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 0
    expected = grpc_prompt_tokens(stub, prompt)
    lp = choice.logprobs
    assert lp is not None and lp.tokens == [t.text for t in expected]
    assert lp.token_logprobs == [None, *[t.logprob for t in expected[1:]]]
    assert lp.top_logprobs == [None, *[{a.text: a.logprob for a in t.top_logprobs} for t in expected[1:]]]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    # One token more: the prompt's, then the generated one's (lm-eval asks for max_tokens 1 and drops it).
    more = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    more_lp = more.choices[0].logprobs
    assert more.choices[0].text.startswith(prompt) and more_lp is not None and more_lp.token_logprobs is not None
    assert more_lp.token_logprobs[:-1] == lp.token_logprobs and len(more_lp.token_logprobs) == len(expected) + 1

    streamed = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed).startswith(prompt)

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "max_tokens"


def test_a_list_of_prompts_is_answered_with_one_choice_each(
    client: openai.OpenAI, stub: pb_grpc.GenerationStub
) -> None:
    prompts = ["The capital of France is Paris.", "Hello there, how are you?"]
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=0, echo=True, logprobs=1).choices[0]
        for p in prompts
    ]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == prompts
    for single, choice in zip(singles, batch.choices):
        assert choice.logprobs == single.logprobs  # each prompt scored as alone: batch invariance
    ids = [list(stub.Tokenize(pb.TokenizeRequest(text=p), timeout=30).ids) for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in by_ids.choices] == prompts
    assert [c.logprobs for c in by_ids.choices] == [c.logprobs for c in singles]
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == sum(len(i) for i in ids)

    generated = client.completions.create(model=MODEL, prompt=["The sky is", "Paris is"], max_tokens=4, temperature=0)
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        for p in ["The sky is", "Paris is"]
    ]
    assert [c.text for c in generated.choices] == [a.choices[0].text for a in alone]
    assert generated.usage is not None and generated.usage.completion_tokens == 8


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize(
    ("params", "names", "param", "code"),
    [
        ({"temperature": -1}, "temperature must be >= 0", "temperature", "invalid_value"),
        ({"n": 17}, "n must be <= 16", "n", "integer_above_max_value"),
        ({"max_tokens": 100000}, "max_tokens must be <= 4096", "max_tokens", "integer_above_max_value"),
        (
            {"max_completion_tokens": 100000},
            "max_completion_tokens must be <= 4096",
            "max_completion_tokens",
            "integer_above_max_value",
        ),
        ({"top_logprobs": 3}, "'top_logprobs' needs 'logprobs'", "top_logprobs", "invalid_value"),
        (
            {"logprobs": True, "top_logprobs": 50},
            "top_logprobs must be <= 20",
            "top_logprobs",
            "integer_above_max_value",
        ),
        ({"stop": ["x", ""]}, "stop[1] is empty", "stop", "invalid_value"),
        ({"extra_body": {"top_k": -1}}, "top_k must be >= 0", "top_k", "invalid_value"),
        (
            {"response_format": {"type": "json_schema"}},
            "'response_format.json_schema' must be an object with a 'schema'",
            "response_format",
            "invalid_value",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "json_schema: the json_schema cannot be used",
            "response_format",
            "invalid_value",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "an order", "schema": {}}}},
            "'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'",
            "response_format.json_schema.name",
            "invalid_value",
        ),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it_as_the_caller_did_with_param_and_code(
    client: openai.OpenAI, params: dict[str, Any], names: str, param: str, code: str, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=FRANCE, stream=stream, **params)  # type: ignore[arg-type,call-overload]
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    assert names in body["message"] and "sampling." not in body["message"] and "stopping." not in body["message"]
    assert (body["param"], body["code"]) == (param, code)


def test_an_unknown_parameter_is_a_400_naming_it_as_openai_does(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2, extra_body={"temprature": 0.5})  # type: ignore[arg-type]
    assert isinstance(err.value.body, dict) and err.value.body["message"] == (
        "Unrecognized request argument supplied: temprature"
    )
    assert (err.value.body["param"], err.value.body["code"]) == ("temprature", "unknown_parameter")


@pytest.mark.parametrize(
    "params",
    [
        # Each was a 500 (a TypeError, an AttributeError in the parser).
        {"tools": [{"type": "function", "function": {"name": "add", "description": 5}}]},
        {"tools": [{"type": "function", "function": {"name": "add"}}], "tool_choice": {"function": 5}},
    ],
)
def test_a_tool_field_of_the_wrong_type_is_a_400(client: openai.OpenAI, params: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2, **params)  # type: ignore[arg-type]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize", "/detokenize", "/v1/load_lora_adapter"])
def test_a_body_that_is_not_utf8_is_a_400(server: ServerProcess, route: str) -> None:
    # (json.loads raised UnicodeDecodeError, which every route but the generating ones answered with a 500.)
    request = urllib.request.Request(server.http_url + route, b"\xff\xfe{", {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["code"] == "invalid_json"


def test_the_api_describes_itself_at_openapi_json(server: ServerProcess) -> None:
    status, body = get(server.http_url + "/openapi.json")
    doc = json.loads(body)
    assert status == 200 and doc["openapi"].startswith("3.1")
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    request = chat["requestBody"]["content"]["application/json"]["schema"]
    assert request["properties"]["max_tokens"]["maximum"] == Settings().max_new_tokens_limit
    assert {"200", "400", "413"} <= set(chat["responses"])


def test_the_completions_logprobs_count_is_named_logprobs(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=50)
    assert "logprobs must be <= 20" in err.value.message and "top_logprobs" not in err.value.message
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "logprobs"


def test_an_unknown_route_is_a_404_in_openai_error_json(server: ServerProcess) -> None:
    status, body = get(server.http_url + "/v1/audio/speech")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def test_a_client_that_disconnects_mid_stream_stops_its_generation(
    client: openai.OpenAI, stub: pb_grpc.GenerationStub, server: ServerProcess
) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="Count to one thousand:",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"x-request-id": "walks-away"},
    )
    received = 0
    for _ in stream:
        received += 1
        if received == 3:
            break
    stream.close()
    closed_at = time.monotonic()
    while stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).engine.running:
        assert time.monotonic() - closed_at < 10, "the engine still runs the abandoned request"
        time.sleep(0.02)
    events = [e for e in finished_events(server) if e.get("request_id") == "walks-away"]
    assert len(events) == 1 and events[0]["status"] == "CANCELLED"
    # Stopped within a few steps of the disconnect (the server notices it at its next write), far
    # from its 400 tokens. A step yields up to 1 + speculative_tokens of them: drafts guess
    # "Count to one thousand" well.
    per_step = 1 + Settings().speculative_tokens
    assert events[0]["completion_tokens"] <= received + 4 * per_step


# -- the same request through both front-ends -------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_http_and_grpc_give_the_same_tokens(
    client: openai.OpenAI, stub: pb_grpc.GenerationStub, seed: int | None
) -> None:
    temperature = 0.0 if seed is None else 0.8
    reply = client.chat.completions.create(
        model=MODEL,
        messages=FRANCE,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=temperature,
        seed=seed,
        logprobs=True,
    )
    http_tokens = [(t.token, round(t.logprob, 3)) for t in reply.choices[0].logprobs.content]  # type: ignore[union-attr]
    request = pb.GenerateRequest(
        chat=pb.Messages(messages=[pb.ChatMessage(role="user", content=FRANCE[0]["content"])]),
        sampling=pb.SamplingParams(temperature=temperature, seed=seed),
        stopping=pb.StoppingParams(max_new_tokens=6),
        logprobs=True,
    )
    grpc_tokens = [
        (t.text, round(t.logprob, 3)) for r in stub.Generate(request, timeout=600) for t in r.tokens if not t.special
    ]
    assert http_tokens == grpc_tokens


# -- curl, health, models, metrics ---------------------------------------------------------------


def test_curl_streams_server_sent_events_ending_with_done(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    out = subprocess.run(
        ["curl", "-sN", "--fail-with-body", server.http_url + "/v1/completions", "-H", "Content-Type: application/json"]
        + ["-d", json.dumps(body)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    events = [line for line in out.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def test_health_models_and_metrics_share_the_http_port(server: ServerProcess, client: openai.OpenAI) -> None:
    assert get(server.http_url + "/health") == (200, '{"status":"ready"}')
    models = client.models.list().data
    assert len(models) == 1 and "SmolLM2" in models[0].id
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)  # a call to count, whatever ran before
    status, metrics = get(server.http_url + "/metrics")
    assert status == 200 and 'tokenmill_requests_total{code="OK"}' in metrics


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tokenize_and_detokenize_answer_in_vllms_shapes(server: ServerProcess, stub: pb_grpc.GenerationStub) -> None:
    text = "The sky is blue."
    status, body = post(server.http_url + "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    expected = stub.Tokenize(pb.TokenizeRequest(text=text), timeout=30)
    context = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).context_length
    assert status == 200
    assert body == {
        "count": len(expected.ids),
        "max_model_len": context,
        "tokens": list(expected.ids),
        "token_strs": list(expected.pieces),
    }
    assert post(server.http_url + "/detokenize", {"model": MODEL, "tokens": body["tokens"]}) == (200, {"prompt": text})

    status, chat = post(server.http_url + "/tokenize", {"messages": FRANCE})
    rendered = stub.Tokenize(pb.TokenizeRequest(chat=pb.Messages(messages=[pb.ChatMessage(**FRANCE[0])])), timeout=30)
    assert status == 200 and chat["tokens"] == list(rendered.ids) and chat["token_strs"] is None
    _, unopened = post(server.http_url + "/tokenize", {"messages": FRANCE, "add_generation_prompt": False})
    assert chat["tokens"][: unopened["count"]] == unopened["tokens"] and unopened["count"] < chat["count"]

    for route, bad, param in (
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": "hello"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"content": "no role"}]}, "messages"),
    ):
        status, error = post(server.http_url + route, bad)
        assert status == 400 and error["error"]["param"] == param, (route, bad, error)


def test_tokenize_and_detokenize_answer_under_v1_too(server: ServerProcess) -> None:
    """vLLM's newer servers have them under /v1: the same answers."""
    body = {"model": MODEL, "prompt": "The sky is blue.", "return_token_strs": True}
    root, v1 = post(server.http_url + "/tokenize", body), post(server.http_url + "/v1/tokenize", body)
    assert v1 == root and root[0] == 200
    tokens = {"tokens": root[1]["tokens"]}
    assert post(server.http_url + "/v1/detokenize", tokens) == post(server.http_url + "/detokenize", tokens)
    assert post(server.http_url + "/v1/detokenize", {"tokens": "hello"})[0] == 400


def test_the_x_request_id_header_names_the_request_in_the_reply_and_the_log(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hi", max_tokens=1, extra_headers={"x-request-id": "http-req-1"}
    )
    assert raw.headers["x-request-id"] == "http-req-1" and raw.parse().id == "cmpl-http-req-1"
    (event,) = [e for e in finished_events(server) if e.get("request_id") == "http-req-1"]
    assert event["status"] == "OK" and event["api"] == "http" and event["completion_tokens"] == 1


# -- beside the HTTP API: reflection v1 and the metrics a dashboard needs -------------------------


def test_server_reflection_answers_as_v1_and_v1alpha(server: ServerProcess) -> None:
    for version in ("v1", "v1alpha"):
        names = reflected_services(server.address, version)
        assert {"tokenmill.v1.Generation", "grpc.health.v1.Health"} <= names, version
        assert "grpc.reflection.v1.ServerReflection" in names


def test_metrics_have_build_info_cache_gauges_and_no_created_series(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    # The same long prompt twice: the second finds its full blocks in the prefix cache.
    prompt = "Tell me everything about the history of the city of Paris, from its founding to today. " * 4
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    _, text = get(server.http_url + "/metrics")
    assert "_created" not in text
    info = next(line for line in text.splitlines() if line.startswith("tokenmill_build_info{"))
    for label in ("version=", 'backend="torch"', "dtype=", 'quantization="gguf-vnni"', 'model="SmolLM2'):
        assert label in info
    assert info.endswith(" 1.0")
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[:1] != "#"}
    assert 0.0 <= values["tokenmill_kv_cache_usage_ratio"] <= 1.0
    assert 0.0 < values["tokenmill_prefix_cache_hit_rate"] < 1.0
    assert 0.0 <= values["tokenmill_draft_acceptance_rate"] <= 1.0


def test_a_chat_model_refuses_embeddings_saying_which_models_embed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input="What is the capital of France?")
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "model" and error["code"] == "model_does_not_embed"
    assert "does not embed" in error["message"] and "sentence-transformers" in error["message"]
