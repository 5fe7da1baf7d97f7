"""``info``, ``tokenize`` and ``health``: the commands that ask the server about itself."""

from __future__ import annotations

import argparse

from .._chat import ChatMessage
from .._types import ModelInfo
from .connect import client_from_args
from .report import EXIT_FAILED, json_line, out


def _format_model_info(info: ModelInfo) -> str:
    lim, eng = info.limits, info.engine
    lines = [
        f"name            {info.name}",
        f"context_length  {info.context_length}",
        f"vocab_size      {info.vocab_size}",
        f"backend         {info.backend}",
        f"device          {info.device}",
        f"dtype           {info.dtype}",
        f"quantization    {info.quantization}",
        f"num_workers     {info.num_workers}",
        (
            f"limits          max_new_tokens={lim.max_new_tokens} max_top_logprobs={lim.max_top_logprobs} "
            f"max_stop_strings={lim.max_stop_strings} max_queue={lim.max_queue} max_batch_size={lim.max_batch_size}"
        ),
        (
            f"engine          running={eng.running} waiting={eng.waiting} "
            f"kv_blocks={eng.kv_blocks_used}/{eng.kv_blocks_total} kv_block_size={eng.kv_block_size}"
        ),
    ]
    lines += [f"plan            {name}: {value}" for name, value in sorted(info.load_plan.items())]
    for w in info.workers:
        lines.append(
            f"worker {w.worker_id:<8} {'alive' if w.alive else 'DEAD'} running={w.running} waiting={w.waiting} "
            f"kv_blocks={w.kv_blocks_used}/{w.kv_blocks_total} restarts={w.restarts}"
        )
    return "\n".join(lines) + "\n"


def cmd_info(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        info = client.model_info()
    out(json_line(info) if args.json else _format_model_info(info))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        tokens = client.tokenize([ChatMessage("user", args.text)] if args.chat else args.text)
    if args.json:
        out(json_line({"ids": list(tokens.ids), "pieces": list(tokens.pieces)}))
    else:
        out(f"ids: {list(tokens.ids)}\npieces: {list(tokens.pieces)!r}\ncount: {len(tokens.ids)}\n")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        status = client.health(args.service)
    out(f"{status.value}\n")
    return 0 if status.value == "SERVING" else EXIT_FAILED
