"""What each worker process is started with (``WorkerSpec``), made from the server's settings."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Collection

from tokenmill_service.contract.config import Settings
from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.messages import WorkerSpec
from tokenmill_service.contract.plan.options import LoadOptions


def any_free_port() -> int:
    """A port the OS calls free at this moment (nothing holds it once this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port(avoid: Collection[int] = (), pick: Callable[[], int] = any_free_port) -> int:
    """A free port for a worker's torch.distributed store, not one of ``avoid``: the ports this server is still to
    bind (gRPC, HTTP, metrics) are free too until it binds them, and the OS may hand one of them out."""
    for _ in range(64):
        if (port := pick()) not in avoid:
            return port
    raise RuntimeError(f"no free port outside {sorted(avoid)}")


def worker_spec(
    settings: Settings,
    num_workers: int,
    worker_id: int,
    rank: int,
    master_port: int,
    adapters: dict[str, str] | None = None,
) -> WorkerSpec:
    """What one rank of one replica is started with: the user's load options whole, the engine's
    limits, its threads (the cores shared among this node's processes), its supervision intervals and the
    LoRA adapters served now (``adapters``, name -> path; None: those of --lora-modules)."""
    s = settings
    cores = os.cpu_count() or 1
    local = s.node_ranks()
    processes = num_workers * len(local)
    threads = s.threads or (max(1, cores // processes) if s.device == "cpu" else 1)
    # The engine's knobs from the flags of their names; these three differ from their flags in unit or meaning.
    engine = s.subset(
        EngineConfig,
        max_batch_tokens=max(s.max_batch_tokens, s.max_batch_size),
        kv_cache_memory=s.kv_cache_bytes,
        kv_events=bool(s.kv_events_endpoint),
    )
    return WorkerSpec(
        worker_id=worker_id,
        rank=rank,
        # This node's devices, one per local rank.
        device_index=worker_id * len(local) + local.index(rank),
        world_size=s.tensor_parallel,
        master_addr=s.master_addr,
        master_port=master_port,
        options=LoadOptions.from_settings(s),
        engine=engine,
        threads=threads,
        log_format=s.resolved_log_format(),
        log_level=s.log_level,
        heartbeat_interval=min(0.5, s.heartbeat_timeout / 4),
        collective_timeout=s.step_timeout,
        kv_events_endpoint=s.kv_events_endpoint,
        kv_events_topic=s.kv_events_topic,
        lora_modules=list((s.lora_module_paths() if adapters is None else adapters).items()),
    )
