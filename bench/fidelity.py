"""How far each server's greedy tokens' logprobs are from the float32 reference, side by side:

    python bench/fidelity.py --model FILE.gguf --config default= --config int8=--activations=int8 \\
        --llama-server http://127.0.0.1:8089 --json bench/results/fidelity.json

Each side generates ``--new-tokens`` greedy tokens after each prompt and reports each token's logprob;
transformers then scores the same tokens in float32 on the file's dequantized weights (its GGUF
loading), and a side's error is |its logprob - the reference's| over all its tokens, mean and worst.
Each side is scored on its own greedy tokens, so a side is never judged on a path it did not take.

The prompts are the token ids of the embedded model's reference texts (``tests/data/smollm2_reference.json``),
so both servers see the same ids; a tokenmill side is a server started with the flags after ``NAME=``
(comma-separated), llama-server is a running one (``-t 2`` in the runs recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from tokenmill_bench.server import ManagedServer
from tokenmill_client import AsyncClient

REFERENCE = Path(__file__).parents[1] / "tests" / "data" / "smollm2_reference.json"
# (token id, the side's logprob) per generated token; llama-server gives no logprob for a token that ends
# inside a UTF-8 character (its event is merged into the next one), so those are scored only as context.
Generated = list[tuple[int, float | None]]


async def tokenmill_tokens(address: str, prompt: list[int], count: int) -> Generated:
    async with AsyncClient(address) as client:
        result = await client.generate_text(token_ids=prompt, max_new_tokens=count, ignore_eos=True, logprobs=True)
    return [(t.id, t.logprob) for t in result.tokens]


async def llama_server_tokens(url: str, prompt: list[int], count: int) -> Generated:
    body = {
        "prompt": prompt,
        "n_predict": count,
        "ignore_eos": True,
        "cache_prompt": False,
        "temperature": 0.0,
        "top_k": 1,
        "n_probs": 1,
        "post_sampling_probs": False,  # the model's own distribution, not the sampler's
        "return_tokens": True,
    }
    async with aiohttp.ClientSession() as session, session.post(f"{url}/completion", json=body) as response:
        answer = await response.json()
    if response.status != 200:
        raise RuntimeError(f"llama-server: {answer}")
    scored = iter(answer["completion_probabilities"])
    out: Generated = []
    entry = next(scored, None)
    for token in answer["tokens"]:
        if entry is not None and int(entry["id"]) == token:
            out.append((token, float(entry["logprob"])))
            entry = next(scored, None)
        else:
            out.append((token, None))
    if entry is not None:
        raise RuntimeError("llama-server's probabilities do not follow its tokens")
    return out


def reference_logprobs(model_path: Path, prompt: list[int], generated: list[int]) -> list[float]:
    import torch

    model = _reference_model(model_path)
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0].double(), -1)
    start = len(prompt) - 1  # position p scores token p + 1
    return [logprobs[start + i, token].item() for i, token in enumerate(generated)]


_MODELS: dict[Path, Any] = {}


def _reference_model(model_path: Path) -> Any:
    if model_path not in _MODELS:
        import torch
        from transformers import AutoModelForCausalLM

        _MODELS[model_path] = AutoModelForCausalLM.from_pretrained(
            model_path.parent, gguf_file=model_path.name, dtype=torch.float32
        ).eval()
    return _MODELS[model_path]


def errors_of(model_path: Path, prompts: list[list[int]], sides: list[Generated]) -> list[float]:
    errors = []
    for prompt, generated in zip(prompts, sides, strict=True):
        reference = reference_logprobs(model_path, prompt, [t for t, _ in generated])
        errors += [abs(lp - ref) for (_, lp), ref in zip(generated, reference, strict=True) if lp is not None]
    return errors


async def generate_all(side: str, where: str, prompts: list[list[int]], count: int) -> list[Generated]:
    fetch = llama_server_tokens if side == "llama-server" else tokenmill_tokens
    return [await fetch(where, prompt, count) for prompt in prompts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the GGUF file every side serves")
    parser.add_argument("--config", action="append", default=[], help="NAME=FLAGS (comma-separated): a tokenmill side")
    parser.add_argument("--llama-server", help="URL of a running llama-server on the same file")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prompts = [case["ids"] for case in json.loads(REFERENCE.read_text())["prompt_logprobs"]]
    generated: dict[str, list[Generated]] = {}
    for config in args.config:
        name, _, flags = config.partition("=")
        server = ManagedServer(["--model", str(args.model), *[f for f in flags.split(",") if f]]).start()
        try:
            generated[f"tokenmill {name}"] = asyncio.run(generate_all(name, server.address, prompts, args.new_tokens))
        finally:
            server.stop()
    if args.llama_server:
        generated["llama-server"] = asyncio.run(
            generate_all("llama-server", args.llama_server, prompts, args.new_tokens)
        )
    rows = {}
    for side, tokens in generated.items():
        errors = errors_of(args.model, prompts, tokens)
        rows[side] = {"tokens": len(errors), "mean": sum(errors) / len(errors), "worst": max(errors)}
    print(f"{'side':<24} {'tokens':>6} {'mean':>9} {'worst':>9}")
    for side, row in rows.items():
        print(f"{side:<24} {row['tokens']:>6} {row['mean']:>9.5f} {row['worst']:>9.5f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M"),
                    "model": str(args.model),
                    "new_tokens": args.new_tokens,
                    "prompts": len(prompts),
                    "sides": rows,
                    "generated": generated,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
