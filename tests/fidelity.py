"""Fidelity against the reference: each prompt token's logprob, as a model computes it in process."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill_service.worker.engine.executor import make_executor
from tokenmill_service.worker.engine.model_runner import forward_prompt


@torch.inference_mode()
def prompt_logprob_errors(model: Any, reference: dict[str, Any]) -> list[float]:
    """|model's logprob - reference logprob| of every scored token of the reference's prompts."""
    errors = []
    run = make_executor(model)  # as the model's plan runs it
    for case in reference["prompt_logprobs"]:
        logprobs = torch.log_softmax(run.compute_logits(forward_prompt(model, case["ids"])).double(), -1)
        errors += [abs(row[ref["token"]].item() - ref["logprob"]) for row, ref in zip(logprobs, case["positions"])]
    return errors
