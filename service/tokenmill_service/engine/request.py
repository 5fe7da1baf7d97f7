"""What goes into the engine (a request and its parameters) and what comes out (token events).

Plain picklable dataclasses: they cross the router <-> worker process boundary as they are.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # EOS / end-of-turn / a stop token id
    STOP_SEQUENCE = "stop_sequence"  # a stop string matched
    CONTEXT_LIMIT = "context_limit"  # the model's context is full
    CANCELLED = "cancelled"  # the caller went away or the deadline passed


class RequestError(ValueError):
    """A request the engine cannot run; the message names the field and the limit."""


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 0 or 1 = off
    repetition_penalty: float = 1.0  # 0 or 1 = off
    seed: int | None = None  # same seed, same tokens

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(slots=True)
class StoppingParams:
    max_new_tokens: int = 0  # 0 = until EOS or the end of the context
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False


@dataclass(slots=True)
class TopLogprob:
    id: int
    text: str
    logprob: float


@dataclass(slots=True)
class TokenOutput:
    id: int
    text: str  # this token's own text (bytes of a split character shown with U+FFFD)
    logprob: float | None = None  # log-probability under the model, before sampling transforms
    top_logprobs: list[TopLogprob] = field(default_factory=list)
    special: bool = False


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    tokens: list[TokenOutput] = field(default_factory=list)
    text: str = ""  # UTF-8-safe text delta; never holds a partial stop string
    prompt_tokens: list[TokenOutput] | None = None  # first output only, when prompt_logprobs
    finish_reason: FinishReason | None = None
    prompt_len: int = 0
    completion_len: int = 0
    # Seconds between arrival at the engine and first scheduling (first output only).
    queue_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
