"""How far each server's greedy tokens' logprobs are from the float32 reference, side by side:

    python bench/fidelity.py --model FILE.gguf --config default= --config int8=--activations=int8 \\
        --llama-server http://127.0.0.1:8089 --json bench/results/fidelity.json

Each side generates ``--new-tokens`` greedy tokens after each prompt and reports each token's logprob;
transformers then scores the same tokens in float32 on the file's dequantized weights (its GGUF loading's
numbers, with one layer in memory at a time: ``streamed_reference.py``), and a side's error is |its logprob -
the reference's| over all its tokens, mean and worst.
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

import aiohttp
from streamed_reference import next_token_logprobs

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


def errors_of(model_path: Path, prompts: list[list[int]], sides: dict[str, list[Generated]]) -> dict[str, list[float]]:
    """Each side's |logprob - the float32 reference's| over its scored tokens; every side's sequences go
    through the reference in one pass, which reads each layer of the file once."""
    sequences = [
        prompt + [t for t, _ in generated]
        for tokens in sides.values()
        for prompt, generated in zip(prompts, tokens, strict=True)
    ]
    reference = iter(next_token_logprobs(model_path, sequences))
    errors: dict[str, list[float]] = {}
    for side, tokens in sides.items():
        errors[side] = []
        for prompt, generated in zip(prompts, tokens, strict=True):
            scored = next(reference)[len(prompt) - 1 :]  # position p scores token p + 1
            errors[side] += [abs(lp - ref) for (_, lp), ref in zip(generated, scored, strict=True) if lp is not None]
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
    for side, errors in errors_of(args.model, prompts, generated).items():
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
