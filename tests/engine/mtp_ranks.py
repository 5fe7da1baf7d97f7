"""A replica of two gloo ranks serving with and without MTP drafts, for tests/engine/test_deepseek_mtp.py's
ranks: rank 0 runs the engine and sends each step and each draft pass (``lead``), rank 1 follows
(``follow``), as the worker's ranks do.

Its own module, importing only what a rank needs (not transformers): each rank process imports it.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.request import GenerationRequest, RequestOutput
from tokenmill_service.contract.tokenizer.load import load_tokenizer
from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.distributed.step_broadcast import Stop, follow, lead
from tokenmill_service.worker.engine.llm_engine import LLMEngine, kv_cache_groups
from tokenmill_service.worker.engine.model_runner import ModelRunner
from tokenmill_service.worker.loader import load_model

Drafted = tuple[dict[str, list[RequestOutput]], list[dict[str, list[int]]]]


def run_drafting(engine: LLMEngine, requests: list[GenerationRequest]) -> Drafted:
    """Every request's outputs, and after each step the drafts of every sequence still running."""
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {}
    drafts: list[dict[str, list[int]]] = []
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        drafts.append({rid: list(seq.mtp_drafts) for rid, seq in engine.sequences.items()})
    return outs, drafts


def replica_rank(
    rank: int,
    size: int,
    port: int,
    path: str,
    runs: dict[str, tuple[EngineConfig, bool]],
    batches: list[list[GenerationRequest]],
    out: str,
) -> None:
    """Join the group; for each (engine config, expert parallel) of ``runs``, load this rank's shard (with
    the MTP layer where the config's speculative method is "mtp") and run ``batches`` one after the other
    (rank 0: the engine, saving to ``out`` each run's results and its draft counts; the others: following
    it)."""
    torch.set_num_threads(1)
    # A bounded wait, as the worker's: a rank that missed a message fails instead of hanging the test.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=timedelta(seconds=120)
    )
    results: dict[str, Any] = {}
    try:
        for name, (config, expert_parallel) in runs.items():
            method = config.speculative_method
            tp = TensorParallel(rank, size, expert_parallel)
            model = load_model(Path(path), speculative_method=method, tp=tp)
            if rank:
                runner = ModelRunner(
                    model, config.block_size, config.num_kv_blocks, kv_groups=kv_cache_groups(model, config)
                )
                follow(runner, tp, mtp=method == "mtp")
                continue
            engine = LLMEngine(model, load_tokenizer(Path(path)), config)
            broadcast = lead(engine, tp)
            drafted = [run_drafting(engine, batch) for batch in batches]
            broadcast.send(Stop())
            stats = engine.stats()
            results[name] = (drafted, (stats.draft_tokens_proposed, stats.draft_tokens_accepted))
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
