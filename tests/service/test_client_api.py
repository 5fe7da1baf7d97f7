"""The typed client (tokenmill_client) against a real tokenmill-server, plus its server-free parts."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.server_process import free_port
from tokenmill_client import (
    AsyncClient,
    AuthenticationError,
    ChatMessage,
    Client,
    DeadlineExceededError,
    EngineState,
    FinishReason,
    GenerateEvent,
    GenerateOptions,
    GenerateOverrides,
    GenerateResult,
    HealthStatus,
    InvalidRequestError,
    ModelInfo,
    OverloadedError,
    Timing,
    Token,
    TokenmillError,
    UnavailableError,
    Usage,
)
from tokenmill_client._chat import to_chat_messages
from tokenmill_client._convert import build_generate_request
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc
from tokenmill_client._transport import decode_health_response, encode_health_request

QUESTION = "What is the capital of France?"

# --------------------------------------------------------------------------------- no server needed


def test_chat_messages_accept_dataclasses_tuples_and_dicts() -> None:
    messages = to_chat_messages(
        [ChatMessage("system", "Be brief."), ("user", "Hi"), {"role": "assistant", "content": "Hello"}]
    )
    assert messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hi"),
        ChatMessage("assistant", "Hello"),
    )


@pytest.mark.parametrize("bad", [("user",), {"role": "user"}, 42])
def test_malformed_chat_message_is_rejected(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        to_chat_messages([bad])  # type: ignore[list-item]


def test_a_bare_string_is_not_taken_for_a_conversation() -> None:
    with pytest.raises(TypeError):
        to_chat_messages("hello")


def test_generate_needs_exactly_one_kind_of_prompt() -> None:
    with Client(f"127.0.0.1:{free_port()}") as client:
        with pytest.raises(ValueError, match="exactly one"):
            client.generate()
        with pytest.raises(ValueError, match="exactly one"):
            client.generate("text", token_ids=[1, 2])


# ------------------------------------------------------------------------------------- generate options


def test_generate_options_defaults_are_greedy_up_to_the_servers_default_length() -> None:
    options = GenerateOptions()
    assert (options.max_new_tokens, options.temperature, options.top_k, options.top_p) == (0, 0.0, 0, 1.0)
    assert (options.repetition_penalty, options.seed, options.stop, options.stop_token_ids) == (1.0, None, (), ())
    assert not (options.ignore_eos or options.logprobs or options.prompt_logprobs or options.top_logprobs)
    assert options.request_id is None and options.timeout is None
    # The defaults send what an empty request means: no seed, no stop, no extras.
    request = build_generate_request("hi", None, None, options)
    assert not request.sampling.HasField("seed")
    assert request == pb.GenerateRequest(
        prompt="hi",
        sampling=pb.SamplingParams(top_p=1.0, repetition_penalty=1.0),
        stopping=pb.StoppingParams(),
    )


def test_generate_options_are_frozen_slotted_keyword_only_and_hashable() -> None:
    options = GenerateOptions(max_new_tokens=8, stop=["a", "b"], stop_token_ids=[7])
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 1  # type: ignore[misc]
    assert not hasattr(options, "__dict__")
    with pytest.raises(TypeError):
        GenerateOptions(8)  # type: ignore[call-arg]
    # Sequences are kept as tuples, so a caller's list changing later changes nothing.
    assert options.stop == ("a", "b") and options.stop_token_ids == (7,)
    assert options == GenerateOptions(max_new_tokens=8, stop=("a", "b"), stop_token_ids=(7,))
    assert hash(options) == hash(GenerateOptions(max_new_tokens=8, stop=("a", "b"), stop_token_ids=(7,)))
    assert GenerateOptions(stop="END").stop == ("END",)  # one string is one stop string, not its characters
    bias = {5: -100.0}
    biased = GenerateOptions(logit_bias=bias)
    bias[6] = 1.0  # the caller's dict changing later changes nothing
    assert biased.logit_bias == {5: -100.0} and biased == GenerateOptions(logit_bias={5: -100.0})
    assert hash(biased) == hash(GenerateOptions(logit_bias={5: -100.0})) and biased != GenerateOptions()
    request = build_generate_request("hi", None, None, GenerateOptions(logit_bias=bias, presence_penalty=0.5))
    assert dict(request.sampling.logit_bias) == bias and request.sampling.presence_penalty == 0.5


def test_dataclasses_replace_makes_a_variant_and_leaves_the_original() -> None:
    base = GenerateOptions(max_new_tokens=16, temperature=0.7, stop=["x"])
    variant = dataclasses.replace(base, seed=3, stop="y")
    assert variant == GenerateOptions(max_new_tokens=16, temperature=0.7, seed=3, stop=("y",))
    assert base.seed is None and base.stop == ("x",)


def test_generate_overrides_name_every_option_with_its_type() -> None:
    fields = typing.get_type_hints(GenerateOptions)
    assert typing.get_type_hints(GenerateOverrides) == fields
    assert GenerateOverrides.__optional_keys__ == frozenset(fields)  # every override may be left out


def test_a_keyword_that_is_not_an_option_is_a_type_error_before_any_call() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens: the error must come first
    with Client(address, max_retries=0) as client:
        for call in (
            lambda: client.generate("hi", max_tokens=8),  # type: ignore[call-arg]
            lambda: client.generate_text("hi", max_tokens=8),  # type: ignore[call-arg]
            lambda: client.chat([("user", "hi")], max_tokens=8),  # type: ignore[call-arg]
        ):
            with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
                call()
        with pytest.raises(TypeError, match="GenerateOptions"):
            client.generate_text("hi", options={"max_new_tokens": 8})  # type: ignore[arg-type]

    async def scenario() -> None:
        async with AsyncClient(address, max_retries=0) as aclient:
            with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
                aclient.generate("hi", max_tokens=8)  # type: ignore[call-arg]
            with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
                await aclient.generate_text("hi", max_tokens=8)  # type: ignore[call-arg]
            with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
                await aclient.chat([("user", "hi")], max_tokens=8)  # type: ignore[call-arg]

    asyncio.run(scenario())


_TYPED_CALLS = """\
from tokenmill_client import AsyncClient, Client, GenerateOptions


async def calls(client: Client, aclient: AsyncClient) -> None:
    client.generate_text("x", max_new_tokens=8, temperature=0.7, seed=1, logprobs=True, stop=["."])
    client.generate_text("x", options=GenerateOptions(seed=2), top_k=3)
    client.generate_text("x", max_tokens=8)
    client.generate("x", temperature="hot")
    client.chat([("user", "x")], nope=True)
    await aclient.generate_text("x", seed="1")
    GenerateOptions(nope=1)
"""


def test_mypy_checks_the_option_keywords_of_every_method(tmp_path: Path) -> None:
    script = tmp_path / "calls.py"
    script.write_text(_TYPED_CALLS)
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [str(Path(sys.executable).parent / "mypy"), "--strict", "--no-incremental", str(script)],
        cwd=root,  # the project's mypy settings
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, "MYPYPATH": str(root / "client")},
    )
    errors = dict(line.split(": error: ", 1) for line in result.stdout.splitlines() if ": error: " in line)
    # Each bad line, and only those, is an error naming its keyword.
    expected = {7: '"max_tokens"', 8: '"temperature"', 9: '"nope"', 10: '"seed"', 11: '"nope"'}
    assert set(errors) == {f"{script}:{line}" for line in expected}, result.stdout
    for line, keyword in expected.items():
        assert keyword in errors[f"{script}:{line}"]


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (health_pb2.HealthCheckResponse.SERVING, HealthStatus.SERVING),
        (health_pb2.HealthCheckResponse.NOT_SERVING, HealthStatus.NOT_SERVING),
        (health_pb2.HealthCheckResponse.UNKNOWN, HealthStatus.UNKNOWN),
        (health_pb2.HealthCheckResponse.SERVICE_UNKNOWN, HealthStatus.SERVICE_UNKNOWN),
    ],
)
def test_hand_coded_health_response_matches_grpc_health_messages(status: int, expected: HealthStatus) -> None:
    wire = health_pb2.HealthCheckResponse(status=status).SerializeToString()  # type: ignore[arg-type]
    assert decode_health_response(wire) == expected


@pytest.mark.parametrize("service", ["", "tokenmill.v1.Generation", "é" * 100])
def test_hand_coded_health_request_matches_grpc_health_messages(service: str) -> None:
    assert encode_health_request(service) == health_pb2.HealthCheckRequest(service=service).SerializeToString()


def test_unreachable_server_raises_unavailable_error_naming_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with Client(address, max_retries=2) as client, pytest.raises(UnavailableError) as info:
        client.generate_text(QUESTION)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE
    assert info.value.target == address
    assert isinstance(info.value, TokenmillError)
    assert time.monotonic() - started >= 0.2 * 0.8  # it retried with backoff before giving up


def test_target_defaults_to_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_SERVER", "example.invalid:1234")
    with Client() as client:
        assert client.target == "example.invalid:1234"
    monkeypatch.delenv("TOKENMILL_SERVER")
    with Client() as client:
        assert client.target == "localhost:50051"


# ------------------------------------------------------------------------------------- live server


@pytest.fixture(scope="module")
def client(server_address: str) -> Iterator[Client]:
    with Client(server_address, timeout=120) as c:
        yield c


def _wait_idle(client: Client, seconds: float = 10.0) -> EngineState:
    deadline = time.monotonic() + seconds
    while True:
        engine = client.model_info().engine
        if (engine.running == 0 and engine.waiting == 0) or time.monotonic() > deadline:
            return engine
        time.sleep(0.1)


def test_generate_streams_typed_events_and_only_the_last_carries_finish_usage_and_timing(client: Client) -> None:
    events = list(client.generate(messages=[("user", QUESTION)], max_new_tokens=16))
    assert events and all(isinstance(e, GenerateEvent) for e in events)
    *body, last = events
    assert all(e.finish_reason is None and e.usage is None and e.timing is None for e in body)
    assert isinstance(last.finish_reason, FinishReason)
    assert isinstance(last.usage, Usage) and isinstance(last.timing, Timing)
    tokens = [t for e in events for t in e.tokens]
    assert all(isinstance(t, Token) and isinstance(t.id, int) for t in tokens)
    assert last.usage.completion_tokens == len(tokens)
    assert last.usage.prompt_tokens > 0
    assert last.timing.total_ms >= last.timing.time_to_first_token_ms >= 0
    assert len({e.request_id for e in events}) == 1 and events[0].request_id
    assert "Paris" in "".join(e.text for e in events)


def test_generate_text_stops_at_max_new_tokens_with_finish_reason_length(client: Client) -> None:
    result = client.generate_text("Once upon a time", max_new_tokens=5, ignore_eos=True, request_id="api-length")
    assert isinstance(result, GenerateResult)
    assert result.finish_reason is FinishReason.LENGTH
    assert result.usage.completion_tokens == len(result.tokens) == 5
    assert result.request_id == "api-length"
    assert result.text


def test_chat_answers_with_eos_and_accepts_every_message_form(client: Client) -> None:
    for messages in (
        [ChatMessage("user", QUESTION)],
        [("user", QUESTION)],
        [{"role": "user", "content": QUESTION}],
    ):
        result = client.chat(messages, max_new_tokens=32)
        assert "Paris" in result.text
        assert result.finish_reason is FinishReason.EOS


def test_stop_string_ends_generation_without_the_stop_string(client: Client) -> None:
    result = client.chat([("user", QUESTION)], max_new_tokens=32, stop=["Paris"])
    assert result.finish_reason is FinishReason.STOP_SEQUENCE
    assert "Paris" not in result.text


def test_logprobs_and_top_logprobs_are_returned_when_asked(client: Client) -> None:
    result = client.generate_text("The capital of France is", max_new_tokens=3, logprobs=True, top_logprobs=3)
    assert result.tokens
    for token in result.tokens:
        assert token.logprob is not None and token.logprob <= 0.0
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
    plain = client.generate_text("The capital of France is", max_new_tokens=3)
    assert all(t.logprob is None and not t.top_logprobs for t in plain.tokens)
    # The old name still answers, with a warning.
    with pytest.warns(DeprecationWarning, match="top_logprobs"):
        assert result.tokens[0].alternatives == result.tokens[0].top_logprobs


def test_prompt_logprobs_come_with_the_tokenized_prompt(client: Client) -> None:
    tokens = client.tokenize("Hello world, this is a test")
    assert len(tokens.ids) == len(tokens.pieces) > 1
    events = list(client.generate(token_ids=tokens.ids, max_new_tokens=2, prompt_logprobs=True))
    prompt = events[0].prompt_tokens
    assert [t.id for t in prompt] == list(tokens.ids)
    assert prompt[0].logprob is None
    assert all(t.logprob is not None for t in prompt[1:])
    assert all(not e.prompt_tokens for e in events[1:])


def test_same_seed_gives_the_same_sample(client: Client) -> None:
    first = client.generate_text("Tell me a story.", temperature=1.0, seed=1234, max_new_tokens=8, ignore_eos=True)
    second = client.generate_text("Tell me a story.", temperature=1.0, seed=1234, max_new_tokens=8, ignore_eos=True)
    assert [t.id for t in first.tokens] == [t.id for t in second.tokens]


def test_one_options_object_serves_every_method_and_keywords_override_it(client: Client, server_address: str) -> None:
    base = GenerateOptions(max_new_tokens=5, ignore_eos=True, logprobs=True)
    result = client.generate_text("Once upon a time", options=base)
    assert result.finish_reason is FinishReason.LENGTH and len(result.tokens) == 5
    assert all(t.logprob is not None for t in result.tokens)
    shorter = client.generate_text("Once upon a time", options=base, max_new_tokens=3, logprobs=False)
    assert len(shorter.tokens) == 3 and all(t.logprob is None for t in shorter.tokens)
    assert [t.id for t in shorter.tokens] == [t.id for t in result.tokens[:3]]  # greedy: the same start
    streamed = [t for e in client.generate("Once upon a time", options=base) for t in e.tokens]
    assert [t.id for t in streamed] == [t.id for t in result.tokens]
    assert len(client.chat([("user", QUESTION)], options=base).tokens) == 5

    async def scenario() -> GenerateResult:
        async with AsyncClient(server_address, timeout=120) as aclient:
            return await aclient.generate_text("Once upon a time", options=base)

    assert [t.id for t in asyncio.run(scenario()).tokens] == [t.id for t in result.tokens]


def test_tokenize_a_chat_renders_the_template(client: Client) -> None:
    raw = client.tokenize(QUESTION)
    chat = client.tokenize([("user", QUESTION)])
    assert len(chat.ids) > len(raw.ids)


def test_model_info_is_typed_and_consistent(client: Client) -> None:
    info = client.model_info()
    assert isinstance(info, ModelInfo)
    assert info.name and info.backend and info.device and info.dtype
    assert info.context_length > 0 and info.vocab_size > 0
    assert info.num_workers == len(info.workers) >= 1
    assert all(w.alive for w in info.workers)
    assert info.limits.max_new_tokens > 0
    assert info.limits.max_n > 1 and info.limits.max_constraint_length > 0
    assert info.limits.constraint_compile_timeout_s > 0
    assert info.engine.kv_blocks_total == sum(w.kv_blocks_total for w in info.workers)
    assert info.load_plan["executor"].startswith("native-stack (") and info.load_plan["ops"].startswith("native (")


def test_health_reports_serving(client: Client) -> None:
    assert client.health() is HealthStatus.SERVING
    assert client.health("tokenmill.v1.Generation") is HealthStatus.SERVING


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"top_p": 2.0}, "top_p"), ({"top_k": -1}, "top_k"), ({"temperature": -0.5}, "temperature")],
)
def test_invalid_parameters_raise_invalid_request_error_with_the_servers_message(
    client: Client, kwargs: dict[str, float], field: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        client.generate_text(QUESTION, max_new_tokens=1, **kwargs)  # type: ignore[arg-type]
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.message


def test_a_deadline_too_short_raises_deadline_exceeded_error(client: Client) -> None:
    with pytest.raises(DeadlineExceededError) as info:
        client.generate_text("Once upon a time", max_new_tokens=500, ignore_eos=True, timeout=0.3)
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(client)


def test_breaking_out_of_generate_cancels_the_call_on_the_server(client: Client) -> None:
    assert _wait_idle(client).running == 0
    for i, _event in enumerate(client.generate("Once upon a time", max_new_tokens=2000, ignore_eos=True)):
        if i == 1:
            assert client.model_info().engine.running == 1
        if i == 2:
            break
    engine = _wait_idle(client, seconds=10)
    assert engine.running == 0 and engine.waiting == 0


def test_closing_a_generate_stream_cancels_the_call_on_the_server(client: Client) -> None:
    stream = client.generate("Once upon a time", max_new_tokens=2000, ignore_eos=True)
    next(stream)
    assert client.model_info().engine.running == 1
    stream.close()
    engine = _wait_idle(client, seconds=10)
    assert engine.running == 0 and engine.waiting == 0


def test_async_client_streams_completes_and_maps_errors(server_address: str) -> None:
    async def scenario() -> None:
        async with AsyncClient(server_address, timeout=120) as aclient:
            assert await aclient.health() is HealthStatus.SERVING
            events = [e async for e in aclient.generate(messages=[("user", QUESTION)], max_new_tokens=16)]
            assert events[-1].finish_reason is FinishReason.EOS
            assert "Paris" in "".join(e.text for e in events)
            result = await aclient.generate_text("Once upon a time", max_new_tokens=4, ignore_eos=True)
            assert result.finish_reason is FinishReason.LENGTH and len(result.tokens) == 4
            answer = await aclient.chat([ChatMessage("user", QUESTION)], max_new_tokens=32)
            assert "Paris" in answer.text
            assert (await aclient.tokenize("Hello world")).ids
            assert (await aclient.model_info()).num_workers >= 1
            with pytest.raises(InvalidRequestError):
                await aclient.generate_text(QUESTION, top_p=2.0)

            # Leaving an async stream early cancels the call on the server.
            async with contextlib.aclosing(
                aclient.generate("Once upon a time", max_new_tokens=2000, ignore_eos=True)
            ) as stream:
                async for _event in stream:
                    assert (await aclient.model_info()).engine.running == 1
                    break
            for _ in range(100):
                engine = (await aclient.model_info()).engine
                if engine.running == 0 and engine.waiting == 0:
                    break
                await asyncio.sleep(0.1)
            assert engine.running == 0 and engine.waiting == 0

    asyncio.run(scenario())


def test_async_client_raises_unavailable_error_for_an_unreachable_server() -> None:
    async def scenario() -> None:
        address = f"127.0.0.1:{free_port()}"
        async with AsyncClient(address, max_retries=1) as aclient:
            with pytest.raises(UnavailableError) as info:
                await aclient.generate_text(QUESTION)
            assert info.value.target == address

    asyncio.run(scenario())


# ------------------------------------------------------------------ transport: a scripted gRPC server
# A real gRPC server speaking the generated tokenmill.v1 service, scripted to fail in the ways the
# real server can (restarting, dying mid-stream, refusing credentials, a full queue), so the
# client's retry, error mapping, metadata and TLS are checked deterministically and fast.


class ScriptedGeneration(generate_pb2_grpc.GenerationServicer):  # type: ignore[misc]
    """Each call to Generate follows the next step of ``script`` (the last step repeats)."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.calls = 0
        self.metadata: list[dict[str, str]] = []
        self.requests: list[pb.GenerateRequest] = []
        self.deadlines: list[float | None] = []  # seconds left when each call arrived; None = no deadline
        self.lock = threading.Lock()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        with self.lock:
            step = self.script[min(self.calls, len(self.script) - 1)]
            self.calls += 1
            self.metadata.append({k: v for k, v in context.invocation_metadata()})  # type: ignore[misc]
            self.requests.append(request)
            self.deadlines.append(context.time_remaining())
        codes = {
            "unavailable": grpc.StatusCode.UNAVAILABLE,
            "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
            "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
            "internal": grpc.StatusCode.INTERNAL,
        }
        if step in codes:
            context.abort(codes[step], f"scripted {step}")
        yield pb.GenerateResponse(request_id="scripted", text="Hello", tokens=[pb.Token(id=1, text="Hello")])
        if step == "one-then-unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker died mid-stream")
        if step == "no-finish":
            return
        yield pb.GenerateResponse(
            request_id="scripted",
            text="!",
            tokens=[pb.Token(id=2, text="!")],
            finish_reason=pb.FINISH_REASON_EOS,
            usage=pb.Usage(prompt_tokens=3, completion_tokens=2),
            timing=pb.Timing(queue_ms=0.5, time_to_first_token_ms=1.0, total_ms=2.0),
        )

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        with self.lock:
            step = self.script[min(self.calls, len(self.script) - 1)]
            self.calls += 1
            self.deadlines.append(context.time_remaining())
        if step == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "scripted unavailable")
        return pb.TokenizeResponse(ids=[7, 8], pieces=["a", "b"])


@contextlib.contextmanager
def scripted_server(
    script: list[str], credentials: grpc.ServerCredentials | None = None
) -> Iterator[tuple[str, ScriptedGeneration]]:
    servicer = ScriptedGeneration(script)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield f"localhost:{port}" if credentials is not None else f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


def test_unavailable_before_the_first_response_is_retried() -> None:
    with scripted_server(["unavailable", "unavailable", "ok"]) as (address, servicer), Client(address) as client:
        result = client.generate_text("hi")
    assert result.text == "Hello!" and result.finish_reason is FinishReason.EOS
    assert servicer.calls == 3


def test_unavailable_is_not_retried_past_max_retries() -> None:
    with (
        scripted_server(["unavailable"]) as (address, servicer),
        Client(address, max_retries=2) as client,
        pytest.raises(UnavailableError) as info,
    ):
        client.generate_text("hi")
    assert servicer.calls == 3
    assert info.value.message == "scripted unavailable"


def test_unavailable_after_the_first_response_is_not_retried() -> None:
    events: list[GenerateEvent] = []
    with (
        scripted_server(["one-then-unavailable", "ok"]) as (address, servicer),
        Client(address, max_retries=3) as client,
        pytest.raises(UnavailableError, match="worker died mid-stream"),
    ):
        events.extend(client.generate("hi"))
    assert [e.text for e in events] == ["Hello"]
    assert servicer.calls == 1


@pytest.mark.parametrize(
    ("step", "error", "code"),
    [
        ("unauthenticated", AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
        ("exhausted", OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("internal", TokenmillError, grpc.StatusCode.INTERNAL),
    ],
)
def test_status_codes_map_to_their_exception_classes_without_retrying(
    step: str, error: type[TokenmillError], code: grpc.StatusCode
) -> None:
    with (
        scripted_server([step]) as (address, servicer),
        Client(address, max_retries=3) as client,
        pytest.raises(error) as info,
    ):
        client.generate_text("hi")
    assert type(info.value) is error
    assert info.value.code is code
    assert info.value.message == f"scripted {step}"
    assert servicer.calls == 1


def test_bearer_token_is_sent_as_authorization_metadata() -> None:
    with scripted_server(["ok"]) as (address, servicer):
        with Client(address, token="s3cret") as client:
            client.generate_text("hi")
        with Client(address) as client:
            client.generate_text("hi")
    assert servicer.metadata[0]["authorization"] == "Bearer s3cret"
    assert "authorization" not in servicer.metadata[1]


def test_options_and_keyword_overrides_reach_the_request_and_the_deadline() -> None:
    base = GenerateOptions(
        max_new_tokens=9,
        temperature=0.5,
        top_k=4,
        top_p=0.9,
        repetition_penalty=1.25,
        seed=7,
        stop="END",
        stop_token_ids=[5, 6],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
        prompt_logprobs=True,
        request_id="opts-1",
        timeout=50.0,
    )
    expected = pb.GenerateRequest(
        prompt="hi",
        sampling=pb.SamplingParams(temperature=0.5, top_k=4, top_p=0.9, repetition_penalty=1.25, seed=8),
        stopping=pb.StoppingParams(max_new_tokens=9, stop=["END"], stop_token_ids=[5, 6], ignore_eos=True),
        logprobs=True,
        top_logprobs=2,
        prompt_logprobs=True,
        request_id="opts-1",
    )
    chat = pb.GenerateRequest()
    chat.CopyFrom(expected)
    chat.chat.messages.add(role="user", content="hi")

    async def scenario(address: str) -> None:
        async with AsyncClient(address) as aclient:
            await aclient.generate_text("hi", options=base, seed=8)
            await aclient.chat([("user", "hi")], options=base, seed=8)

    with scripted_server(["ok"]) as (address, servicer):
        with Client(address, timeout=600) as client:
            client.generate_text("hi", options=base, seed=8)  # the keyword wins over the options
            list(client.generate("hi", options=base, seed=8))
            client.chat([("user", "hi")], options=base, seed=8)
            client.generate_text("hi")  # no options: the client's own deadline
        asyncio.run(scenario(address))
    plain = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=1.0, repetition_penalty=1.0), stopping={})
    assert servicer.requests == [expected, expected, chat, plain, expected, chat]
    assert base.seed == 7  # the overrides made a new options object
    deadlines = [d for d in servicer.deadlines if d is not None]
    assert len(deadlines) == len(servicer.deadlines)
    # options.timeout where given, else the client's (gRPC rounds a deadline up by up to a second).
    assert all(40 < d <= 51 for d in deadlines[:3] + deadlines[4:]), deadlines
    assert 590 < deadlines[3] <= 601, deadlines


def test_tls_with_root_certificates_from_a_file_or_bytes(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    with scripted_server(["ok"], credentials) as (address, servicer):
        with Client(address, root_certificates=str(cert), token="t") as client:
            assert client.generate_text("hi").text == "Hello!"
        with Client(address, tls=True, root_certificates=cert.read_bytes()) as client:
            assert client.generate_text("hi").text == "Hello!"
        with Client(address, max_retries=0) as plaintext, pytest.raises(UnavailableError):
            plaintext.generate_text("hi")
    assert servicer.metadata[0]["authorization"] == "Bearer t"


def test_async_client_retries_and_maps_errors_like_the_blocking_one() -> None:
    async def scenario(address: str) -> None:
        async with AsyncClient(address, max_retries=3, token="abc") as aclient:
            result = await aclient.generate_text("hi")
            assert result.text == "Hello!"
            with pytest.raises(AuthenticationError):
                await aclient.generate_text("hi")

    with scripted_server(["unavailable", "ok", "unauthenticated"]) as (address, servicer):
        asyncio.run(scenario(address))
    assert servicer.calls == 3
    assert servicer.metadata[1]["authorization"] == "Bearer abc"


def test_unary_calls_retry_unavailable_and_share_one_deadline_in_both_clients() -> None:
    async def scenario(address: str) -> None:
        async with AsyncClient(address, max_retries=2) as aclient:
            assert (await aclient.tokenize("ab", timeout=30)).ids == (7, 8)
            with pytest.raises(UnavailableError, match="scripted unavailable"):
                await aclient.tokenize("ab")

    with (
        scripted_server(["unavailable", "unavailable", "ok"]) as (address, servicer),
        Client(address, max_retries=2) as client,
    ):
        assert client.tokenize("ab", timeout=30).pieces == ("a", "b")
    assert servicer.calls == 3
    assert all(d is not None and d <= 31 for d in servicer.deadlines)  # each retry has what is left of 30 s
    with scripted_server(["unavailable", "unavailable", "ok", "unavailable"]) as (address, servicer):
        asyncio.run(scenario(address))
    assert servicer.calls == 3 + 3  # the second call's tries: the first and max_retries=2 more


def test_a_stream_that_ends_without_a_finish_reason_is_an_error_in_both_clients() -> None:
    async def scenario(address: str) -> None:
        async with AsyncClient(address) as aclient:
            with pytest.raises(TokenmillError, match="without a finish reason") as info:
                await aclient.generate_text("hi")
            assert info.value.code is grpc.StatusCode.UNKNOWN and info.value.target == address
            with pytest.raises(TokenmillError, match="without a finish reason"):
                await aclient.generate_choices("hi", n=2)

    with scripted_server(["no-finish"]) as (address, servicer):
        with Client(address) as client:
            with pytest.raises(TokenmillError, match="without a finish reason") as info:
                client.generate_text("hi")
            assert info.value.code is grpc.StatusCode.UNKNOWN and info.value.target == address
            with pytest.raises(TokenmillError, match="without a finish reason"):
                client.generate_choices("hi", n=2)
        asyncio.run(scenario(address))
    assert servicer.calls == 4  # an ended stream is not retried
