"""OpenAI's `/v1/chat/completions` and `/v1/completions` JSON, translated to and from tokenmill's API.

A request body becomes a `GenerateRequest`, which then goes through the same validation as a gRPC
call (validation.py); this module only checks what is OpenAI's own (JSON types, `n`, parameters
tokenmill has no equivalent for). Responses are built from `GenerateResponse` messages.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenmill_service.openai_constraint import ConstraintParamError, apply_constraint
from tokenmill_service.openai_tools import ToolParamError, apply_tools, message_tool_fields, tool_calls_json
from tokenmill_service.proto import pb
from tokenmill_service.validation import CONSTRAINT_FIELDS


class BadRequest(ValueError):
    """A body that is not a valid OpenAI request; the message names the parameter, `code` says what is wrong."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


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


_FINISH = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CONTEXT_LIMIT: "length",
    pb.FINISH_REASON_EOS: "stop",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


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


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a number; given {value!r}", name)
    return float(value)


UINT32_MAX = 2**32 - 1


def _integer(body: dict[str, Any], name: str, minimum: int = 0, maximum: int = UINT32_MAX) -> int | None:
    """An integer field within [minimum, maximum] (the range of the request's field it goes to: uint32 unless
    said), else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # (JSON's 5.0 is the integer 5, as JSON Schema and this API's description read it)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer; given {value!r}", name)
    if value < minimum:
        raise BadRequest(f"'{name}' must be >= {minimum}; given {value}", name)
    if value > maximum:
        raise BadRequest(f"'{name}' must be <= {maximum}; given {value}", name)
    return value


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false; given {value!r}", name)
    return value


TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) to numbers."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest("'logit_bias' must be an object of token id -> bias", "logit_bias")
    bias: dict[int, float] = {}
    for key, number in value.items():
        # Digits only: int() would also take " 5", "+5" and other scripts' digits.
        if not TOKEN_ID_KEY.fullmatch(key):
            raise BadRequest(f"'logit_bias' keys must be token ids; given {key!r}", "logit_bias")
        token = int(key)
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise BadRequest(f"'logit_bias' values must be numbers; given {number!r} for {key}", "logit_bias")
        bias[token] = float(number)
    return bias


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (the only part type a text model takes)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}[{i}] must be a text part ({{'type': 'text', 'text': ...}})", where)
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{where} must be a string or a list of text parts", where)


def _messages(value: Any) -> pb.Messages:
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    chat = pb.Messages()
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role' string", "messages")
        content = m.get("content")
        message = chat.messages.add(
            role=m["role"], content="" if content is None else _content(content, f"messages[{i}].content")
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
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


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
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
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
    _model(body)
    request = pb.GenerateRequest()
    # Choices per prompt; validation.py checks the upper bound (and names it `n`).
    n = _integer(body, "n", minimum=1) or 1
    request.n = n
    prompts: list[str | list[int]] = []
    echo = _boolean(body, "echo")
    if chat:
        if echo:
            raise BadRequest("'echo' is a completions parameter", "echo", "unsupported_parameter")
        if "messages" not in body:
            raise BadRequest("'messages' is required", "messages")
        request.chat.CopyFrom(_messages(body["messages"]))
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", "prompt")
        prompts = _prompts(body["prompt"])

    sampling = request.sampling
    # OpenAI's default temperature is 1 (sampling); 0 asks for greedy decoding.
    temperature = _number(body, "temperature")
    sampling.temperature = 1.0 if temperature is None else temperature
    sampling.top_p = _number(body, "top_p") or 0.0
    sampling.top_k = _integer(body, "top_k", minimum=-(2**31), maximum=2**31 - 1) or 0
    sampling.repetition_penalty = _number(body, "repetition_penalty") or 0.0
    seed = _integer(body, "seed", minimum=0, maximum=2**64 - 1)
    if seed is not None:
        sampling.seed = seed
    sampling.presence_penalty = _number(body, "presence_penalty") or 0.0
    sampling.frequency_penalty = _number(body, "frequency_penalty") or 0.0
    sampling.logit_bias.update(_logit_bias(body.get("logit_bias")))

    stopping = request.stopping
    names: dict[str, str] = {}
    # Scoring a prompt (lm-evaluation-harness) asks for its echo and no completion.
    max_tokens = _integer(body, "max_tokens", minimum=0 if echo else 1)
    newer = _integer(body, "max_completion_tokens", minimum=1)
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
    stopping.ignore_eos = _boolean(body, "ignore_eos")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_id(t) for t in stop_ids):
            raise BadRequest("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        stopping.stop_token_ids.extend(stop_ids)

    if chat:
        request.logprobs = _boolean(body, "logprobs")
        request.top_logprobs = _integer(body, "top_logprobs") or 0
        if request.top_logprobs and not request.logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        # The completions API's logprobs is a count of alternatives (0 = the chosen token's own only).
        logprobs = _integer(body, "logprobs")
        request.logprobs = logprobs is not None
        request.top_logprobs = logprobs or 0
        request.prompt_logprobs = echo and logprobs is not None
        names["top_logprobs"] = "logprobs"

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

    stream = _boolean(body, "stream")
    if stream and len(prompts) > 1:
        raise BadRequest("'stream' takes one prompt; send a list of prompts without it", "stream", "unsupported_value")
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
    options = {} if body.get("stream_options") is None else body["stream_options"]
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    include_usage = _boolean(options, "include_usage")
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


# -- errors ------------------------------------------------------------------------------------


def renamed(exc: BadRequest, names: dict[str, str]) -> BadRequest:
    """A refusal by parse_request in the words of another API that reads its body through it: each parameter
    of ``names`` (and each field under it) as that API calls it, where the message quotes it and in ``param``."""
    message, param = str(exc), exc.param
    for old, new in sorted(names.items(), key=lambda item: -len(item[0])):
        message = re.sub(rf"'{re.escape(old)}(?=['.\[])", f"'{new}", message)
        if param is not None and (param == old or param.startswith(old + ".")):
            param = new + param[len(old) :]
    return BadRequest(message, param, exc.code)


# The GenerateRequest's field paths (what validation's messages name) as OpenAI's API names them;
# any other sampling.* or stopping.* field is one of tokenmill's extras, named by its last part.
_OPENAI_FIELDS = {
    "prompt": "prompt",
    "token_ids.ids": "prompt",
    "chat.messages": "messages",
    "stopping.max_new_tokens": "max_tokens",
    "max_new_tokens": "max_tokens",  # the engine's own messages leave out the "stopping."
    "stopping.stop": "stop",
    "top_logprobs": "top_logprobs",
}
_FIELD_PATH = re.compile(
    r"(?<![\w.'])(?:sampling\.\w+|stopping\.\w+|chat\.messages|token_ids\.ids|top_logprobs|max_new_tokens)\b"
)


def openai_error(message: str, field: str | None, names: dict[str, str] | None = None) -> tuple[str, str | None]:
    """A validation message with each field path it names in the words of the request the caller sent
    (``names``: ParsedRequest.field_names), and the OpenAI ``param`` of the field it is about."""
    known = {**_OPENAI_FIELDS, **(names or {})}
    if "stopping.max_new_tokens" in known:
        known["max_new_tokens"] = known["stopping.max_new_tokens"]

    def name(path: str) -> str:
        return known.get(path) or path.rpartition(".")[2]

    return _FIELD_PATH.sub(lambda m: name(m.group()), message), (name(field) if field else None)


# -- vLLM's /tokenize and /detokenize ------------------------------------------------------------


@dataclass(slots=True)
class TokenizeBody:
    """A /tokenize body: text (with BOS when the model adds one and add_special_tokens) or a chat."""

    prompt: str | None
    chat: pb.Messages | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


def _model(body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"'model' must be a string; given {model!r}", "model")


def parse_tokenize(body: Any) -> TokenizeBody:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _model(body)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("give exactly one of 'prompt' (a string) and 'messages' (a chat)", "prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string", "prompt")

    def flag(name: str, default: bool) -> bool:
        return default if body.get(name) is None else _boolean(body, name)

    return TokenizeBody(
        prompt=prompt,
        chat=None if messages is None else _messages(messages),
        # vLLM's defaults: special tokens for text, none beyond the template's for a chat.
        add_special_tokens=flag("add_special_tokens", prompt is not None),
        add_generation_prompt=flag("add_generation_prompt", True),
        return_token_strs=flag("return_token_strs", False),
    )


def parse_detokenize(body: Any) -> list[int]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _model(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("'tokens' must be a list of token ids", "tokens")
    if tokens and min(tokens) < 0:
        raise BadRequest("'tokens' must be token ids >= 0", "tokens")
    return tokens


# -- responses ---------------------------------------------------------------------------------


def usage_json(usage: pb.Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def finish_reason(response: pb.GenerateResponse) -> str | None:
    return _FINISH.get(response.finish_reason)


def _visible(tokens: Sequence[pb.Token]) -> list[pb.Token]:
    # Special tokens (EOS, end of turn) are not part of the text, so OpenAI's logprobs leave them out.
    return [t for t in tokens if not t.special]


def chat_logprobs(tokens: Sequence[pb.Token]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.text,
                "logprob": t.logprob,
                "bytes": list(t.text.encode()),
                "top_logprobs": [
                    {"token": a.text, "logprob": a.logprob, "bytes": list(a.text.encode())} for a in t.top_logprobs
                ],
            }
            for t in _visible(tokens)
        ]
    }


def completion_logprobs(
    tokens: Sequence[pb.Token], text_offset: int, prompt_tokens: Sequence[pb.Token] = (), echo: bool = False
) -> dict[str, Any]:
    """OpenAI's legacy shape; with echo the prompt's tokens come first, all of them (the first has no
    logprob: null, as OpenAI's), so that position i is the prompt's token i, and every generated token
    follows, special ones (EOS) included: a scorer (lm-evaluation-harness) asks for one token more than
    the prompt and drops the last position, whatever that token is."""
    shown = [*prompt_tokens, *(tokens if echo else _visible(tokens))]
    offsets = []
    for t in shown:
        offsets.append(text_offset)
        text_offset += len(t.text)
    return {
        "tokens": [t.text for t in shown],
        "token_logprobs": [t.logprob if t.HasField("logprob") else None for t in shown],
        "top_logprobs": [{a.text: a.logprob for a in t.top_logprobs} if t.HasField("logprob") else None for t in shown],
        "text_offset": offsets,
    }


class ResponseBuilder:
    """Shapes one request's GenerateResponse messages into OpenAI chunks or a whole response.

    ``echo_texts``: with echo, each prompt's text (what the answer starts with), one per request.
    With n > 1 a prompt's responses interleave its choices (GenerateResponse.index); prompt i's
    choice j is the answer's choice i * n + j, as OpenAI numbers them.

    Another API served through the chat path (anthropic_protocol.py, responses_protocol.py) subclasses it:
    its answer is the chat answer reshaped, and a stream's events, their framing and its errors are its own
    (the methods from ``events`` down)."""

    # What ends a stream, after its last event.
    STREAM_END: ClassVar[bytes] = b"data: [DONE]\n\n"
    # A stream's events as bare `data:` lines (OpenAI's chat and completions), or each named by its type
    # (`event: TYPE`, as Anthropic's and the Responses API's are).
    NAMED_EVENTS: ClassVar[bool] = False

    def __init__(self, parsed: ParsedRequest, request_id: str, model: str, echo_texts: Sequence[str] = ()) -> None:
        self.parsed = parsed
        self.chat = parsed.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.created = int(time.time())
        # The server's name for its model (what /v1/models lists), whatever name the request used.
        self.model = model or parsed.model
        self.echo_texts = list(echo_texts) if parsed.echo else []
        # A stream's state per choice: the text sent so far (for text_offset), its echo sent or not.
        self.text_offset: dict[int, int] = {}
        self.echoed: set[int] = set()
        self.prompt_tokens: Sequence[pb.Token] = ()  # with echo: choice 0's, shown with every choice
        self.usage = pb.Usage()  # a stream's, summed as its choices finish

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(
        self, index: int, tokens: Sequence[pb.Token], prompt_tokens: Sequence[pb.Token] = ()
    ) -> dict[str, Any] | None:
        if not self.parsed.request.logprobs:
            return None
        if self.chat:
            return chat_logprobs(tokens)
        shaped = completion_logprobs(tokens, self.text_offset.get(index, 0), prompt_tokens, self.parsed.echo)
        self.text_offset[index] = self.text_offset.get(index, 0) + sum(len(t) for t in shaped["tokens"])
        return shaped

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant's role, one chunk per choice, as OpenAI's do."""
        if not self.chat:
            return []
        return [
            self._chunk(
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
            for i in range(self.parsed.n)
        ]

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = [choice]
        if self.parsed.include_usage:
            chunk["usage"] = None
        return chunk

    def _shown(self, response: pb.GenerateResponse) -> tuple[str, Sequence[pb.Token]]:
        """What of a response the caller sees: nothing generated when echo asked for none."""
        return ("", ()) if self.parsed.echo_only else (response.text, response.tokens)

    def chunk(self, response: pb.GenerateResponse) -> dict[str, Any] | None:
        """One streamed chunk, or None when the response adds nothing a client would see."""
        index = response.index
        if response.prompt_tokens:
            self.prompt_tokens = response.prompt_tokens
        reason = finish_reason(response)
        if reason is not None:
            one = self._usage(response)
            self.usage.prompt_tokens = one.prompt_tokens  # the same prompt for every choice: once
            self.usage.completion_tokens += one.completion_tokens
        text, tokens = self._shown(response)
        prompt_tokens: Sequence[pb.Token] = ()
        if self.echo_texts and index not in self.echoed:
            self.echoed.add(index)
            text, prompt_tokens = self.echo_texts[0] + text, self.prompt_tokens
        calls = tool_calls_json(response.tool_calls, delta=True) if reason is not None else []
        reasoning = response.reasoning_text
        if not text and not reasoning and not tokens and not prompt_tokens and reason is None:
            return None
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": text} if text or reason is None else {}
            if reasoning:
                choice["delta"]["reasoning_content"] = reasoning
            if calls:
                choice["delta"]["tool_calls"] = calls
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(index, tokens, prompt_tokens)
        choice["finish_reason"] = reason
        return self._chunk(choice)

    def _usage(self, last: pb.GenerateResponse) -> pb.Usage:
        # The token generated for echo alone is not part of the answer.
        return (
            pb.Usage(prompt_tokens=last.usage.prompt_tokens, completion_tokens=0)
            if self.parsed.echo_only
            else last.usage
        )

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        chunk["choices"] = []
        chunk["usage"] = usage_json(self.usage)
        return chunk

    def events(self, response: pb.GenerateResponse) -> list[dict[str, Any]]:
        """A stream's events for one response (OpenAI's: a chunk, or none)."""
        chunk = self.chunk(response)
        return [] if chunk is None else [chunk]

    def last_events(self) -> list[dict[str, Any]]:
        """What a stream sends after its last response."""
        return [self.usage_chunk()] if self.parsed.include_usage else []

    def sse(self, event: dict[str, Any]) -> bytes:
        """One event as server-sent."""
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return (f"event: {event['type']}\n" if self.NAMED_EVENTS else "").encode() + f"data: {data}\n\n".encode()

    @staticmethod
    def error_body(status: int, body: dict[str, Any]) -> dict[str, Any]:
        """A refusal's body, from OpenAI's error JSON (``error_json``) and its HTTP status."""
        return body

    def error_event(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        """A failure after a stream's status was sent, from OpenAI's error JSON: the stream's last event."""
        return body

    def whole(self, results: Sequence[Sequence[pb.GenerateResponse]]) -> dict[str, Any]:
        """The non-streaming answer: per request (prompt) and choice, every response's text and tokens
        joined. Usage counts each prompt once and every choice's tokens."""
        choices, usage = [], pb.Usage()
        n = self.parsed.n
        for prompt_index, responses in enumerate(results):
            by_choice: list[list[pb.GenerateResponse]] = [[] for _ in range(n)]
            for r in responses:
                by_choice[r.index].append(r)
            prompt_tokens: Sequence[pb.Token] = ()
            for r in by_choice[0][:1]:
                prompt_tokens = r.prompt_tokens
            for j, mine in enumerate(by_choice):
                index = prompt_index * n + j
                shown = [self._shown(r) for r in mine]
                text = "".join(t for t, _ in shown)
                tokens = [t for _, ts in shown for t in ts]
                echoed: Sequence[pb.Token] = ()
                if self.echo_texts:
                    text, echoed = self.echo_texts[prompt_index] + text, prompt_tokens
                last = mine[-1]
                choice: dict[str, Any] = {"index": index}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": text}
                    if reasoning := "".join(r.reasoning_text for r in mine):
                        choice["message"]["reasoning_content"] = reasoning
                    if last.tool_calls:
                        # The text before the calls (the calls' own text is never in it).
                        choice["message"]["content"] = text.strip() or None
                        choice["message"]["tool_calls"] = tool_calls_json(last.tool_calls)
                else:
                    choice["text"] = text
                choice["logprobs"] = self._logprobs(index, tokens, echoed)
                choice["finish_reason"] = finish_reason(last)
                choices.append(choice)
                one = self._usage(last)
                if j == 0:
                    usage.prompt_tokens += one.prompt_tokens
                usage.completion_tokens += one.completion_tokens
        answer = self._envelope("chat.completion" if self.chat else "text_completion")
        answer["choices"] = choices
        answer["usage"] = usage_json(usage)
        return answer


def error_json(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class Dialect:
    """One HTTP API that generates through this module's request: how its body becomes a ParsedRequest, and the
    ResponseBuilder that shapes its answers and errors."""

    parse: Callable[[Any], ParsedRequest]
    builder: type[ResponseBuilder] = ResponseBuilder
    # A header that may carry the API key instead of Authorization's bearer token (Anthropic's x-api-key).
    key_header: str | None = None


CHAT = Dialect(lambda body: parse_request(body, chat=True))
COMPLETIONS = Dialect(lambda body: parse_request(body, chat=False))
