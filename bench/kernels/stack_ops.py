"""Torch operations in one decode step of a tiny random gpt-oss, Gemma 2, Gemma 3, Granite, Phi-4-mini or
DeepSeek-V3, on each executor the checkout has.

    python bench/kernels/stack_ops.py --layers 2
    python bench/kernels/stack_ops.py --layers 24   # gpt-oss-20b's layer count, 32 experts top-4
    python bench/kernels/stack_ops.py --family gemma3 --layers 26   # Gemma 3 1B's layers, heads of 256
    python bench/kernels/stack_ops.py --family gemma2 --layers 26   # Gemma 2 2B's layers, heads of 256
    python bench/kernels/stack_ops.py --family granite --layers 40  # Granite 3 2B's layers and multipliers
    python bench/kernels/stack_ops.py --family phi3 --layers 32     # Phi-4-mini's: 0.75 partial rotary, LongRoPE
    python bench/kernels/stack_ops.py --family deepseek_v3 --layers 4  # latent attention, the first layer dense

A transformers config (GptOssConfig, Gemma2Config, Gemma3TextConfig, GraniteConfig, Phi3Config or
DeepseekV3Config: latent 64, rotary dims 64 interleaved, its experts in 4 groups of which 2 are kept, one
shared expert) with small
widths (hidden 64; heads of 64 for gpt-oss, Granite and Phi-3 (hidden 256), of 256 for Gemma, as their
released models) and the given layer count, experts
and top-k (gpt-oss's; every parameter random), loaded at float32 dense (``--quantization none``); one
sequence prefilled with 40 tokens (past its 8-key windows), its KV cache in the groups the engine gives
its windowed and global layers; then one decode step (metadata, embedding, forward pass, logits of the
last row) counted under torch.profiler: the aten operations called from Python (not those they call
themselves). The counts depend on the layer count and the routing, not on the widths.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from tokenmill_service.worker.engine.kv_cache_groups import plan_kv_cache_groups
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepPlan
from tokenmill_service.worker.loader import load_model

PROMPT = 40


def checkpoint(directory: Path, family: str, layers: int, experts: int, top_k: int) -> None:
    gemma = dict(  # noqa: C408 - the transformers configs' keyword names
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=8, max_position_embeddings=256, query_pre_attn_scalar=256,
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "gemma2":
        config: Any = transformers.Gemma2Config(**gemma)
        model: Any = transformers.Gemma2ForCausalLM(config)
    elif family == "gemma3":  # five local layers to one global, two rotary tables
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        }
        config = transformers.Gemma3TextConfig(**gemma, rope_parameters=rope)
        model = transformers.Gemma3ForCausalLM(config)
    elif family in ("granite", "phi3"):
        model = llama_like(family, layers)
    elif family == "deepseek_v3":
        model = transformers.DeepseekV3ForCausalLM(deepseek_v3_config(layers, experts, top_k))
    else:
        model = transformers.GptOssForCausalLM(gpt_oss_config(layers, experts, top_k))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)


def llama_like(family: str, layers: int) -> Any:
    """Granite with Granite 3.0 2B's multipliers, or Phi-4-mini's rotary: 48 of 64 dims (partial_rotary_factor
    0.75), LongRoPE over a 64-position original context (the long factors serve the model's 256)."""
    sizes = dict(  # noqa: C408
        vocab_size=256, hidden_size=256, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    if family == "granite":
        multipliers = dict(  # noqa: C408
            embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=8.0
        )
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(**sizes, **multipliers))
    rope = {
        "rope_type": "longrope", "short_factor": [1.0] * 24, "long_factor": [4.0] * 24,
        "original_max_position_embeddings": 64,
    }  # fmt: skip
    config = transformers.Phi3Config(
        **sizes, partial_rotary_factor=0.75, original_max_position_embeddings=64, rope_scaling=rope, pad_token_id=None
    )
    return transformers.Phi3ForCausalLM(config)


def gpt_oss_config(layers: int, experts: int, top_k: int) -> Any:
    return transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=experts, num_experts_per_tok=top_k,
        sliding_window=8, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 150000.0},
    )  # fmt: skip


def deepseek_v3_config(layers: int, experts: int, top_k: int) -> Any:
    return transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=32, max_position_embeddings=256, n_routed_experts=experts, num_experts_per_tok=top_k,
        n_group=4, topk_group=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
    )  # fmt: skip


def _top(event: Any) -> bool:
    """Whether no aten operation calls this one."""
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith("aten::"):
        parent = parent.cpu_parent
    return parent is None


def top_level_ops(events: list[Any]) -> int:
    """aten operations whose caller is not itself an aten operation."""
    return sum(e.name.startswith("aten::") and _top(e) for e in events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--family", choices=("gpt-oss", "gemma2", "gemma3", "granite", "phi3", "deepseek_v3"), default="gpt-oss"
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--by-name", action="store_true", help="each operation's count too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint(Path(tmp), args.family, args.layers, args.experts, args.top_k)
        model = load_model(Path(tmp), dtype=torch.float32, quantization="none")
    groups = plan_kv_cache_groups(model.attention_windows())
    print(f"plan: executor {model.plan.executor.value} ({model.plan.executor.reason}); kv groups {groups.describe()}")
    ids = torch.randint(0, 256, (PROMPT + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    blocks = -(-(PROMPT + 1) // 16)
    tables = [list(range(g * blocks, (g + 1) * blocks)) for g in range(groups.num_groups)]
    for executor in ("eager", "native-stack"):
        try:
            runner = ModelRunner(model, 16, blocks * groups.num_groups, executor=executor, kv_groups=groups)
        except ValueError as e:
            print(f"{executor}: not available ({e})")
            continue
        with torch.inference_mode():
            runner.execute(StepPlan(ids[:PROMPT], [PROMPT], [0], tables, [PROMPT - 1], []))
            decode = StepPlan(ids[PROMPT:], [1], [PROMPT], tables, [0], [])
            runner.execute(decode)  # warm
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                runner.execute(decode)
        count = top_level_ops(prof.events())
        print(f"{executor}: {count} torch ops in a decode step ({args.family}, {args.layers} layers)")
        if args.by_name:
            names = Counter(e.name for e in prof.events() if e.name.startswith("aten::") and _top(e))
            print("  " + ", ".join(f"{n} {c}" for n, c in names.most_common()))


if __name__ == "__main__":
    main()
