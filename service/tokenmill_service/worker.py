"""A worker process: one device, torch.distributed initialized, the engine loop.

The router talks to a worker over one pipe. Messages are batched both ways: the router sends
every command gathered since its last send as one list; the worker answers each engine step
with one message holding the outputs of every request in that step (never one message per
token per request).

    router -> worker: list of ("add", GenerationRequest) | ("cancel", request_id) | ("shutdown",)
    worker -> router: ("ready", WorkerInfo) | ("step", [RequestOutput], EngineStats)
                      | ("rejected", request_id, message) | ("stats", EngineStats) | ("failed", message)
"""

from __future__ import annotations

import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import structlog

from tokenmill_service.dtypes import dtype_name, resolve_dtype
from tokenmill_service.engine.config import EngineConfig
from tokenmill_service.engine.request import GenerationRequest, RequestError, StoppingParams
from tokenmill_service.log_setup import configure_logging


@dataclass(slots=True)
class WorkerSpec:
    worker_id: int
    rank: int
    # The GPU this process drives (replica * tensor_parallel + rank); unused on CPU.
    device_index: int
    world_size: int
    master_addr: str
    master_port: int
    model: str
    device: str
    dtype: str
    engine: EngineConfig
    threads: int
    log_format: str
    log_level: str


@dataclass(slots=True)
class WorkerInfo:
    worker_id: int
    pid: int
    model_name: str
    context_length: int
    vocab_size: int
    device: str
    dtype: str
    kv_blocks_total: int
    kv_block_size: int


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of the worker process (spawned; nothing is inherited from the router)."""
    # Ctrl-C in a terminal reaches the whole process group; shutting down is the router's call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(spec.log_format, spec.log_level)
    structlog.contextvars.bind_contextvars(worker_id=spec.worker_id, rank=spec.rank)
    log = structlog.get_logger("tokenmill.worker")
    os.environ.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
    )
    try:
        engine = _start_engine(spec, log)
    except Exception as exc:  # noqa: BLE001 - any start-up failure must reach the router as a message
        log.error("worker_start_failed", error=str(exc), traceback=traceback.format_exc())
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    stats = engine.stats()
    conn.send(
        (
            "ready",
            WorkerInfo(
                worker_id=spec.worker_id,
                pid=os.getpid(),
                model_name=engine.model.config.name,
                context_length=engine.max_model_len,
                vocab_size=engine.tokenizer.vocab_size,
                device=str(next(engine.model.parameters()).device),
                dtype=dtype_name(next(engine.model.parameters()).dtype),
                kv_blocks_total=stats.kv_blocks_total,
                kv_block_size=stats.kv_block_size,
            ),
        )
    )
    log.info("worker_ready", pid=os.getpid(), kv_blocks=stats.kv_blocks_total)
    try:
        _serve(engine, conn, log)
    except (EOFError, BrokenPipeError):
        log.warning("router_gone")  # the router died: nothing left to serve
    except Exception:
        # An engine failure ends this process; the router fails its calls and starts a new worker.
        log.exception("engine_failed")
        raise SystemExit(1) from None
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        log.info("worker_stopped")


def _start_engine(spec: WorkerSpec, log: Any) -> Any:
    import torch
    import torch.distributed as dist

    from tokenmill_service.engine.llm_engine import LLMEngine

    torch.set_num_threads(spec.threads)
    if spec.device == "cuda":
        if spec.device_index >= torch.cuda.device_count():
            raise RuntimeError(
                f"worker {spec.worker_id} needs GPU {spec.device_index} but {torch.cuda.device_count()} are visible: "
                "lower --workers or --tensor-parallel"
            )
        torch.cuda.set_device(spec.device_index)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method="env://", rank=spec.rank, world_size=spec.world_size)
    log.info("distributed_initialized", backend=backend, world_size=spec.world_size, master_port=spec.master_port)
    device = f"cuda:{spec.device_index}" if spec.device == "cuda" else "cpu"
    dtype = resolve_dtype(spec.dtype, device)
    engine = LLMEngine.from_path(spec.model or None, spec.engine, dtype=dtype, device=device)
    # Warm-up: one real prefill and decode, so the first caller does not pay for lazy set-up.
    warm = engine.tokenizer.encode("Hello")
    engine.add_request(GenerationRequest("warmup", warm, stopping=StoppingParams(max_new_tokens=2, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    return engine


def _serve(engine: Any, conn: Connection, log: Any) -> None:
    while True:
        # Block while idle; while busy, only pick up what has already arrived.
        timeout = 0.0 if engine.has_unfinished() else None
        dirty = False
        while conn.poll(timeout):
            timeout = 0.0
            for cmd in conn.recv():
                kind = cmd[0]
                if kind == "add":
                    request: GenerationRequest = cmd[1]
                    try:
                        engine.add_request(request)
                    except RequestError as exc:
                        conn.send(("rejected", request.request_id, str(exc)))
                elif kind == "cancel":
                    dirty |= engine.cancel(cmd[1])
                elif kind == "shutdown":
                    for rid in list(engine.sequences):
                        engine.cancel(rid)
                    return
        if engine.has_unfinished():
            outputs = engine.step()
            conn.send(("step", outputs, engine.stats()))
        elif dirty:
            conn.send(("stats", engine.stats()))
