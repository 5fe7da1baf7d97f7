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


# Below this temperature a request is greedy: dividing logits by less overflows (1e-45 gives inf and NaN),
# and the distribution is already the argmax's for any logit gap above about 0.01.
MIN_TEMPERATURE = 1e-3


_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request asking for several (n > 1) with `seed`: choice 0 keeps
    the seed itself and choice i > 0 gets splitmix64 of (seed, i). So choice i is the same whatever n
    (n = 4's first two choices are n = 2's), and, each choice's draws being keyed by its seed and
    position like any request's, the same in any batch."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class RequestError(ValueError):
    """A request the engine cannot run; the message names the field and the limit."""


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below MIN_TEMPERATURE) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 0 or 1 = off
    repetition_penalty: float = 1.0  # 0 or 1 = off
    seed: int | None = None  # same seed, same tokens
    # OpenAI's: subtracted once from the logit of every token already generated (presence) and once
    # per time it was generated (frequency); the prompt's tokens do not count. 0 = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def edits_logits(self) -> bool:
        """Whether sampling changes this row's logits before choosing (on a copy: see sampler.py)."""
        return (
            self.repetition_penalty not in (0.0, 1.0)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )


@dataclass(slots=True)
class StoppingParams:
    max_new_tokens: int = 0  # 0 = until EOS or the end of the context
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(slots=True, frozen=True)
class Constraint:
    """What the generated text must match (contract/grammar.py compiles it).

    kind: "json_schema" (text: the schema as JSON), "json_object" (any JSON object; text unused),
    "regex" (text: the pattern, matched whole) or "grammar" (text in ``syntax``: "lark" or "gbnf").
    harmony: the answer of a harmony chat, whose final channel's text must match (harmony_constraint.py).
    permissive: a json_schema read as JSON Schema reads it, where it does not say otherwise any further key of
    an object and any item of an array; else nothing more than it declares (closed_schema.py)."""

    kind: str
    text: str = ""
    syntax: str = ""
    harmony: bool = False
    permissive: bool = False


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    # A resumed request: the tokens already generated and sent to the caller before its replica failed.
    # The engine prefills prompt + these, counts them as generated (toward max_new_tokens and usage)
    # and emits only what follows them.
    resume_ids: list[int] = field(default_factory=list)
    # Generated text must match this (None: free text). A resumed request replays it over resume_ids.
    constraint: Constraint | None = None
    # The LoRA adapter it runs with, by name ("": the base model).
    adapter: str = ""
    # The choices of one request (n > 1) share this key: the scheduler starts one of them and the
    # others once its prompt's full blocks are in the prefix cache, so they share those blocks.
    prefix_group: str = ""


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


@dataclass(slots=True)
class EngineStats:
    """The engine's load, sent to the router after each step (torch-free, like everything here)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_size: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    compiled_graphs: int = 0  # graphs torch.compile built in the worker (constant once it is ready)
    draft_tokens_proposed: int = 0  # speculation's guesses checked, since start
    draft_tokens_accepted: int = 0  # of those, the ones kept
    # LoRA adapters: those of the running and of the waiting sequences, and every one served.
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
