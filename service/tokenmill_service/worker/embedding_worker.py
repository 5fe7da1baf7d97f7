"""Embeddings in a worker process: an encoder's whole worker loop, and the ``Embed`` command of any worker.

An encoder (BERT) only embeds: its worker loads it (no KV cache, no engine), says ``Ready`` with how it
embeds, and answers each ``Embed`` with ``Embedded``; a generation request that still reaches it is
``Rejected`` (the server refuses them first). A decoder that embeds (a checkpoint with a pooling configuration:
Qwen3-Embedding) runs its engine as every worker does, and its engine loop answers ``Embed`` between steps
with the same ``Embedder`` over the same weights. Importing this module does not import torch.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill_service.contract.messages import (
    AdapterResult,
    AddRequest,
    Cancel,
    Embed,
    Embedded,
    EmbeddingInfo,
    Failed,
    LoadAdapter,
    Ready,
    Rejected,
    Shutdown,
    UnloadAdapter,
    WorkerInfo,
    WorkerSpec,
)

if TYPE_CHECKING:
    from tokenmill_service.worker.models.embedder import Embedder
    from tokenmill_service.worker.worker import Channel

ENCODER_REFUSAL = "the model {name} is an encoder: it embeds only (POST /v1/embeddings) and does not generate"


def serves_an_encoder(path: Path, reader: Any) -> bool:
    """Whether this worker's model (found at ``path``, its GGUF file open as ``reader`` or None) is an encoder
    (False where it is not even readable: the ordinary start reports that)."""
    from tokenmill_service.worker.models.embedding_spec import is_encoder

    try:
        return is_encoder(path, reader)
    except (OSError, ValueError):
        return False


def encoder_main(spec: WorkerSpec, channel: Channel, log: Any) -> None:
    """Rank 0 of an encoder's replica: load it, say Ready, answer commands until Shutdown."""
    try:
        embedder, name = _load_encoder(spec)
    except Exception as exc:  # noqa: BLE001 - any start-up failure must reach the router as a message
        from tokenmill_service.contract.model_paths import ModelLoadError
        from tokenmill_service.contract.tokenizer import TokenizerError

        usage = isinstance(exc, (ModelLoadError, TokenizerError))
        log.error(
            "worker_start_refused" if usage else "worker_start_failed",
            error=str(exc),
            traceback=None if usage else traceback.format_exc(),
        )
        channel.send(Failed(f"{type(exc).__name__}: {exc}", usage=usage))
        return
    channel.send(
        Ready(
            WorkerInfo(
                worker_id=spec.worker_id,
                pid=os.getpid(),
                model_name=name,
                context_length=embedder.context_length,
                vocab_size=embedder.vocab_size,
                device=str(embedder.device),
                dtype="float32",
                kv_blocks_total=0,
                kv_block_size=spec.engine.block_size,
                backend="torch",
                plan={"architecture": "bert (an encoder: embeddings only)"},
                embedding=embedding_info(embedder, generates=False),
            )
        )
    )
    log.info("worker_ready", pid=os.getpid(), encoder=True)
    stop = threading.Event()
    beat = threading.Thread(target=channel.heartbeat, args=(spec.heartbeat_interval, stop), daemon=True)
    beat.start()
    try:
        while True:
            for cmd in channel.conn.recv():
                match cmd:
                    case AddRequest(request=request):
                        channel.send(Rejected(request.request_id, ENCODER_REFUSAL.format(name=name)))
                    case Embed():
                        channel.send(embed_command(embedder, cmd, channel))
                    case LoadAdapter(name=adapter) | UnloadAdapter(name=adapter):
                        load = isinstance(cmd, LoadAdapter)
                        channel.send(AdapterResult(adapter, load, "an encoder serves no LoRA adapters", "invalid"))
                    case Cancel():
                        pass  # nothing runs between commands
                    case Shutdown():
                        return
    except (EOFError, BrokenPipeError):
        log.warning("router_gone")
    finally:
        stop.set()
        log.info("worker_stopped")


def _load_encoder(spec: WorkerSpec) -> tuple[Embedder, str]:
    import torch

    from tokenmill_service.contract.model_paths import ModelLoadError, resolve_model_path
    from tokenmill_service.contract.tokenizer import load_tokenizer
    from tokenmill_service.worker.models.bert import load_bert
    from tokenmill_service.worker.models.embedder import Embedder
    from tokenmill_service.worker.models.embedding_spec import read_embedding_spec

    if spec.world_size > 1:
        raise ModelLoadError("an encoder runs whole on one device: --tensor-parallel must be 1")
    torch.set_num_threads(spec.threads)
    device = f"cuda:{spec.device_index}" if spec.options.device == "cuda" else "cpu"
    path = resolve_model_path(spec.options.model or None)
    embedding = read_embedding_spec(path)
    assert embedding is not None  # (an encoder always embeds)
    model = load_bert(path, device)
    config = model.config
    embedder = Embedder(model, embedding, config.hidden_size, model.device)
    embedder.context_length = _context(embedding.max_tokens, config.max_position_embeddings, spec.options.max_model_len)
    embedder.vocab_size = load_tokenizer(path).vocab_size
    embedder.embed([[*embedding.prefix_ids, *embedding.suffix_ids] or [0]])  # warm-up: nothing lazy left
    return embedder, config.name  # the directory's or the file's name, as a decoder's


def _context(st_limit: int, positions: int, asked: int) -> int:
    """The most tokens one input may hold: the model's positions, within sentence-transformers' limit and
    --max-model-len where they are set."""
    return min(n for n in (st_limit, positions, asked) if n > 0) if positions > 0 else max(st_limit, asked)


def decoder_embedder(model: Any, context_length: int, vocab_size: int, reader: Any = None) -> Embedder | None:
    """The embedder of a decoder whose checkpoint says how it embeds (None: it does not; EmbeddingConfigError:
    it says so in a way not supported). ``reader``: its GGUF file already open."""
    from tokenmill_service.worker.models.embedder import Embedder, decoder_hidden_states
    from tokenmill_service.worker.models.embedding_spec import read_embedding_spec

    plan = model.plan
    path = Path(plan.options.model) if plan is not None and plan.options.model else None
    if path is None:
        return None  # the embedded default model, a chat model
    embedding = read_embedding_spec(path, reader)
    if embedding is None:
        return None
    embedder = Embedder(decoder_hidden_states(model), embedding, model.config.hidden_size, model.device)
    embedder.context_length = min(n for n in (embedding.max_tokens, context_length) if n > 0)
    embedder.vocab_size = vocab_size
    embedder.embed([[*embedding.prefix_ids, *embedding.suffix_ids] or [0]])
    return embedder


def embedding_info(embedder: Embedder | None, generates: bool = True) -> EmbeddingInfo | None:
    if embedder is None:
        return None
    spec = embedder.spec
    return EmbeddingInfo(
        dimensions=embedder.dimensions,
        pooling=spec.pooling,
        normalize=spec.normalize,
        prefix_ids=list(spec.prefix_ids),
        suffix_ids=list(spec.suffix_ids),
        generates=generates,
        max_tokens=embedder.context_length,
    )


def embed_command(embedder: Embedder | None, cmd: Embed, channel: Channel) -> Embedded:
    """Carry out an Embed (the heartbeat says how long it has run, and its size, as for a step)."""
    if embedder is None:
        return Embedded(cmd.request_id, error="this model does not embed")
    channel.step_tokens = max(1, sum(len(ids) for ids in cmd.inputs))
    channel.step_started = time.monotonic()
    try:
        return Embedded(cmd.request_id, embedder.embed(cmd.inputs, cmd.dimensions))
    finally:
        channel.step_started = None
