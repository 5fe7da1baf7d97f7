"""Between the client's value types and the generated protobuf messages."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ._chat import ChatMessage, FunctionChoice, MessageLike, ToolCall, to_chat_messages, to_tool
from ._options import GenerateOptions
from ._proto import generate_pb2 as pb
from ._types import (
    EngineState,
    FinishReason,
    GenerateEvent,
    GenerateResult,
    Limits,
    ModelInfo,
    RankState,
    Timing,
    Token,
    Tokenization,
    TopLogprob,
    Usage,
    WorkerState,
)

_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_EOS: FinishReason.EOS,
    pb.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
    pb.FINISH_REASON_CONTEXT_LIMIT: FinishReason.CONTEXT_LIMIT,
    pb.FINISH_REASON_TOOL_CALLS: FinishReason.TOOL_CALLS,
}


_TOOL_CHOICES: dict[str, int] = {
    "auto": pb.TOOL_CHOICE_AUTO,
    "none": pb.TOOL_CHOICE_NONE,
    "required": pb.TOOL_CHOICE_REQUIRED,
}


def _message_to_proto(m: ChatMessage) -> pb.ChatMessage:
    return pb.ChatMessage(
        role=m.role,
        content=m.content,
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls],
        tool_call_id=m.tool_call_id,
        name=m.name,
        reasoning=m.reasoning,
    )


def messages_to_proto(messages: Sequence[MessageLike]) -> pb.Messages:
    return pb.Messages(messages=[_message_to_proto(m) for m in to_chat_messages(messages)])


def _tool_calls(calls: Iterable[pb.ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.name, c.arguments) for c in calls)


def _set_tools(request: pb.GenerateRequest, options: GenerateOptions) -> None:
    """The tools, tool_choice and parallel_tool_calls of ``options`` onto ``request`` (ValueError for a
    tool_choice that is none of "auto", "none", "required" or a FunctionChoice)."""
    for tool in map(to_tool, options.tools):  # Tools already (GenerateOptions converts them): a no-op
        request.tools.append(pb.Tool(name=tool.name, description=tool.description, parameters=tool.parameters_json))
    choice = options.tool_choice
    if isinstance(choice, FunctionChoice):
        request.tool_choice = pb.TOOL_CHOICE_FUNCTION
        request.tool_choice_function = choice.name
    elif choice in _TOOL_CHOICES:
        request.tool_choice = _TOOL_CHOICES[choice]  # type: ignore[assignment]
    else:
        raise ValueError(f'tool_choice must be "auto", "none", "required" or a FunctionChoice, got {choice!r}')
    if options.parallel_tool_calls is not None:
        request.parallel_tool_calls = options.parallel_tool_calls


def build_generate_request(
    prompt: str | None,
    messages: Sequence[MessageLike] | None,
    token_ids: Sequence[int] | None,
    options: GenerateOptions,
) -> pb.GenerateRequest:
    """A GenerateRequest; exactly one of prompt, messages and token_ids must be given (ValueError otherwise).

    Values are sent as they are: the server validates them and answers INVALID_ARGUMENT with a message.
    ``options.timeout`` is the call's, not the request's.
    """
    given = [
        name
        for name, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, messages or token_ids (got {', '.join(given) or 'none'})")
    sampling = pb.SamplingParams(
        temperature=options.temperature,
        top_k=options.top_k,
        top_p=options.top_p,
        repetition_penalty=options.repetition_penalty,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        logit_bias=dict(options.logit_bias),
    )
    if options.seed is not None:
        sampling.seed = options.seed
    request = pb.GenerateRequest(
        sampling=sampling,
        stopping=pb.StoppingParams(
            max_new_tokens=options.max_new_tokens,
            stop=list(options.stop),
            stop_token_ids=list(options.stop_token_ids),
            ignore_eos=options.ignore_eos,
        ),
        logprobs=options.logprobs,
        top_logprobs=options.top_logprobs,
        prompt_logprobs=options.prompt_logprobs,
        request_id=options.request_id or "",
        adapter=options.adapter,
    )
    given_constraints = [
        name
        for name, value in (
            ("json_schema", options.json_schema),
            ("json_object", options.json_object or None),
            ("regex", options.regex),
            ("grammar", options.grammar),
        )
        if value is not None
    ]
    if len(given_constraints) > 1:
        raise ValueError(f"give at most one of json_schema, json_object, regex or grammar (got {given_constraints})")
    if isinstance(options.json_schema, str):
        request.json_schema = options.json_schema
    elif options.json_object:
        request.json_object.SetInParent()
    elif options.regex is not None:
        request.regex = options.regex
    elif options.grammar is not None:
        syntax = pb.GRAMMAR_SYNTAX_GBNF if options.grammar_syntax == "gbnf" else pb.GRAMMAR_SYNTAX_LARK
        request.grammar.CopyFrom(pb.Grammar(text=options.grammar, syntax=syntax))
    _set_tools(request, options)
    if options.n != 1:  # one choice is the server's default: the request carries no n
        request.n = options.n
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        request.chat.CopyFrom(messages_to_proto(messages))
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    return request


def build_tokenize_request(text_or_messages: str | Sequence[MessageLike]) -> pb.TokenizeRequest:
    if isinstance(text_or_messages, str):
        return pb.TokenizeRequest(text=text_or_messages)
    return pb.TokenizeRequest(chat=messages_to_proto(text_or_messages))


def _token(message: pb.Token) -> Token:
    return Token(
        id=message.id,
        text=message.text,
        logprob=message.logprob if message.HasField("logprob") else None,
        top_logprobs=tuple(TopLogprob(t.id, t.text, t.logprob) for t in message.top_logprobs),
        special=message.special,
    )


def _tokens(messages: Iterable[pb.Token]) -> tuple[Token, ...]:
    return tuple(_token(m) for m in messages)


def event_from_proto(response: pb.GenerateResponse) -> GenerateEvent:
    finish = _FINISH_REASONS.get(response.finish_reason)
    return GenerateEvent(
        request_id=response.request_id,
        text=response.text,
        tokens=_tokens(response.tokens),
        prompt_tokens=_tokens(response.prompt_tokens),
        finish_reason=finish,
        usage=Usage(response.usage.prompt_tokens, response.usage.completion_tokens) if finish is not None else None,
        timing=(
            Timing(response.timing.queue_ms, response.timing.time_to_first_token_ms, response.timing.total_ms)
            if finish is not None
            else None
        ),
        index=response.index,
        reasoning_text=response.reasoning_text,
        tool_calls=_tool_calls(response.tool_calls),
    )


class ResultBuilder:
    """Accumulates GenerateEvents into a GenerateResult."""

    def __init__(self) -> None:
        self.request_id = ""
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._tokens: list[Token] = []
        self._prompt_tokens: tuple[Token, ...] = ()
        self._last: GenerateEvent | None = None
        self._tool_calls: list[ToolCall] = []

    def add(self, event: GenerateEvent) -> None:
        self.request_id = event.request_id or self.request_id
        self._text.append(event.text)
        self._reasoning.append(event.reasoning_text)
        self._tokens.extend(event.tokens)
        if event.prompt_tokens:
            self._prompt_tokens = event.prompt_tokens
        self._tool_calls.extend(event.tool_calls)
        if event.is_last:
            self._last = event

    def result(self) -> GenerateResult | None:
        """The finished result, or None when no event carried a finish reason."""
        last = self._last
        if last is None or last.finish_reason is None or last.usage is None or last.timing is None:
            return None
        return GenerateResult(
            request_id=self.request_id,
            text="".join(self._text),
            tokens=tuple(self._tokens),
            prompt_tokens=self._prompt_tokens,
            finish_reason=last.finish_reason,
            usage=last.usage,
            timing=last.timing,
            reasoning_text="".join(self._reasoning),
            tool_calls=tuple(self._tool_calls),
        )


class ChoicesBuilder:
    """Accumulates the GenerateEvents of n choices into one GenerateResult per choice, in index order.

    With n > 1 the prompt's tokens (prompt_logprobs) come with choice 0 only; every result gets them."""

    def __init__(self, n: int) -> None:
        self._builders = [ResultBuilder() for _ in range(max(1, n))]

    def add(self, event: GenerateEvent) -> None:
        self._builders[event.index].add(event)

    def results(self) -> tuple[GenerateResult, ...] | None:
        """Every choice's result, or None when one of them never finished."""
        results = [b.result() for b in self._builders]
        if any(r is None for r in results):
            return None
        shared = results[0].prompt_tokens if results[0] is not None else ()
        return tuple(dataclasses.replace(r, prompt_tokens=r.prompt_tokens or shared) for r in results if r)


def tokenization_from_proto(response: pb.TokenizeResponse) -> Tokenization:
    return Tokenization(ids=tuple(response.ids), pieces=tuple(response.pieces))


def model_info_from_proto(info: pb.ModelInfo) -> ModelInfo:
    e, lim = info.engine, info.limits
    return ModelInfo(
        name=info.name,
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        backend=info.backend,
        device=info.device,
        num_workers=info.num_workers,
        dtype=info.dtype,
        quantization=info.quantization,
        weight_bytes=info.weight_bytes,
        tensor_parallel=info.tensor_parallel or 1,
        load_plan=dict(info.load_plan),
        adapters={a.name: a.path for a in info.adapters},
        limits=Limits(
            max_new_tokens=lim.max_new_tokens,
            max_top_logprobs=lim.max_top_logprobs,
            max_stop_strings=lim.max_stop_strings,
            max_queue=lim.max_queue,
            max_batch_size=lim.max_batch_size,
            max_loras=lim.max_loras,
            max_lora_rank=lim.max_lora_rank,
            max_n=lim.max_n or 1,
            max_constraint_length=lim.max_constraint_length,
            constraint_compile_timeout_s=lim.constraint_compile_timeout_s,
        ),
        engine=EngineState(
            running=e.running,
            waiting=e.waiting,
            kv_blocks_used=e.kv_blocks_used,
            kv_blocks_total=e.kv_blocks_total,
            kv_block_size=e.kv_block_size,
            draft_tokens_proposed=e.draft_tokens_proposed,
            draft_tokens_accepted=e.draft_tokens_accepted,
        ),
        workers=tuple(
            WorkerState(
                worker_id=w.worker_id,
                alive=w.alive,
                running=w.running,
                waiting=w.waiting,
                kv_blocks_used=w.kv_blocks_used,
                kv_blocks_total=w.kv_blocks_total,
                kv_block_size=w.kv_block_size,
                restarts=w.restarts,
                ranks=tuple(RankState(rank=r.rank, pid=r.pid, device=r.device) for r in w.ranks),
            )
            for w in info.workers
        ),
    )
