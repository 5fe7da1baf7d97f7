"""Where one decoding stream's time goes, per token, on a served model:

    python bench/step_breakdown.py --model FILE.gguf                      # the default configuration
    python bench/step_breakdown.py --model FILE.gguf --server-arg=--activations=int8 --json out.json
    python bench/step_breakdown.py --model FILE.gguf --server-arg=--activations=int8 --streams 16

It starts a server with ``TM_STACK_PROFILE=1`` (the native decoder stack sums the time of its products,
attention and experts) and ``--log-level debug`` (each engine step logs ``step_timing``: the forward pass, the
rest of the engine's step, sending its outputs, the loop between steps), sends one greedy request of
``--tokens`` tokens after a warm-up, and takes the means over its decoding steps. Speculation is off, so a
step is a token. Beside them: the time between tokens the client saw, the weight bytes a step reads (the
server's ``GetModelInfo``), the output layer's bytes (from the GGUF), and the machine's read rate measured
right after, so the products' read rate can be set against it; and beside that rate, a plain read (no
arithmetic) of buffers of the decoder layers' products' sizes, one call after another in the step's order, which is
what reading the layers product by product can reach on the machine.

The rows:
- products: the decoder layers' matrix products (with LoRA and biases, none here), inside the stack;
- attention, experts: their kernels inside the stack;
- the rest of the stack: norms, rotary, cache writes, residual adds, the activation;
- the forward pass outside the stack: the embedding lookup, the output layer's product, the executor's Python;
- the engine's step: scheduling, sampling, detokenizing, stop checks;
- sending the step's outputs to the server process, and the worker's loop between steps;
- the time between tokens the client saw, whose excess over the worker's step is the server process and gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill_bench.machine import read_bandwidth
from tokenmill_bench.server import ManagedServer
from tokenmill_client import AsyncClient
from tokenmill_service.worker.kernels.cpu import memory_probe

PROMPT = [1 + (i * 7919) % 4000 for i in range(32)]  # ordinary vocabulary ids, as tokenmill-bench's
STEP_FIELDS = (
    *("stack_products_ms", "stack_attention_ms", "stack_experts_ms", "stack_ms"),
    *("forward_ms", "engine_ms", "send_ms", "between_steps_ms"),
)


def tensor_bytes(model: Path) -> dict[str, int] | None:
    """Each tensor's bytes in the GGUF, by name; None for a non-GGUF model."""
    if model.suffix != ".gguf":
        return None
    from gguf import GGUFReader

    return {t.name: int(t.n_bytes) for t in GGUFReader(model).tensors}


def output_layer_bytes(tensors: dict[str, int] | None) -> int | None:
    """Bytes of the output layer's weights (tied: the token embedding's), or None for a non-GGUF model."""
    if tensors is None:
        return None
    return tensors.get("output.weight", tensors.get("token_embd.weight"))


# A decoder layer's products, in the order a step runs them, as the GGUF's tensors they read.
PRODUCTS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def products_in_turn(tensors: dict[str, int] | None) -> list[int] | None:
    """The bytes each decoder layer's product of a step reads, in the order the step runs them, from the GGUF's
    tensors; None for a non-GGUF model, or one with experts (a step reads only some of them)."""
    if tensors is None or any("_exps." in name for name in tensors):
        return None
    sizes, layer = [], 0
    while f"blk.{layer}.attn_output.weight" in tensors:
        for product in PRODUCTS:
            sizes.append(sum(tensors.get(f"blk.{layer}.{name}.weight", 0) for name in product))
        layer += 1
    return [size for size in sizes if size] or None


async def streams(address: str, tokens: int, count: int) -> list[float]:
    """The gaps between the tokens of the first of ``count`` greedy requests sent at once, in ms."""
    async with AsyncClient(address) as client:
        await client.generate_text(token_ids=PROMPT, max_new_tokens=4, ignore_eos=True)  # warm-up

        async def one(index: int) -> list[float]:
            arrivals = []
            prompt = [(t + index) % 4000 + 1 for t in PROMPT]  # no prefix shared between the streams
            async for event in client.generate(token_ids=prompt, max_new_tokens=tokens, ignore_eos=True):
                arrivals.extend([time.perf_counter()] * len(event.tokens))
            return [1000 * (b - a) for a, b in itertools.pairwise(arrivals[1:])]  # past the first decode step

        gaps = await asyncio.gather(*(one(i) for i in range(count)))
    return gaps[0]


def decode_steps(log_path: str, rows: int) -> list[dict[str, Any]]:
    """The worker's step_timing lines of its decoding steps of ``rows`` sequences (a token each)."""
    steps = []
    for line in Path(log_path).read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "step_timing" and event.get("tokens") == rows and event.get("stack_calls") == 1:
            steps.append(event)
    return steps


def breakdown(steps: list[dict[str, Any]], gaps: list[float]) -> dict[str, float]:
    # Means, not medians: the parts of a step then add up to the step.
    med = {f: statistics.fmean(s[f] for s in steps if s.get(f) is not None) for f in STEP_FIELDS}
    rows = {
        "products": med["stack_products_ms"],
        "attention": med["stack_attention_ms"],
        "experts": med["stack_experts_ms"],
        "the rest of the stack (norms, rotary, cache writes)": med["stack_ms"]
        - med["stack_products_ms"]
        - med["stack_attention_ms"]
        - med["stack_experts_ms"],
        "forward pass outside the stack (embedding, output layer, executor)": med["forward_ms"] - med["stack_ms"],
        "engine step (scheduling, sampling, detokenizing)": med["engine_ms"],
        "sending the outputs": med["send_ms"],
        "the worker's loop between steps": med["between_steps_ms"],
    }
    rows["worker step, all of it"] = sum(rows.values())
    rows["time between tokens at the client (mean)"] = statistics.fmean(gaps)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--server-arg", action="append", default=[], help="an extra server flag, repeatable")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=1, help="requests at once; a step then decodes one token each")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ["TM_STACK_PROFILE"] = "1"
    flags = ["--model", str(args.model), "--log-level", "debug", "--speculative-tokens", "0", *args.server_arg]
    server = ManagedServer(flags).start(timeout=1800)  # a first start builds the kernels
    try:
        gaps = asyncio.run(streams(server.address, args.tokens, args.streams))
        from tokenmill_client import Client

        with Client(server.address) as client:
            weight_bytes = client.model_info().weight_bytes
        steps = decode_steps(server.log_path, args.streams)
    finally:
        server.stop()
    read = read_bandwidth()["gbs"]
    tensors = tensor_bytes(args.model)
    in_turn = products_in_turn(tensors)
    # The same bytes read with no arithmetic, product after product: what reading a step's layers one call at a
    # time can reach here (below the read rate of one buffer by each call's start and end).
    read_in_turn = memory_probe.read_in_turn_gbs(in_turn, 5, torch.get_num_threads()) if in_turn else None
    if len(steps) < args.tokens // 2:
        print(f"only {len(steps)} decoding steps logged with the stack's profile: is the native stack running?")
        return 1
    rows = breakdown(steps, gaps)
    step = rows["worker step, all of it"]
    head = output_layer_bytes(tensors)
    rows_word = "token" if args.streams == 1 else f"step of {args.streams} rows"
    print(f"{'per ' + rows_word + ', the mean of ' + str(len(steps)) + ' steps':<72} {'ms':>8} {'share':>7}")
    for name, ms in rows.items():
        print(f"{name:<72} {ms:>8.3f} {100 * ms / step:>6.1f}%")
    layers_bytes = weight_bytes - (head or 0)
    products_gbs = layers_bytes / rows["products"] / 1e6
    print(f"weights a step reads: {weight_bytes / 1e6:.1f} MB, the output layer's {(head or 0) / 1e6:.1f} MB")
    print(
        f"the decoder layers' products read {products_gbs:.1f} GB/s; the machine's read rate right after: {read:.1f} GB/s"
    )
    print(
        f"the whole step reads its weights at {weight_bytes / step / 1e6:.1f} GB/s ({100 * weight_bytes / step / 1e6 / read:.0f} % of it)"
    )
    if read_in_turn:
        print(
            f"a plain read of the decoder layers' products' bytes, one after another in the step's order: {read_in_turn:.1f} GB/s "
            f"({100 * read_in_turn / read:.0f} % of the read rate); the decoder layers' products read "
            f"{100 * products_gbs / read_in_turn:.0f} % of it"
        )
    if args.json:
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "model": str(args.model),
            "server_args": args.server_arg,
            "streams": args.streams,
            "steps": len(steps),
            "per_token_ms": rows,
            "weight_bytes": weight_bytes,
            "output_layer_bytes": head,
            "products_gbs": products_gbs,
            "read_gbs_after": read,
            "read_in_turn_gbs": read_in_turn,
        }
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
