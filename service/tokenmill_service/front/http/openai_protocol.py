"""OpenAI's `/v1/chat/completions` and `/v1/completions` request bodies, read as tokenmill's `GenerateRequest`.

A request body becomes a `GenerateRequest`, which then goes through the same validation as a gRPC
call (validation.py); this module only checks what is OpenAI's own (JSON types, `n`, parameters
tokenmill has no equivalent for). The answers are shaped by openai_response.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from tokenmill_service.front.http.openai_constraint import ConstraintParamError, apply_constraint
from tokenmill_service.front.http.openai_tools import ToolParamError, apply_tools, message_tool_fields
from tokenmill_service.front.http.request_fields import (
    BadRequest,
    boolean,
    check_model,
    integer,
    is_token_ids,
    json_object,
    number,
    text_of,
)
from tokenmill_service.front.proto import pb
from tokenmill_service.front.validation import CONSTRAINT_FIELDS

# The parameters each endpoint reads; any other top-level field is refused the way OpenAI's API refuses it
# ("Unrecognized request argument supplied: NAME"). openai_schema.py describes each of them for /openapi.json.
_READ_BY_BOTH = (
    "model", "n", "echo", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "presence_penalty",
    "frequency_penalty", "logit_bias", "max_tokens", "max_completion_tokens", "stop", "ignore_eos", "stop_token_ids",
    "logprobs", "stream", "stream_options", "response_format", "guided_json", "guided_regex", "guided_grammar",
    "guided_choice", "structured_outputs",
)  # fmt: skip
_READ_BY_CHAT = ("messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls")
_READ_BY_COMPLETIONS = ("prompt",)

# Parameters that change nothing a server does (who asks, how it is billed or kept, how hard a reasoning model
# thinks): accepted when of their type, and ignored.
IGNORED: dict[str, type] = {
    "user": str,
    "metadata": dict,
    "service_tier": str,
    "prompt_cache_key": str,
    "safety_identifier": str,
    "reasoning_effort": str,
    "verbosity": str,
}

# Parameters tokenmill cannot honour: refused when set to anything but a value that asks for nothing (what SDKs
# and frameworks send by default), OpenAI's and vLLM's extras alike.
_NEUTRAL_IN_BOTH: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
}
NEUTRAL_ONLY: dict[bool, dict[str, tuple[Any, ...]]] = {  # by chat (True) or completions (False)
    True: {
        "functions": ([],),
        "function_call": ("none", "auto"),
        "store": (False,),
        "modalities": (["text"],),
        "audio": (),
        "prediction": (),
        "web_search_options": (),
        **_NEUTRAL_IN_BOTH,
    },
    False: {"suffix": ("",), "best_of": (1,), **_NEUTRAL_IN_BOTH},
}


def parameters(chat: bool) -> frozenset[str]:
    """Every top-level field a chat (or completions) body may hold."""
    own = _READ_BY_CHAT if chat else _READ_BY_COMPLETIONS
    return frozenset((*_READ_BY_BOTH, *own, *IGNORED, *NEUTRAL_ONLY[chat]))


@dataclass(slots=True)
class ParsedRequest:
    """A validated body: the tokenmill request and how to shape the answer."""

    request: pb.GenerateRequest
    chat: bool
    stream: bool
    include_usage: bool
    model: str
    # The GenerateRequest's field paths this request sets under another name than usual (see openai_error).
    field_names: dict[str, str] = field(default_factory=dict)
    # Completions: one request per prompt of a list (`request` is the first), each answered as a choice.
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    # Completions' echo: the prompt (and its tokens' logprobs, with logprobs) come before the completion.
    echo: bool = False
    # echo with max_tokens 0: one token is generated (the engine always makes one) and left out.
    echo_only: bool = False
    # Choices per prompt (`n`): prompt i's choice j is the answer's choice i * n + j.
    n: int = 1
    # What another API's answer repeats of its request (the Responses API echoes its parameters).
    echoed: dict[str, Any] = field(default_factory=dict)


TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) to weights."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest("'logit_bias' must be an object of token id -> bias", "logit_bias")
    bias: dict[int, float] = {}
    for key, weight in value.items():
        # Digits only: int() would also take " 5", "+5" and other scripts' digits.
        if not TOKEN_ID_KEY.fullmatch(key):
            raise BadRequest(f"'logit_bias' keys must be token ids; given {key!r}", "logit_bias")
        token = int(key)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise BadRequest(f"'logit_bias' values must be weights; given {weight!r} for {key}", "logit_bias")
        bias[token] = float(weight)
    return bias


def read_messages(value: Any) -> pb.Messages:
    """A body's chat messages (/v1/chat/completions', /tokenize's)."""
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    chat = pb.Messages()
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role' string", "messages")
        content = m.get("content")
        message = chat.messages.add(
            role=m["role"],
            content="" if content is None else text_of(content, f"messages[{i}].content", f"messages[{i}].content"),
        )
        try:
            message_tool_fields(m, message, f"messages[{i}]")
        except ToolParamError as exc:
            raise BadRequest(str(exc), exc.param) from None
    return chat


# Prompts of one completions request (each its own sequence, answered as one choice), at most.
MAX_PROMPTS = 64


def _is_id(value: Any) -> bool:
    """A token id: an integer >= 0 (JSON's true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_ids(value: Any) -> bool:
    return bool(value) and is_token_ids(value)


def _prompts(value: Any) -> list[str | list[int]]:
    """The completions API's prompt: a string, token ids, or a list of either (a batch)."""
    if isinstance(value, str) or _is_ids(value):
        prompts: list[Any] = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or _is_ids(p) for p in value):
        prompts = value
    else:
        raise BadRequest("'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} are allowed", "prompt")
    if any(isinstance(p, list) and min(p) < 0 for p in prompts):
        raise BadRequest("'prompt' token ids must be >= 0", "prompt")
    return prompts


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    """Turn an OpenAI request body into a GenerateRequest (its limits are checked later, by validation.py)."""
    body = json_object(body)
    _check_parameters(body, chat)
    check_model(body)
    request = pb.GenerateRequest()
    # Choices per prompt; validation.py checks the upper bound (and names it `n`).
    n = integer(body, "n", minimum=1) or 1
    request.n = n
    echo = boolean(body, "echo")
    prompts = _read_input(body, chat, echo, request)
    _read_sampling(body, request.sampling)
    names: dict[str, str] = {}
    echo_only = _read_stopping(body, request.stopping, echo, names)
    _read_logprobs(body, request, chat, echo, names)
    _read_tools_and_format(body, request, chat, names)
    stream = boolean(body, "stream")
    if stream and len(prompts) > 1:
        raise BadRequest("'stream' takes one prompt; send a list of prompts without it", "stream", "unsupported_value")
    requests = _one_per_prompt(request, prompts)
    options = {} if body.get("stream_options") is None else body["stream_options"]
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    include_usage = boolean(options, "include_usage")
    model = body.get("model")
    return ParsedRequest(
        requests[0],
        chat,
        stream,
        include_usage,
        model or "",
        names,
        requests,
        echo,
        echo_only,
        n=n,
    )


def _check_parameters(body: dict[str, Any], chat: bool) -> None:
    """Refuse a parameter the endpoint does not read, one it cannot honour set to ask for something, and an
    ignored one of the wrong type."""
    known = parameters(chat)
    for name in body:
        if name not in known:
            raise BadRequest(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
    for name, neutral in NEUTRAL_ONLY[chat].items():
        value = body.get(name)
        # Compared with their types too: True == 1 and 0 == False, but neither is the neutral value.
        if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
            raise BadRequest(f"'{name}' is not supported by tokenmill; given {value!r}", name, "unsupported_parameter")
    for name, kind in IGNORED.items():
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise BadRequest(f"'{name}' must be {'an object' if kind is dict else 'a string'}; given {value!r}", name)


def _read_input(body: dict[str, Any], chat: bool, echo: bool, request: pb.GenerateRequest) -> list[str | list[int]]:
    """A chat's messages (set on ``request``), or the completions prompts (returned: one request each)."""
    if chat:
        if echo:
            raise BadRequest("'echo' is a completions parameter", "echo", "unsupported_parameter")
        if "messages" not in body:
            raise BadRequest("'messages' is required", "messages")
        request.chat.CopyFrom(read_messages(body["messages"]))
        return []
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", "prompt")
    return _prompts(body["prompt"])


def _read_sampling(body: dict[str, Any], sampling: pb.SamplingParams) -> None:
    # OpenAI's default temperature is 1 (sampling); 0 asks for greedy decoding.
    temperature = number(body, "temperature")
    sampling.temperature = 1.0 if temperature is None else temperature
    sampling.top_p = number(body, "top_p") or 0.0
    sampling.top_k = integer(body, "top_k", minimum=-(2**31), maximum=2**31 - 1) or 0
    sampling.repetition_penalty = number(body, "repetition_penalty") or 0.0
    seed = integer(body, "seed", minimum=0, maximum=2**64 - 1)
    if seed is not None:
        sampling.seed = seed
    sampling.presence_penalty = number(body, "presence_penalty") or 0.0
    sampling.frequency_penalty = number(body, "frequency_penalty") or 0.0
    sampling.logit_bias.update(_logit_bias(body.get("logit_bias")))


def _read_stopping(body: dict[str, Any], stopping: pb.StoppingParams, echo: bool, names: dict[str, str]) -> bool:
    """Where generation stops; whether the request asks for its prompt's echo alone (echo with max_tokens 0)."""
    # Scoring a prompt (lm-evaluation-harness) asks for its echo and no completion.
    max_tokens = integer(body, "max_tokens", minimum=0 if echo else 1)
    newer = integer(body, "max_completion_tokens", minimum=1)
    if newer is not None:  # OpenAI's newer name wins where both are given
        max_tokens = newer
        names["stopping.max_new_tokens"] = "max_completion_tokens"
    echo_only = echo and max_tokens == 0
    stopping.max_new_tokens = 1 if echo_only else max_tokens or 0
    stop = body.get("stop")
    if isinstance(stop, str):
        stopping.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stopping.stop.extend(stop)
    elif stop is not None:
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    stopping.ignore_eos = boolean(body, "ignore_eos")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_id(t) for t in stop_ids):
            raise BadRequest("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        stopping.stop_token_ids.extend(stop_ids)
    return echo_only


def _read_logprobs(
    body: dict[str, Any], request: pb.GenerateRequest, chat: bool, echo: bool, names: dict[str, str]
) -> None:
    if chat:
        request.logprobs = boolean(body, "logprobs")
        request.top_logprobs = integer(body, "top_logprobs") or 0
        if request.top_logprobs and not request.logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return
    # The completions API's logprobs is a count of alternatives (0 = the chosen token's own only).
    logprobs = integer(body, "logprobs")
    request.logprobs = logprobs is not None
    request.top_logprobs = logprobs or 0
    request.prompt_logprobs = echo and logprobs is not None
    names["top_logprobs"] = "logprobs"


def _read_tools_and_format(
    body: dict[str, Any], request: pb.GenerateRequest, chat: bool, names: dict[str, str]
) -> None:
    """A chat's tools and tool_choice (openai_tools.py); the output constraint, response_format or guided_*
    (openai_constraint.py)."""
    if chat:
        try:
            apply_tools(body, request)
        except ToolParamError as exc:
            raise BadRequest(str(exc), exc.param) from None
    try:
        param = apply_constraint(body, request)
    except ConstraintParamError as exc:
        raise BadRequest(str(exc), exc.param) from None
    if param is not None:
        names.update(dict.fromkeys(CONSTRAINT_FIELDS.values(), param))


def _one_per_prompt(request: pb.GenerateRequest, prompts: list[str | list[int]]) -> list[pb.GenerateRequest]:
    """``request`` for each prompt of a completions list (a chat's: itself, once)."""
    requests = []
    each: list[str | list[int] | None] = [*prompts] if prompts else [None]
    for prompt in each:
        one = pb.GenerateRequest()
        one.CopyFrom(request)
        if isinstance(prompt, str):
            one.prompt = prompt
        elif prompt is not None:
            one.token_ids.ids.extend(prompt)
        requests.append(one)
    return requests
