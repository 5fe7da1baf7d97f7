"""OpenAI's embeddings body (POST /v1/embeddings) parsed, and its answer shaped.

``input`` is a string, a list of strings, a list of token ids or a list of such lists; each string or list is
one input and gets one vector. ``dimensions`` cuts each vector to its first components (renormalized where the
model normalizes, as Matryoshka models are used); ``encoding_format`` is ``float`` (the default) or
``base64``: the vector's little-endian float32 bytes, which OpenAI's SDK decodes (and asks for by default).
embeddings_schema.py describes the same fields for /openapi.json.
"""

from __future__ import annotations

import array
import base64
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill_service.front.http.request_fields import BadRequest

# The fields the parser reads; any other is refused as the other routes refuse it.
PARAMETERS = ("input", "model", "dimensions", "encoding_format", "user")
ENCODING_FORMATS = ("float", "base64")
# OpenAI's own bound on the inputs of one request.
MAX_INPUTS = 2048


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    # Each input: its text, or its token ids (taken as they are: no special tokens added).
    inputs: list[str | list[int]]
    model: str = ""
    dimensions: int = 0  # 0: the model's whole vector
    encoding_format: str = "float"


def parse_embeddings(body: Any) -> EmbeddingsRequest:
    """The request, or BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in body:
        if name not in PARAMETERS:
            raise BadRequest(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
    inputs = _inputs(body.get("input"))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"'model' must be a string; given {model!r}", "model")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1):
        raise BadRequest(f"'dimensions' must be a positive integer; given {dimensions!r}", "dimensions")
    encoding_format = body.get("encoding_format")
    if encoding_format is not None and encoding_format not in ENCODING_FORMATS:
        raise BadRequest(
            f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}; given {encoding_format!r}",
            "encoding_format",
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"'user' must be a string; given {user!r}", "user")
    return EmbeddingsRequest(inputs, model or "", dimensions or 0, encoding_format or "float")


def _inputs(value: Any) -> list[str | list[int]]:
    shape = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise BadRequest(
            f"'input' is required: {shape}", "input", "missing_required_parameter" if value is None else "invalid_value"
        )
    if not value:
        raise BadRequest("'input' must not be empty", "input")
    if len(value) > MAX_INPUTS:
        raise BadRequest(f"'input' holds {len(value)} inputs; at most {MAX_INPUTS} are allowed", "input")
    if all(_is_id(v) for v in value):
        return [list(value)]  # one input as token ids
    inputs: list[str | list[int]] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise BadRequest(f"'input[{i}]' is an empty string: each input needs text", "input")
            inputs.append(item)
        elif isinstance(item, list) and item and all(_is_id(t) for t in item):
            inputs.append(list(item))
        elif isinstance(item, list) and not item:
            raise BadRequest(f"'input[{i}]' is an empty list: each input needs tokens", "input")
        else:
            raise BadRequest(f"'input[{i}]' is {type(item).__name__}: 'input' must be {shape}", "input")
    return inputs


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def embeddings_json(vectors: Sequence[bytes], encoding_format: str, model: str, prompt_tokens: int) -> dict[str, Any]:
    """The answer, as OpenAI's CreateEmbeddingResponse: each vector as floats or as base64 of its float32 bytes."""
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vector, encoding_format)}
        for i, vector in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def _encoded(vector: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector).decode("ascii")
    values = array.array("f", vector)
    if sys.byteorder == "big":  # (the worker sends little-endian)
        values.byteswap()
    return values.tolist()
