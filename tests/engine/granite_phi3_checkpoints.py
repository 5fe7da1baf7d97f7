"""Tiny random Granite and Phi-3 checkpoints made from transformers configs (tests/engine/test_granite.py,
test_phi3.py and the native decoder stack's tests/kernels/test_decoder_stack.py): four heads of 64 (a head
the native attention kernel takes), Granite's four multipliers away from 1, Phi-3 with a window, partial
rotary, or partial rotary with LongRoPE."""

from __future__ import annotations

import torch
import transformers

from tests.engine.test_gguf_loader import _randomize

GRANITE_TINY = dict(  # noqa: C408 - keyword names as in the transformers config
    vocab_size=96,
    hidden_size=256,  # 4 heads of 64: a head the native attention kernel takes
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
# A prompt of 40 tokens (past Phi-3's window and LongRoPE's original length below).
PROMPT = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
# Granite 3.0 2B's embedding, residual and logits values; an attention scale that is not 1/8.
MULTIPLIERS = dict(  # noqa: C408
    embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=8.0
)


def granite(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GraniteConfig(**GRANITE_TINY, **MULTIPLIERS, tie_word_embeddings=tied)
    model = transformers.GraniteForCausalLM(config)
    _randomize(model, seed=1)
    return model.eval()


PHI3_TINY = dict(  # noqa: C408 - keyword names as in the transformers config
    vocab_size=96,
    hidden_size=256,  # 4 heads of 64: a head the native attention kernel takes
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)
ROTARY_DIM = 32  # partial_rotary_factor 0.5 of a 64 head
# LongRoPE past a 32-token pretraining length (the 40-token prompt outgrows it: transformers' forward pass
# over it takes the long factors, as a served context of the model's 256 does); both sets away from 1.
ORIGINAL = 32
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + i / 8 for i in range(ROTARY_DIM // 2)],
    "long_factor": [4.0 + i for i in range(ROTARY_DIM // 2)],
    "original_max_position_embeddings": ORIGINAL,
}
WINDOW = 16  # tokens, every layer (Phi-3's sliding_window): the prompt is 40
VARIANTS = {  # id -> (tied, Phi3Config keywords)
    "untied-window": (False, {"sliding_window": WINDOW}),
    "tied-partial": (True, {"partial_rotary_factor": 0.5}),
    "untied-partial-longrope": (
        False,
        {"partial_rotary_factor": 0.5, "original_max_position_embeddings": ORIGINAL, "rope_scaling": LONGROPE},
    ),
}


def phi3(variant: str) -> torch.nn.Module:
    tied, extra = VARIANTS[variant]
    torch.manual_seed(0)
    config = transformers.Phi3Config(**PHI3_TINY, **extra, tie_word_embeddings=tied)
    model = transformers.Phi3ForCausalLM(config)
    _randomize(model, seed=1)
    with torch.no_grad():  # halved: 256-wide sums of _randomize's weights give logits float32 rounds past 1e-4
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(0.5)
    return model.eval()
