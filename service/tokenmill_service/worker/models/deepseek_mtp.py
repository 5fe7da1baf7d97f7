"""DeepSeek-V3's multi-token-prediction (MTP) layers, as a draft model for speculation.

A DeepSeek-V3 checkpoint keeps ``num_nextn_predict_layers`` of them after its decoder layers
(``model.layers.<num_hidden_layers + i>``). Layer ``i`` guesses the token two places ahead of the one
it reads: at position ``p`` it takes the token ``t_p`` and the main model's final hidden state ``h_{p-1}``
(after its final norm) of the position before, and computes

    x = eh_proj([enorm(embed(t_p)); hnorm(h_{p-1})])      # embedding first, as the checkpoint is trained
    y = x + block(x)                                        # one full decoder layer (MLA + its MLP)
    logits = shared_head.head(shared_head.norm(y))          # the token at p + 1

with the embedding table shared with the main model (the checkpoint's own copy, ``embed_tokens``, is
left aside: it holds the same rows). Chained, ``y`` stands in for the next position's ``h`` and the
guessed token for its ``t``. The block's attention caches its latents like a decoder layer, as one
more layer of the paged latent cache (``DeepseekV3ForCausalLM.kv_cache_shapes``). Nothing here
touches the main model's results: these guesses are only checked (worker/engine/mtp_drafter.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from tokenmill_service.worker.distributed.parallel import TensorParallel
from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata
from tokenmill_service.worker.kernels.interface import Ops
from tokenmill_service.worker.layers.embedding import ParallelLMHead
from tokenmill_service.worker.layers.linear import QuantFactory, ReplicatedLinear
from tokenmill_service.worker.layers.norm import RMSNorm
from tokenmill_service.worker.models.config import ModelConfig
from tokenmill_service.worker.models.decoder import DecoderLayer, post_attention, pre_attention
from tokenmill_service.worker.models.params import LayerParams

# The parts of an MTP layer that are its own (the rest is its decoder block's).
_OWN_PARTS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.(.+)")


def mtp_layer_count(config: ModelConfig) -> int:
    """The checkpoint's declared MTP layers (``num_nextn_predict_layers``; 0: none)."""
    return config.extra_int("mtp_layers")


def mtp_prefix(index: int) -> str:
    return f"mtp.{index}"


def mtp_name(name: str, num_layers: int) -> str | None:
    """A checkpoint tensor's name in the model when it belongs to an MTP layer (``mtp.<i>.<part>``, its
    decoder block's parts under ``mtp.<i>.block.``), "" for its copy of the embedding table (left aside),
    or None when it is not an MTP layer's."""
    match = _LAYER_INDEX.fullmatch(name)
    if match is None or int(match.group(1)) < num_layers:
        return None
    index, rest = int(match.group(1)) - num_layers, match.group(2)
    if rest.startswith("embed_tokens."):
        return ""
    if rest.startswith(_OWN_PARTS):
        return f"{mtp_prefix(index)}.{rest}"
    return f"{mtp_prefix(index)}.block.{rest}"


def mtp_checkpoint_prefix(prefix: str, num_layers: int) -> str:
    """A layer prefix in the model (``mtp.<i>.block.<part>``, ``mtp.<i>.<part>``) as the checkpoint names it
    (``model.layers.<num_layers + i>.<part>``); any other prefix as it is."""
    head, _, rest = prefix.partition(".")
    index, _, part = rest.partition(".")
    if head != "mtp" or not index.isdigit():
        return prefix
    return f"model.layers.{num_layers + int(index)}.{part.removeprefix('block.')}"


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, ops: Ops, quant: QuantFactory, tp: TensorParallel) -> None:
        super().__init__()
        head_quant = quant(f"{prefix}.head")
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, head_quant.act_dtype)
        self.head = ParallelLMHead(config.hidden_size, config.vocab_size, head_quant, tp)


class DeepseekMTPLayer(nn.Module):
    """One MTP layer (see the module's docstring); its block is layer ``layer_idx`` of the latent cache."""

    def __init__(self, p: LayerParams, make_block: Callable[[LayerParams], DecoderLayer]) -> None:
        super().__init__()
        config, quant, ops = p.config, p.quant, p.ops
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, False, quant(f"{p.prefix}.eh_proj"))
        proj_dtype = self.eh_proj.quant.act_dtype
        self.enorm = RMSNorm(hidden, eps, ops, proj_dtype)
        self.hnorm = RMSNorm(hidden, eps, ops, proj_dtype)
        self.block = make_block(p.under("block"))
        self.shared_head = SharedHead(config, f"{p.prefix}.shared_head", ops, quant, p.tp)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The layer's output ``y`` [T, hidden] (float32) for the tokens' embeddings and the hidden states
        of the positions before them; stores the block's latents in the cache."""
        x = self.eh_proj(torch.cat((self.enorm(embeds)[0], self.hnorm(previous.float())[0]), dim=-1))
        q, k, v, residual = pre_attention(self.block, positions, x, None)
        out, residual = post_attention(self.block, self.block.self_attn.attend(q, k, v, meta), residual)
        return out.float() + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, vocab] of the token after each position ``hidden`` was computed at."""
        logits: torch.Tensor = self.shared_head.head(self.shared_head.norm(hidden)[0])
        return logits
