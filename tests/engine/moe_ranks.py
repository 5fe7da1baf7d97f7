"""One rank of a mixture-of-experts replica, for tests/engine/test_moe_families.py's groups of ranks.

Its own module, importing only what a rank needs (not transformers): each rank process imports it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.engine.model_runner import forward_prompt
from tokenmill_service.worker.loader import load_model


def rank_logits(rank: int, size: int, port: int, runs: list[tuple[str, bool]], prompt: list[int], out: str) -> None:
    """Join the group; for each (checkpoint, expert parallel) of ``runs``, load this rank's share and save
    its logits of ``prompt`` and the experts of its first layer (id -> gate/up shape) to ``out.<run>.<rank>``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        for run, (path, expert_parallel) in enumerate(runs):
            model = load_model(Path(path), tp=TensorParallel(rank, size, expert_parallel))
            experts = model.model.layers[0].mlp.experts
            held = {e: tuple(x.gate_up_proj.quant.dequantized(x.gate_up_proj).shape) for e, x in experts.items()}
            with torch.inference_mode():
                logits = model.compute_logits(forward_prompt(model, prompt))
            torch.save({"logits": logits, "held": held}, f"{out}.{run}.{rank}")
    finally:
        dist.destroy_process_group()
