"""One embeddings call, after its body is parsed (embeddings_protocol.py) and its caller authorized.

The model must embed (the workers say how: ``WorkerInfo.embedding``); each text is tokenized here with the
special tokens the model's tokenizer puts around it ([CLS] ... [SEP], Qwen3's EOS after it), token ids are
taken as they are, and every input must fit the model's context, as OpenAI refuses a longer one. The router
hands the whole call to one worker, which runs each input as its own sequence. A refusal is a BadRequest
naming the field (400) or a ServiceError (the statuses the generation routes give).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import structlog

from tokenmill_service.contract.messages import EmbeddingInfo
from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.front.generation import GenerationService, ServiceError
from tokenmill_service.front.http.embeddings_protocol import EmbeddingsRequest, embeddings_json
from tokenmill_service.front.http.request_fields import BadRequest
from tokenmill_service.front.router import AdapterNotFound, RouterError, status_of

log = structlog.get_logger("tokenmill.server")

# What a model that does not embed answers, and which models do.
WHICH_MODELS_EMBED = (
    "an encoder (a BERT checkpoint: bge, all-MiniLM, e5), a Hugging Face checkpoint with a sentence-transformers "
    "pooling configuration (modules.json, 1_Pooling: Qwen3-Embedding), or a GGUF file with a pooling type"
)


def embedding_of(service: GenerationService) -> EmbeddingInfo | None:
    """How the served model embeds (None: it does not); ServiceError while no worker has loaded it."""
    info = next((w.info for w in service.router.workers if w.info is not None), None)
    if info is None:
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
    return info.embedding


async def create_embeddings(service: GenerationService, request: EmbeddingsRequest, adapter: str) -> dict[str, object]:
    """The answer to one embeddings request (``adapter``: the LoRA adapter its model names, "" for the base)."""
    started = time.monotonic()
    embedding = embedding_of(service)
    name = service.model_name()
    try:
        if adapter:
            service.router.adapters.check(adapter)  # an unknown name: 404, as on the other routes
            raise BadRequest(f"the LoRA adapter {adapter!r} does not embed: name the base model {name!r}", "model")
        if embedding is None:
            raise BadRequest(
                f"the model {name!r} does not embed: it is a generative model; the models that embed are "
                f"{WHICH_MODELS_EMBED}",
                "model",
                "model_does_not_embed",
            )
        if request.dimensions > embedding.dimensions:
            raise BadRequest(
                f"'dimensions' is {request.dimensions}, more than this model's {embedding.dimensions}", "dimensions"
            )
        vocab_size = service.limits().vocab_size
        inputs = await asyncio.to_thread(token_ids, request.inputs, service.tokenizer, embedding, vocab_size)
        vectors = await service.router.embed(inputs, request.dimensions)
    except RouterError as exc:
        code = status_of(exc) or grpc.StatusCode.UNAVAILABLE
        raise ServiceError(code, str(exc), "model" if isinstance(exc, AdapterNotFound) else None) from None
    tokens = sum(len(ids) for ids in inputs)
    log.info(
        "embeddings_finished", inputs=len(inputs), prompt_tokens=tokens, seconds=round(time.monotonic() - started, 4)
    )
    return embeddings_json(vectors, request.encoding_format, adapter or name, tokens)


def token_ids(
    inputs: Sequence[str | list[int]], tokenizer: Tokenizer, embedding: EmbeddingInfo, vocab_size: int
) -> list[list[int]]:
    """Each input's ids: a text tokenized between the model's special tokens, token ids as given; BadRequest
    naming ``input`` for an id outside the vocabulary or an input longer than the model's context."""
    out: list[list[int]] = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            ids = [*embedding.prefix_ids, *tokenizer.encode(item), *embedding.suffix_ids]
        else:
            ids = item
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise BadRequest(
                    f"'input[{i}]' holds the token id {bad}, outside the vocabulary (ids are 0..{vocab_size - 1})",
                    "input",
                )
        if embedding.max_tokens and len(ids) > embedding.max_tokens:
            raise BadRequest(
                f"This model's maximum context length is {embedding.max_tokens} tokens, however 'input[{i}]' has "
                f"{len(ids)} tokens. Please reduce the length of the input.",
                "input",
                "context_length_exceeded",
            )
        out.append(ids)
    return out
