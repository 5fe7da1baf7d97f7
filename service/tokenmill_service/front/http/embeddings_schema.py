"""POST /v1/embeddings described for /openapi.json: the body embeddings_protocol.py parses (exactly its fields,
with its bounds) and the answer it shapes."""

from __future__ import annotations

from tokenmill_service.front.http.embeddings_protocol import ENCODING_FORMATS, MAX_INPUTS
from tokenmill_service.front.http.openai_schema import COUNT, INTEGER, STRING, Schema, between, nullable, token_id
from tokenmill_service.front.validation import Limits


def request_schema(limits: Limits) -> Schema:
    ids: Schema = {"type": "array", "minItems": 1, "items": token_id(limits)}
    text: Schema = {"type": "string", "minLength": 1}
    return {
        "type": "object",
        "required": ["input"],
        "properties": {
            "input": {
                "description": "a string, token ids, or a list of either (one vector each); each within the "
                "model's context",
                "anyOf": [
                    text,
                    ids,
                    {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": {"anyOf": [text, ids]}},
                ],
            },
            "model": nullable(STRING),
            "dimensions": nullable(
                between(
                    "integer",
                    1,
                    description="the vector's first components only, renormalized where the "
                    "model normalizes; at most the model's size",
                )
            ),
            "encoding_format": {"enum": [*ENCODING_FORMATS, None], "description": "base64: little-endian float32"},
            "user": nullable(STRING),
        },
    }


EMBEDDING: Schema = {
    "type": "object",
    "required": ["object", "index", "embedding"],
    "properties": {
        "object": {"const": "embedding"},
        "index": INTEGER,
        "embedding": {
            "anyOf": [{"type": "array", "items": {"type": "number"}}, STRING],
            "description": "floats, or (encoding_format base64) their little-endian float32 bytes in base64",
        },
    },
}
EMBEDDINGS: Schema = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": EMBEDDING},
        "model": STRING,
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "total_tokens"],
            "properties": {"prompt_tokens": COUNT, "total_tokens": COUNT},
        },
    },
}
