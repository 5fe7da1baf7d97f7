"""A worker process: one device, one rank of a replica's torch.distributed group.

Rank 0 runs the engine loop; the other ranks of a tensor-parallel replica (`follower_main`) load
their shard and run each step rank 0 broadcasts (`worker/distributed/step_broadcast.py`). The router
talks to rank 0 only, over one pipe with the typed messages of `messages.py`. Besides the
engine loop, a heartbeat thread reports every `spec.heartbeat_interval` seconds, and with it how
long the current step has run, so the router can tell a stopped or hung process from a busy one.
Importing this module does not import torch (the router imports it for `worker_main`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import select
import signal
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import structlog

from tokenmill_service.contract.log_setup import configure_logging
from tokenmill_service.contract.messages import (
    AdapterResult,
    AddRequest,
    Cancel,
    Embed,
    Event,
    Failed,
    Heartbeat,
    LoadAdapter,
    Ready,
    Rejected,
    Shutdown,
    Stats,
    StepOutputs,
    UnloadAdapter,
    WorkerInfo,
    WorkerSpec,
)
from tokenmill_service.contract.request import RequestError
from tokenmill_service.worker.embedding_worker import (
    decoder_embedder,
    embed_command,
    embedding_info,
    encoder_main,
    serves_an_encoder,
)

__all__ = ["WorkerInfo", "WorkerSpec", "worker_main"]


class Channel:
    """The worker's end of the pipe, shared by the engine loop and the heartbeat thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        # When the step in progress started (None between steps) and its size in tokens.
        self.step_started: float | None = None
        self.step_tokens = 0
        # Registered once: Connection.poll builds a selector on every call, and the engine loop checks for
        # commands before every step.
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    def readable(self, timeout: float | None) -> bool:
        """Whether a command (or the router's end of the pipe closing) is there to read, waiting up to
        ``timeout`` seconds (None: until there is): ``Connection.poll``'s answer."""
        return bool(self._poller.poll(None if timeout is None else timeout * 1000))

    def send(self, event: Event) -> None:
        with self._lock:
            self.conn.send(event)

    def heartbeat(self, interval: float, stop: threading.Event) -> None:
        while not stop.wait(interval):
            started = self.step_started
            beat = Heartbeat(None if started is None else time.monotonic() - started, self.step_tokens)
            try:
                self.send(beat)
            except (OSError, EOFError):
                return  # the router is gone; the engine loop notices too


def worker_main(spec: WorkerSpec, conn: Connection | None) -> None:
    """Entry point of a worker process (spawned; nothing is inherited from the router). Rank 0 gets
    the pipe to the router; the other ranks get None and follow rank 0."""
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
    if conn is None:
        _follower_main(spec, log)
        return
    channel = Channel(conn)
    found = _model_file(spec)  # found and opened once: for what the model is, its tokenizer and its weights
    if found is not None and serves_an_encoder(*found):  # no engine, no KV cache: embeddings (embedding_worker.py)
        encoder_main(spec, channel, log)
        return
    publisher = None
    try:
        # Bound before the model loads, so that subscribers are connected by the time events flow.
        publisher = _kv_event_publisher(spec)
        engine = _start_engine(spec, log, found)
        reader = None if found is None else found[1]
        embedder = decoder_embedder(engine.model, engine.max_model_len, engine.tokenizer.vocab_size, reader)
    except Exception as exc:  # noqa: BLE001 - any start-up failure must reach the router as a message
        if _is_usage_error(exc):
            # What was asked cannot be served: the message says why, a traceback would only hide it.
            log.error("worker_start_refused", error=str(exc))
        else:
            log.error("worker_start_failed", error=str(exc), traceback=traceback.format_exc())
        channel.send(Failed(f"{type(exc).__name__}: {exc}", usage=_is_usage_error(exc)))
        return
    ready = _ready(spec, engine, embedder)
    channel.send(ready)
    log.info("worker_ready", pid=os.getpid(), kv_blocks=ready.info.kv_blocks_total)
    if publisher is not None:
        from tokenmill_service.worker.engine.kv_events import AllBlocksCleared

        # Whatever a subscriber knew of this worker's cache before (a previous process's) is gone.
        publisher.publish([AllBlocksCleared(), *engine.kv_events.drain()])
    stop = threading.Event()
    beat = threading.Thread(target=channel.heartbeat, args=(spec.heartbeat_interval, stop), daemon=True)
    beat.start()
    try:
        _serve(engine, channel, log, spec.collective_timeout / 4, publisher, embedder)
    except (EOFError, BrokenPipeError):
        log.warning("router_gone")  # the router died: nothing left to serve
    except Exception:
        # An engine failure ends this process; the router fails its calls and starts a new worker.
        log.exception("engine_failed")
        raise SystemExit(1) from None
    finally:
        stop.set()
        if publisher is not None:
            publisher.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        log.info("worker_stopped")


def _ready(spec: WorkerSpec, engine: Any, embedder: Any) -> Ready:
    """What the router learns of a started worker: the model, its KV cache and the plan it runs."""
    from tokenmill_service.worker.dtypes import dtype_name

    stats = engine.stats()
    return Ready(
        WorkerInfo(
            worker_id=spec.worker_id,
            pid=os.getpid(),
            model_name=engine.model.config.name,
            context_length=engine.max_model_len,
            vocab_size=engine.tokenizer.vocab_size,
            device=str(engine.model.device),
            dtype=dtype_name(engine.model.act_dtype),
            kv_blocks_total=stats.kv_blocks_total,
            kv_block_size=stats.kv_block_size,
            quantization=engine.model.quantization,
            weight_bytes=engine.model.weight_bytes(),
            compiled_graphs=stats.compiled_graphs,
            backend=spec.options.backend,
            plan=engine.model.plan.summary(),
            adapters=stats.adapters,
            kv_per_sequence=engine.kv_per_sequence,
            embedding=embedding_info(embedder),
        ),
    )


def _is_usage_error(exc: BaseException) -> bool:
    """A checkpoint or flags that cannot be served as asked (the loaders' and the plan's refusals)."""
    from tokenmill_service.contract.model_paths import ModelLoadError
    from tokenmill_service.worker.engine.llm_engine import KVPoolTooLarge, KVPoolTooSmall
    from tokenmill_service.worker.models.gguf_loader import GGUFError
    from tokenmill_service.worker.models.hf_loader import HFCheckpointError

    return isinstance(exc, (ModelLoadError, GGUFError, HFCheckpointError, KVPoolTooSmall, KVPoolTooLarge))


def _init_distributed(spec: WorkerSpec, log: Any) -> Any:
    """Join the replica's group; returns this rank's ``TensorParallel`` and the device to run on."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tokenmill_service.worker.distributed.parallel import TensorParallel

    torch.set_num_threads(spec.threads)
    if spec.options.device == "cuda":
        if spec.device_index >= torch.cuda.device_count():
            raise RuntimeError(
                f"worker {spec.worker_id} needs GPU {spec.device_index} but {torch.cuda.device_count()} are visible: "
                "lower --workers or --tensor-parallel"
            )
        torch.cuda.set_device(spec.device_index)
    backend = "nccl" if spec.options.device == "cuda" else "gloo"
    # A bounded wait in every collective: a rank whose peer died or hung fails instead of waiting forever.
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.collective_timeout),
    )
    log.info("distributed_initialized", backend=backend, world_size=spec.world_size, master_port=spec.master_port)
    device = f"cuda:{spec.device_index}" if spec.options.device == "cuda" else "cpu"
    return TensorParallel(spec.rank, spec.world_size), device


def _model_file(spec: WorkerSpec) -> tuple[Any, Any] | None:
    """The model's path and its GGUF file opened (None for a directory), or None where it cannot be found
    or read: the start then fails with the reason."""
    from tokenmill_service.contract.gguf_reader import open_model_file
    from tokenmill_service.contract.model_paths import resolve_model_path

    try:
        path = resolve_model_path(spec.options.model or None)
        return path, open_model_file(path)
    except (OSError, ValueError):
        return None


def _start_engine(spec: WorkerSpec, log: Any, found: tuple[Any, Any] | None) -> Any:
    from tokenmill_service.contract.model_paths import resolve_model_path
    from tokenmill_service.contract.tokenizer import load_tokenizer
    from tokenmill_service.worker.distributed.step_broadcast import broadcast_from_rank0
    from tokenmill_service.worker.engine.warm_up import warmed_engine
    from tokenmill_service.worker.loader import load_planned, replan

    tp, device = _init_distributed(spec, log)
    # The tokenizer (a second or more for a 128k vocabulary, mostly Python) loads beside the weights,
    # whose packing runs in native code without the GIL.
    # Where the model could not be found or read, resolving it again raises why.
    path, reader = found if found is not None else (resolve_model_path(spec.options.model or None), None)
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        # In a copy of this context, so that its log line carries the worker's id and rank.
        tokenizer_loaded = pool.submit(contextvars.copy_context().run, load_tokenizer, path, reader)
        model, inputs = load_planned(spec.options, device, tp, path, reader)
        tokenizer = tokenizer_loaded.result()

    def make_engine(num_blocks: int | None) -> Any:
        engine = _engine(model, tokenizer, spec, tp, num_blocks)
        if tp.size > 1 and num_blocks is None:
            # The pool size depends on this rank's free memory: every rank takes rank 0's.
            broadcast_from_rank0(engine.block_manager.num_blocks, tp)
        return engine

    return warmed_engine(make_engine, lambda failed: replan(model, inputs, failed))


def _engine(model: Any, tokenizer: Any, spec: WorkerSpec, tp: Any, num_blocks: int | None = None) -> Any:
    """Rank 0's engine with the worker's adapters, run as the model's plan says; under tensor parallelism it
    broadcasts every step."""
    from tokenmill_service.worker.distributed.step_broadcast import lead
    from tokenmill_service.worker.engine.llm_engine import LLMEngine

    config = spec.engine if num_blocks is None else dataclasses.replace(spec.engine, num_kv_blocks=num_blocks)
    engine = LLMEngine(model, tokenizer, config)
    _load_adapters(engine, spec.lora_modules)
    if tp.size > 1:
        lead(engine, tp)
    return engine


def _load_adapters(engine: Any, modules: list[tuple[str, str]]) -> None:
    """Serve the adapters the worker starts with; one that does not fit stops it as a bad flag would."""
    from tokenmill_service.contract.model_paths import ModelLoadError
    from tokenmill_service.worker.layers.lora import AdapterError

    for name, path in modules:
        try:
            engine.load_adapter(name, path)
        except AdapterError as exc:
            raise ModelLoadError(f"--lora-modules {name}={path}: {exc}") from None


def _adapter_command(engine: Any, cmd: LoadAdapter | UnloadAdapter) -> AdapterResult:
    """Carry out a load or an unload; what went wrong as the result's error and its kind."""
    from tokenmill_service.worker.layers.lora import AdapterError

    load = isinstance(cmd, LoadAdapter)
    try:
        if isinstance(cmd, LoadAdapter):
            engine.load_adapter(cmd.name, cmd.path)
        else:
            engine.unload_adapter(cmd.name)
    except KeyError:
        return AdapterResult(cmd.name, load, f"the LoRA adapter {cmd.name!r} is not loaded", "not_found")
    except AdapterError as exc:
        return AdapterResult(cmd.name, load, str(exc), "invalid" if load else "in_use")
    return AdapterResult(cmd.name, load)


def _follower_main(spec: WorkerSpec, log: Any) -> None:
    """A rank above 0: load this rank's shard, then run what rank 0 broadcasts until it stops."""
    from tokenmill_service.worker.distributed.step_broadcast import broadcast_from_rank0, follow
    from tokenmill_service.worker.engine.llm_engine import kv_cache_groups
    from tokenmill_service.worker.engine.model_runner import ModelRunner
    from tokenmill_service.worker.loader import load

    try:
        tp, device = _init_distributed(spec, log)
        model = load(spec.options, device, tp)
        num_blocks = broadcast_from_rank0(None, tp)
        assert isinstance(num_blocks, int)
        # The same block tables as rank 0's: its KV-cache groups follow from the model, as rank 0's do.
        runner = ModelRunner(model, spec.engine.block_size, num_blocks, kv_groups=kv_cache_groups(model, spec.engine))
        log.info("follower_ready", pid=os.getpid())
        follow(runner, tp, mtp=spec.engine.speculative_method == "mtp")
    except Exception as exc:  # noqa: BLE001 - the router sees the exit; the log says why
        # Rank 0 failing (or being killed) surfaces here as a collective error or timeout.
        log.error("follower_failed", error=str(exc), traceback=traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _kv_event_publisher(spec: WorkerSpec) -> Any:
    """This worker's KV-cache event publisher (--kv-events-endpoint), or None."""
    if not spec.kv_events_endpoint:
        return None
    from tokenmill_service.worker.engine.kv_events import KVEventPublisher

    medium = "GPU" if spec.options.device == "cuda" else "CPU"
    return KVEventPublisher(spec.kv_events_endpoint, spec.worker_id, spec.kv_events_topic, medium)


def _serve(
    engine: Any, channel: Channel, log: Any, idle_tick: float, publisher: Any = None, embedder: Any = None
) -> None:
    from tokenmill_service.worker.distributed.step_broadcast import Idle, Stop
    from tokenmill_service.worker.kernels import stack_profile

    conn = channel.conn
    max_step_tokens = engine.config.max_batch_tokens
    broadcast = engine.runner.broadcast
    last_sent: float | None = None  # when the last step's outputs were sent
    while True:
        # Block while idle (the other ranks hear an idle tick now and then); while busy, only pick
        # up what has already arrived.
        timeout = 0.0 if engine.has_unfinished() else (idle_tick if broadcast is not None else None)
        if broadcast is not None and timeout and not channel.readable(timeout):
            broadcast.send(Idle())
            continue
        dirty = False
        while channel.readable(timeout):
            timeout = 0.0
            for cmd in conn.recv():
                match cmd:
                    case AddRequest(request=request):
                        try:
                            engine.add_request(request)
                        except RequestError as exc:
                            channel.send(Rejected(request.request_id, str(exc)))
                    case Cancel(request_id=request_id):
                        dirty |= engine.cancel(request_id)
                    case LoadAdapter() | UnloadAdapter():
                        channel.send(_adapter_command(engine, cmd))
                        dirty = True
                    case Embed():  # between steps: each input alone through the same weights
                        channel.send(embed_command(embedder, cmd, channel))
                    case Shutdown():
                        for rid in list(engine.sequences):
                            engine.cancel(rid)
                        if broadcast is not None:
                            broadcast.send(Stop())
                        return
        if engine.has_unfinished():
            # The step's size bounds how long it may take (the router's --step-timeout scales with it).
            pending = sum(seq.num_uncomputed_tokens for seq in engine.sequences.values())
            channel.step_tokens = max(1, min(max_step_tokens, pending))
            channel.step_started = started = time.monotonic()
            outputs = engine.step()
            channel.step_started = None
            stepped = time.monotonic()
            channel.send(StepOutputs(outputs, engine.stats()))
            if publisher is not None:
                publisher.publish(engine.kv_events.drain())
            sent = time.monotonic()
            # Where a step's time goes (--log-level debug): the forward pass, the rest of the engine's
            # step (scheduling, sampling, detokenizing), sending its outputs, and the loop between steps.
            log.debug(
                "step_timing",
                tokens=channel.step_tokens,
                forward_ms=round(engine.runner.last_execute_s * 1000, 3),
                engine_ms=round((stepped - started - engine.runner.last_execute_s) * 1000, 3),
                send_ms=round((sent - stepped) * 1000, 3),
                between_steps_ms=None if last_sent is None else round((started - last_sent) * 1000, 3),
                **stack_profile.read_and_reset(),
            )
            last_sent = sent
        else:
            last_sent = None  # idle: the next step's wait is not the loop's
            if dirty:
                channel.send(Stats(engine.stats()))
