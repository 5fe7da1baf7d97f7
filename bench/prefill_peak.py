"""A prompt's rate set against the cores' arithmetic ceiling, on a served GGUF model:

    python bench/prefill_peak.py --model FILE.gguf --lengths 512,2048
    python bench/prefill_peak.py --model FILE.gguf --server-arg=--activations=int8 --json out.json
    python bench/prefill_peak.py --model FILE.gguf --server-arg=--cpu-isa=avx2 --server-arg=--activations=int8

It builds ``bench/kernels/cpu_peak.cpp`` and runs one copy per core at once (the machine's multiply-adds a
second of each product instruction), starts a server with the given flags, and times one prompt of random
token ids a length (``max_new_tokens`` 1; a fresh prompt each try, so no cached prefix; the best of
``--tries``, after a warm-up). A prompt's multiply-adds are its decoder layers' weights times its tokens,
the causal attention's (two products of head_dim a head over half the square of the length, a layer), and
the output layer's one row. Their rate is set against the peak of the instruction the products take:

- ``--activations int8``: byte products (AVX-512 ``vpdpbusd``; AVX2 ``vpmaddubsw`` + ``vpaddw``);
- the default: activations as 16-bit words (AVX-512 ``vpdpwssd``; AVX2 ``vpmaddwd``).

Attention runs in float32, so counting its multiply-adds at the integer peak flatters nothing: the share
is of what the weights' products could do at most.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill_bench.server import ManagedServer
from tokenmill_client import AsyncClient

CPU_PEAK = Path(__file__).parent / "kernels" / "cpu_peak.cpp"
LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "ffn_gate", "ffn_up", "ffn_down")


def machine_peaks(cores: int) -> dict[str, float]:
    """G multiply-adds a second of each instruction cpu_peak measures, one copy a core at once, summed."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "cpu_peak"
        subprocess.run(["g++", "-O2", "-march=native", str(CPU_PEAK), "-o", str(binary)], check=True)
        runs = [subprocess.Popen([str(binary)], stdout=subprocess.PIPE, text=True) for _ in range(cores)]
        outputs = [run.communicate()[0] for run in runs]
    peaks: dict[str, float] = {}
    for out in outputs:
        for m in re.finditer(r"^(.+?)\s+([\d.]+) G multiply-adds/s", out, re.MULTILINE):
            peaks[m.group(1).strip()] = peaks.get(m.group(1).strip(), 0.0) + float(m.group(2))
    return peaks


def model_shape(model: Path) -> dict[str, int]:
    """Per token: the decoder layers' weights and the output layer's (each a multiply-add); and the
    attention's shape (layers x heads x head_dim) for its per-length count."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def field(name: str) -> int:
        return int(reader.fields[f"{arch}.{name}"].parts[-1][0])

    tensors = {t.name: int(t.n_elements) for t in reader.tensors}
    layers = sum(n for name, n in tensors.items() if name.startswith("blk.") and name.split(".")[2] in LINEAR)
    head = tensors.get("output.weight", tensors.get("token_embd.weight", 0))
    heads, hidden = field("attention.head_count"), field("embedding_length")
    head_dim = field("attention.key_length") if f"{arch}.attention.key_length" in reader.fields else hidden // heads
    return {"layers_macs": layers, "output_macs": head, "attention_width": field("block_count") * heads * head_dim}


def prompt_macs(shape: dict[str, int], length: int) -> float:
    # Causal attention: position p scores p + 1 keys and sums p + 1 values, each head_dim wide, every head.
    attention = shape["attention_width"] * length * (length + 1)
    return shape["layers_macs"] * length + attention + shape["output_macs"]


async def time_prompts(address: str, lengths: list[int], tries: int, vocab: int) -> dict[int, float]:
    rng = random.Random(0)
    best: dict[int, float] = {}
    async with AsyncClient(address) as client:
        await client.generate_text(token_ids=[rng.randrange(1, vocab) for _ in range(64)], max_new_tokens=1)
        for length in lengths:
            for _ in range(tries):
                prompt = [rng.randrange(1, vocab) for _ in range(length)]
                start = time.perf_counter()
                await client.generate_text(token_ids=prompt, max_new_tokens=1)
                best[length] = min(best.get(length, float("inf")), time.perf_counter() - start)
    return best


def peak_name(server_args: list[str], peaks: dict[str, float]) -> str:
    int8 = any(a.replace(" ", "=") == "--activations=int8" for a in server_args)
    if any(a.replace(" ", "=") == "--cpu-isa=avx2vnni" for a in server_args):
        return "int8 vpdpbusd-ymm" if int8 else "int16 vpdpwssd-ymm"
    avx2 = any(a.replace(" ", "=") == "--cpu-isa=avx2" for a in server_args) or "int8 vpdpbusd" not in peaks
    if int8:
        return "int8 vpmaddubsw-ymm" if avx2 else "int8 vpdpbusd"
    return "int16 vpmaddwd-ymm" if avx2 else "int16 vpdpwssd"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--server-arg", action="append", default=[], help="an extra server flag, repeatable")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--tries", type=int, default=2)
    parser.add_argument("--cores", type=int, default=2, help="copies of the peak probe at once")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    peaks = machine_peaks(args.cores)
    shape = model_shape(args.model)
    flags = ["--model", str(args.model), "--speculative-tokens", "0", "--max-model-len", str(max(lengths) + 64)]
    server = ManagedServer([*flags, *args.server_arg]).start(timeout=1800)
    try:
        from tokenmill_client import Client

        with Client(server.address) as client:
            vocab = min(client.model_info().vocab_size, 32000)
        times = asyncio.run(time_prompts(server.address, lengths, args.tries, vocab))
    finally:
        server.stop()
    name = peak_name(args.server_arg, peaks)
    print(f"the machine's peak ({args.cores} cores at once):")
    for instruction, rate in peaks.items():
        print(
            f"  {instruction:<22} {rate:7.1f} G multiply-adds/s{'   <- the products take this' if instruction == name else ''}"
        )
    rows: list[dict[str, Any]] = []
    print(f"{'prompt':>7} {'time (s)':>9} {'tokens/s':>9} {'G MAC':>8} {'G MAC/s':>8} {'of the peak':>12}")
    for length in lengths:
        macs = prompt_macs(shape, length) / 1e9
        rate = macs / times[length]
        share = rate / peaks[name]
        rows.append({"length": length, "seconds": times[length], "g_macs": macs, "g_macs_per_s": rate, "share": share})
        print(
            f"{length:>7} {times[length]:>9.2f} {length / times[length]:>9.1f} {macs:>8.1f} {rate:>8.1f} {100 * share:>11.0f}%"
        )
    if args.json:
        result = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "model": str(args.model),
            "server_args": args.server_arg,
            "peaks": peaks,
            "peak_instruction": name,
            "prompts": rows,
        }
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
