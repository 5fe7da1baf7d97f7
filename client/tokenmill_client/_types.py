"""The client's public value types: frozen dataclasses and string enums, independent of protobuf."""

from __future__ import annotations

import dataclasses
import enum
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypedDict


class FinishReason(str, enum.Enum):
    """Why a generation ended."""

    LENGTH = "length"
    """max_new_tokens was reached."""
    EOS = "eos"
    """The model produced EOS / end-of-turn, or one of stop_token_ids."""
    STOP_SEQUENCE = "stop_sequence"
    """A stop string matched (it is not part of the text)."""
    CONTEXT_LIMIT = "context_limit"
    """The model's context is full."""
    TOOL_CALLS = "tool_calls"
    """The answer is calls of tools (see ``tool_calls``)."""

    def __str__(self) -> str:
        return self.value


class HealthStatus(str, enum.Enum):
    """A grpc.health.v1 serving status."""

    UNKNOWN = "UNKNOWN"
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"
    SERVICE_UNKNOWN = "SERVICE_UNKNOWN"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call of a tool, as the model made it (and as an assistant message of the history carries it)."""

    id: str
    """Unique within the conversation ("call_..."); the "tool" message answering it gives this id."""
    name: str
    """The function called."""
    arguments: str
    """Its arguments: a JSON object, as text."""

    def parsed_arguments(self) -> Any:
        """The arguments decoded (json.JSONDecodeError when the text is not JSON)."""
        return json.loads(self.arguments)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call (chat requests only).

    ``parameters`` is the JSON Schema of its arguments object (a mapping, or its JSON text; None = any
    object). ``Tool.from_openai()`` reads OpenAI's ``{"type": "function", "function": {...}}`` shape.
    """

    name: str
    """Letters, digits, '_' and '-', at most 64 characters."""
    description: str = ""
    """What it does, for the model."""
    parameters: str | Mapping[str, Any] | None = field(default=None, hash=False, compare=False)
    """The arguments' JSON Schema; kept as JSON text (``parameters_json``)."""
    parameters_json: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.parameters is None:
            text = ""
        elif isinstance(self.parameters, str):
            text = self.parameters
        else:
            text = json.dumps(self.parameters)
        object.__setattr__(self, "parameters_json", text)

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> Tool:
        """A tool from OpenAI's shape ``{"type": "function", "function": {"name", "description", "parameters"}}``
        (or the bare function object); ValueError names what is missing."""
        if not isinstance(tool, Mapping):
            raise TypeError(f"a tool must be a mapping, got {type(tool).__name__}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"only function tools are supported, got type {tool.get('type')!r}")
        function = tool.get("function", tool)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TypeError("a tool needs a function with a string 'name'")
        description = function.get("description") or ""
        parameters = function.get("parameters")
        if not isinstance(description, str) or not (parameters is None or isinstance(parameters, (str, Mapping))):
            raise ValueError(f"tool {function['name']!r}: description must be a string, parameters an object")
        return cls(function["name"], description, parameters)


@dataclass(frozen=True, slots=True)
class FunctionChoice:
    """``tool_choice``: the answer is a call of this function (one of the tools)."""

    name: str


ToolChoice: TypeAlias = Literal["auto", "none", "required"] | FunctionChoice
"""Whether the model may ("auto"), must not ("none") or must ("required") call a tool, or must call one
function (FunctionChoice)."""

ToolLike: TypeAlias = Tool | Mapping[str, Any]
"""A tool as a Tool or as OpenAI's ``{"type": "function", "function": {...}}`` mapping."""


def to_tool(tool: ToolLike) -> Tool:
    return tool if isinstance(tool, Tool) else Tool.from_openai(tool)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a conversation: role is "system", "user", "assistant" or "tool".

    An assistant turn that called tools carries them in ``tool_calls`` (its content may be empty); a
    "tool" turn holds a call's result in ``content``, with the call's id in ``tool_call_id``.
    """

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    """A "tool" message: the name of the tool that answered (optional)."""
    reasoning: str = ""
    """An assistant message: its reasoning (a harmony model sees it again before the calls it made)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))


MessageLike: TypeAlias = ChatMessage | tuple[str, str] | Mapping[str, Any]
"""A chat turn as a ChatMessage, a (role, content) tuple or an OpenAI-style mapping: ``{"role": ...,
"content": ...}``, with ``tool_calls`` (OpenAI's ``{"id", "type": "function", "function": {"name",
"arguments"}}`` or ToolCalls) on an assistant turn and ``tool_call_id`` on a "tool" turn."""


def _tool_call(call: ToolCall | Mapping[str, Any]) -> ToolCall:
    if isinstance(call, ToolCall):
        return call
    if not isinstance(call, Mapping):
        raise TypeError(f"a tool call must be a ToolCall or a mapping, got {call!r}")
    function = call.get("function", call)
    name, arguments = function.get("name"), function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    call_id = call.get("id", "")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise TypeError(f"a tool call needs a string function name and id, got {call!r}")
    return ToolCall(call_id, name, arguments)


def to_chat_message(message: MessageLike) -> ChatMessage:
    """Normalise one MessageLike into a ChatMessage (ValueError/TypeError for anything else)."""
    if isinstance(message, ChatMessage):
        return message
    calls: tuple[ToolCall, ...] = ()
    role: object
    content: object
    tool_call_id: object = ""
    name: object = ""
    reasoning: object = ""
    if isinstance(message, tuple):
        if len(message) != 2:
            raise ValueError(f"a chat message tuple must be (role, content), got {len(message)} items")
        role, content = message
    elif isinstance(message, Mapping):
        try:
            role = message["role"]
        except KeyError as exc:
            raise ValueError(f"a chat message mapping needs 'role' and 'content', missing {exc}") from None
        raw_calls = message.get("tool_calls") or ()
        calls = tuple(_tool_call(c) for c in raw_calls)
        if "content" not in message and not calls:
            raise ValueError("a chat message mapping needs 'role' and 'content', missing 'content'")
        content = message.get("content")
        if content is None and calls:  # OpenAI's assistant turn that only calls tools
            content = ""
        tool_call_id, name = message.get("tool_call_id") or "", message.get("name") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    else:
        raise TypeError(f"a chat message must be a ChatMessage, a (role, content) tuple or a mapping, got {message!r}")
    if not isinstance(role, str) or not isinstance(content, str):
        raise TypeError("a chat message's role and content must be strings")
    if not isinstance(tool_call_id, str) or not isinstance(name, str) or not isinstance(reasoning, str):
        raise TypeError("a chat message's tool_call_id, name and reasoning_content must be strings")
    return ChatMessage(role, content, calls, tool_call_id, name, reasoning)


def to_chat_messages(messages: Sequence[MessageLike]) -> tuple[ChatMessage, ...]:
    """Normalise a conversation; a bare string is rejected (it would be taken as characters)."""
    if isinstance(messages, (str, bytes)):
        raise TypeError("messages must be a sequence of chat messages, not a string")
    return tuple(to_chat_message(m) for m in messages)


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateOptions:
    """How to generate: sampling, stopping, what to return and the call's deadline.

    Every generate method takes one as ``options=``, and each field as a keyword that overrides it:
    ``client.generate_text(prompt, options=base, seed=1)``. Make variants with
    ``dataclasses.replace(base, temperature=0.7)``. The defaults are greedy decoding up to the server's
    default length. Values are sent as they are: the server checks them against its limits and answers
    with an InvalidRequestError that names the field.
    """

    max_new_tokens: int = 0
    """The most tokens to generate; 0 = the server's default."""
    temperature: float = 0.0
    """Softmax temperature; 0 = greedy."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches p; 0 or 1 = off."""
    repetition_penalty: float = 1.0
    """Makes tokens already seen (the prompt's too) less likely; 0 or 1 = off."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token generated so far; in [-2, 2], 0 = off."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time it was generated so far; in [-2, 2], 0 = off."""
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)
    """Token id -> number added to its logit before sampling, in [-100, 100] (-100 about bans it)."""
    seed: int | None = None
    """The same seed and request give the same tokens; None = a fresh random seed."""
    stop: Sequence[str] = ()
    """Strings that end generation (not part of the text); a single string is one stop string."""
    stop_token_ids: Sequence[int] = ()
    """Token ids that end generation as EOS does."""
    ignore_eos: bool = False
    """Keep going past end-of-sequence, up to max_new_tokens or the end of the context."""
    logprobs: bool = False
    """Return each generated token's log-probability."""
    top_logprobs: int = 0
    """Also return this many most likely alternatives at each position (implies logprobs)."""
    prompt_logprobs: bool = False
    """Return the prompt's tokens with their log-probabilities in the first event."""
    n: int = 1
    """How many choices (completions of the same prompt) to generate; their events carry ``index``.
    They share the prompt's computation; choice 0 uses ``seed`` and choice i a seed derived from
    (seed, i), so a seeded choice i is the same whatever n is. generate_choices() collects them."""
    request_id: str | None = None
    """Echoed in every event and in the server's logs; None = the server makes one."""
    adapter: str = ""
    """The LoRA adapter to generate with, by the name the server loaded it as; "" = the base model."""
    timeout: float | None = None
    """Deadline of the whole call in seconds, retries included; None = the client's default."""
    json_schema: str | Mapping[str, Any] | None = field(default=None, hash=False)
    """The output is JSON valid against this JSON Schema (a mapping, or its JSON text); at most one constraint."""
    json_object: bool = False
    """The output is one JSON object."""
    regex: str | None = None
    """The whole output matches this regular expression."""
    grammar: str | None = None
    """The output matches this grammar (in ``grammar_syntax``)."""
    grammar_syntax: Literal["lark", "gbnf"] = "lark"
    """How ``grammar`` is written: Lark (start rule ``start``) or llama.cpp's GBNF (start rule ``root``)."""
    tools: Sequence[ToolLike] = ()
    """Functions the model may call (chat input only): Tools or OpenAI-style mappings. A call ends the answer:
    the last event carries it in ``tool_calls``, with FinishReason.TOOL_CALLS."""
    tool_choice: ToolChoice = "auto"
    """"auto": the model decides; "none": no calls (the tools are not offered); "required": the answer is
    one or more calls; FunctionChoice(name): a call of that function. "required" and a function are
    enforced by a grammar, so the arguments validate against the function's schema. Not with a constraint."""
    parallel_tool_calls: bool | None = None
    """Whether one answer may hold several calls; None = the server's default (yes)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(to_tool(t) for t in self.tools))
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        # Tuples, so that options stay immutable (and hashable) whatever sequence was given.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # A copy: a caller's dict changing later changes nothing (it is left out of the hash, as a dict is).
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))


class GenerateOverrides(TypedDict, total=False):
    """GenerateOptions' fields as keyword arguments of the generate methods (``**overrides``).

    Names and types match GenerateOptions field for field: mypy checks the types where the overrides
    are applied (``dataclasses.replace``), and a test checks that no field is missing.
    """

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: Mapping[int, float]
    seed: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    n: int
    request_id: str | None
    adapter: str
    timeout: float | None
    json_schema: str | Mapping[str, Any] | None
    json_object: bool
    regex: str | None
    grammar: str | None
    grammar_syntax: Literal["lark", "gbnf"]
    tools: Sequence[ToolLike]
    tool_choice: ToolChoice
    parallel_tool_calls: bool | None


_DEFAULT_OPTIONS = GenerateOptions()
_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(GenerateOptions))


def resolve_options(caller: str, options: GenerateOptions | None, overrides: GenerateOverrides) -> GenerateOptions:
    """``options`` (default: GenerateOptions()) with the keyword ``overrides`` of ``caller`` applied.

    A keyword that is not an option is a TypeError, as it would be for a signature that listed them.
    """
    unknown = sorted(overrides.keys() - _OPTION_NAMES)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    if options is None:
        options = _DEFAULT_OPTIONS
    elif not isinstance(options, GenerateOptions):
        raise TypeError(f"options must be a GenerateOptions, got {type(options).__name__}")
    return dataclasses.replace(options, **overrides) if overrides else options


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    id: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class Token:
    """One generated (or prompt) token."""

    id: int
    text: str
    """The token's own text (bytes of a character split across tokens show as U+FFFD)."""
    logprob: float | None = None
    """Log-probability under the model; None when not asked for (and for the first prompt token)."""
    top_logprobs: tuple[TopLogprob, ...] = ()
    """The most likely tokens at this position, most likely first (as many as the request's top_logprobs)."""
    special: bool = False
    """A special token (EOS, end-of-turn, ...); its text is not part of the generated text."""

    @property
    def alternatives(self) -> tuple[TopLogprob, ...]:
        """Deprecated: the old name of `top_logprobs`."""
        warnings.warn("Token.alternatives is deprecated; use Token.top_logprobs", DeprecationWarning, stacklevel=2)
        return self.top_logprobs


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Timing:
    """Server-side timings of one request, in milliseconds from its arrival."""

    queue_ms: float
    time_to_first_token_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class GenerateEvent:
    """One streamed piece of a generation."""

    request_id: str
    text: str
    """Text added by this event (always whole UTF-8 characters; never part of a stop string)."""
    tokens: tuple[Token, ...] = ()
    """Tokens generated since the previous event."""
    prompt_tokens: tuple[Token, ...] = ()
    """The prompt's tokens with log-probabilities: first event only, when prompt_logprobs was asked for."""
    finish_reason: FinishReason | None = None
    """Last event only."""
    usage: Usage | None = None
    """Last event only."""
    timing: Timing | None = None
    """Last event only."""
    index: int = 0
    """The choice this event belongs to (0 to n - 1; always 0 unless the request asked for n > 1).
    With n > 1, is_last marks the end of this choice only."""
    reasoning_text: str = ""
    """Reasoning added by this event, apart from the answer in ``text`` (a harmony model's analysis
    channel, such as gpt-oss's, for chat input)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Last event of a request with tools: the calls read from the answer (a call written as text, as most
    families write them, was streamed in ``text`` already; a harmony model's calls never are)."""

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished generation."""

    request_id: str
    text: str
    tokens: tuple[Token, ...]
    prompt_tokens: tuple[Token, ...]
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    reasoning_text: str = ""
    """The model's reasoning, apart from the answer (a harmony model's analysis channel)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls of tools read from the answer (finish_reason is then TOOL_CALLS)."""

    def message(self) -> ChatMessage:
        """The answer as the assistant's turn of a conversation: its calls of tools (and no text, but the
        reasoning that led to them) when it made any, else its text. Append it, then a "tool" message per call, to continue the conversation."""
        if self.tool_calls:
            return ChatMessage("assistant", "", self.tool_calls, reasoning=self.reasoning_text)
        return ChatMessage("assistant", self.text)


@dataclass(frozen=True, slots=True)
class Tokenization:
    """Token ids and each token's text (parallel tuples)."""

    ids: tuple[int, ...]
    pieces: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's limits on one request and on its queue."""

    max_new_tokens: int
    max_top_logprobs: int
    max_stop_strings: int
    max_queue: int
    max_batch_size: int
    max_loras: int = 0  # LoRA adapters resident at once; 0 = adapters off
    max_lora_rank: int = 0
    max_n: int = 1  # the most choices (n) one request may ask
    max_constraint_length: int = 0  # the longest JSON schema, regex or grammar accepted, in characters
    constraint_compile_timeout_s: float = 0.0  # how long compiling a new constraint may take


@dataclass(frozen=True, slots=True)
class EngineState:
    """What an engine is doing (ModelInfo.engine sums it over the workers)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_size: int
    draft_tokens_proposed: int = 0  # speculative drafts checked since the workers started
    draft_tokens_accepted: int = 0  # of those, the ones kept


@dataclass(frozen=True, slots=True)
class RankState:
    """One process of a replica: a tensor-parallel rank and the device holding its shard."""

    rank: int
    pid: int
    device: str


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One replica (rank 0's engine, and every rank's process)."""

    worker_id: int
    alive: bool
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_size: int
    restarts: int
    ranks: tuple[RankState, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The loaded model and the server around it."""

    name: str
    context_length: int
    vocab_size: int
    backend: str
    device: str
    num_workers: int
    dtype: str
    limits: Limits
    engine: EngineState
    workers: tuple[WorkerState, ...]
    quantization: str = ""  # "none", "int8", "int4", or a mix such as "int4+none"
    weight_bytes: int = 0  # bytes of weights one forward pass reads, as served
    tensor_parallel: int = 1  # ranks (processes, devices) per replica
    # How the worker runs the model, each decision "value (reason)": "executor", "ops", "dtype", ...
    load_plan: Mapping[str, str] = field(default_factory=dict)
    # The LoRA adapters served (usable as GenerateOptions.adapter): name -> where the server read it.
    adapters: Mapping[str, str] = field(default_factory=dict)
