"""The client's public value types for what the server answers: events, results, tokens, the model's
information and the status enums; frozen dataclasses and string enums, independent of protobuf. (The
request side: _chat.py and _options.py.)"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from ._chat import ChatMessage, ToolCall


class _StrEnum(str, enum.Enum):
    """An enum of strings that prints as its value (enum.StrEnum, which needs Python 3.11)."""

    _value_: str

    def __str__(self) -> str:
        return self.value


class FinishReason(_StrEnum):
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


class HealthStatus(_StrEnum):
    """A grpc.health.v1 serving status."""

    UNKNOWN = "UNKNOWN"
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"
    SERVICE_UNKNOWN = "SERVICE_UNKNOWN"


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
