"""What batch invariance costs the default: its kernels against the fastest ones that drop the promise.

    python bench/kernels/invariance_cost.py --repeats 7

The default's products (``gguf-vnni``: every row on its own, one reduction order) and attention
(``worker/kernels/cpu/paged_attention.cpp``: every query on its own, keys in order) are timed, alternately in
one process, against torch's kernels that choose their blocking and reduction order by shape, and
so give a row different bits in a different batch:

- products: MKL's float32 ``F.linear`` on the weight dequantized to float32 (four times the bytes
  the default reads; the same precision class as the reference), and oneDNN's bfloat16
  ``F.linear`` (faster still on AMX, but bfloat16 activations miss the fidelity bounds);
- attention: ``F.scaled_dot_product_attention`` (ATen's flash attention for the CPU) on keys and
  values already gathered into contiguous tensors (the gather, which paged caches need, is not
  counted: the alternative is flattered).

Printed: the median time of each, and invariant ÷ fastest non-invariant at the default's
precision (float32 products, float32 attention); above 1 is what invariance costs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill_service.worker.kernels.cpu import paged_attention
from tokenmill_service.worker.loader import load_model, resolve_model_path

BLOCK = 16


def median_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each function's median wall time, the functions taking turns (same machine load for all)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm: libraries loaded, caches touched
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def products(model: torch.nn.Module, repeats: int) -> None:
    layer = model.model.layers[0]
    linears = {
        "qkv": layer.self_attn.qkv_proj,
        "o": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
        "head": model.lm_head,
    }
    print("products (one layer's, and the head): ms, median of", repeats)
    print(f"{'layer':>8} {'rows':>5} {'invariant':>10} {'f32 MKL':>8} {'bf16':>7} {'cost (vs f32)':>14}")
    for name, lin in linears.items():
        w32 = lin.quant.dequantized(lin)
        w16 = w32.bfloat16()
        for rows in (1, 16, 64, 512):
            x = torch.randn(rows, w32.shape[1])
            x16 = x.bfloat16()
            t = median_ms(
                {
                    "invariant": lambda lin=lin, x=x: lin.quant.apply(lin, x),
                    "f32": lambda w=w32, x=x: F.linear(x, w),
                    "bf16": lambda w=w16, x=x16: F.linear(x, w),
                },
                repeats,
            )
            cost = t["invariant"] / t["f32"]
            print(f"{name:>8} {rows:>5} {t['invariant']:>10.3f} {t['f32']:>8.3f} {t['bf16']:>7.3f} {cost:>13.2f}x")


def attention_case(
    heads: int, kv_heads: int, d: int, seqs: int, q_len: int, ctx: int, repeats: int
) -> dict[str, float]:
    """``seqs`` sequences of ``q_len`` new queries after ``ctx`` cached tokens, both ways."""
    gen = torch.Generator().manual_seed(0)
    total = ctx + q_len
    nb = -(-total // BLOCK)
    shape = (seqs * nb, BLOCK, kv_heads, d)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.arange(seqs * nb).view(seqs, nb)
    positions = torch.arange(ctx, total).repeat(seqs)
    seq_of_token = torch.arange(seqs).repeat_interleave(q_len)
    q = torch.randn(seqs * q_len, heads, d, generator=gen)
    # The same keys and values, contiguous per sequence: [seqs, kv_heads, total, d].
    k = k_cache.view(seqs, nb * BLOCK, kv_heads, d)[:, :total].transpose(1, 2).contiguous()
    v = v_cache.view(seqs, nb * BLOCK, kv_heads, d)[:, :total].transpose(1, 2).contiguous()
    qs = q.view(seqs, q_len, heads, d).transpose(1, 2)
    mask = torch.arange(total)[None, :] <= torch.arange(ctx, total)[:, None]  # causal, bottom-right
    return median_ms(
        {
            "invariant": lambda: paged_attention.paged_attention(
                q, k_cache, v_cache, positions, seq_of_token, tables, d**-0.5
            ),
            "sdpa": lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True),
        },
        repeats,
    )


def attention(model: torch.nn.Module, repeats: int) -> None:
    attn = model.model.layers[0].self_attn
    print("\nattention (one layer): ms, median of", repeats)
    print(f"{'queries':>14} {'context':>8} {'invariant':>10} {'SDPA':>8} {'cost':>7}")
    for seqs, q_len, ctx in ((1, 1, 200), (16, 1, 200), (64, 1, 200), (1, 512, 0), (1, 512, 1500), (1, 512, 3488)):
        t = attention_case(attn.num_heads, attn.num_kv_heads, attn.head_dim, seqs, q_len, ctx, repeats)
        label = f"{seqs} x {q_len}"
        print(f"{label:>14} {ctx:>8} {t['invariant']:>10.3f} {t['sdpa']:>8.3f} {t['invariant'] / t['sdpa']:>6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load_model(resolve_model_path(None), quantization="auto")
    with torch.inference_mode():
        products(model, args.repeats)
        attention(model, args.repeats)


if __name__ == "__main__":
    main()
