"""Embeddings in the worker: each input run alone through the model, its hidden states pooled, normalized.

An input is always its own sequence (one forward pass of its tokens only, no padding, no batchmates), so its
vector is the same bits whatever else the request or the worker holds. An encoder (worker/models/bert.py) gives the
hidden states itself; a Llama-family decoder (Qwen3-Embedding) runs its layers here with causal attention over
the input alone, without the KV cache, through the same regions its forward pass runs (llama.py's
``pre_attention`` / ``post_attention`` / ``final_norm``), so its projections, norms and rotary are the
generating model's own. Pooling and normalization are sentence-transformers' (``Pooling``, ``Normalize``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill_service.worker.models.embedding_spec import EmbeddingConfigError, EmbeddingSpec

HiddenStates = Callable[[torch.Tensor], torch.Tensor]


class Embedder:
    def __init__(self, hidden_states: HiddenStates, spec: EmbeddingSpec, dimensions: int, device: torch.device) -> None:
        self.hidden_states = hidden_states
        self.spec = spec
        self.dimensions = dimensions
        self.device = device
        # The most tokens one input may hold, and the vocabulary's size: what the server checks inputs against.
        self.context_length = 0
        self.vocab_size = 0

    @torch.inference_mode()
    def embed(self, inputs: Sequence[Sequence[int]], dimensions: int = 0) -> list[bytes]:
        """Each input's vector (its first ``dimensions`` components, renormalized if the model normalizes; 0:
        all), as little-endian float32 bytes."""
        return [self._one(ids, dimensions) for ids in inputs]

    def _one(self, ids: Sequence[int], dimensions: int) -> bytes:
        hidden = self.hidden_states(torch.tensor(list(ids), dtype=torch.long, device=self.device)).float()
        if self.spec.pooling == "cls":
            vector = hidden[0]
        elif self.spec.pooling == "last":
            vector = hidden[-1]
        else:  # sentence-transformers' mean: the sum over the tokens, divided by their count
            vector = hidden.sum(0) / hidden.shape[0]
        if self.spec.normalize:
            vector = F.normalize(vector, p=2, dim=0)
        if 0 < dimensions < vector.shape[0]:
            vector = vector[:dimensions]
            if self.spec.normalize:  # a Matryoshka vector cut short is scaled to length 1 again
                vector = F.normalize(vector, p=2, dim=0)
        data: bytes = vector.cpu().numpy().astype("<f4").tobytes()
        return data


def decoder_hidden_states(model: Any) -> HiddenStates:
    """The final-normed hidden states of a Llama-family decoder for one sequence, attending causally within it.
    EmbeddingConfigError for a family whose forward pass is not Llama's (its layers run otherwise)."""
    from tokenmill_service.worker.models.decoder import (
        DecoderLayer,
        DecoderModel,
        final_norm,
        post_attention,
        pre_attention,
    )

    decoder = model.model
    # The plain decoder's model and layers only: a family with its own (Gemma's norms, Granite's multipliers,
    # experts) runs its layers otherwise.
    layers = [layer for layer in decoder.layers if type(layer) is DecoderLayer]
    if type(decoder) is not DecoderModel or len(layers) != len(decoder.layers):
        raise EmbeddingConfigError(
            f"the {model.config.architecture} family does not embed here: only decoders whose layers run as Llama's "
            "(Llama, Mistral, Qwen2, Qwen3) do"
        )
    if model.tp.size > 1:
        raise EmbeddingConfigError("a decoder split over --tensor-parallel ranks does not embed here")

    def hidden_states(input_ids: torch.Tensor) -> torch.Tensor:
        slots = getattr(model, "lora", None)
        if slots is not None:  # the base model's vector: no adapter, whatever the last step's tokens used
            slots.batch.set([-1] * input_ids.shape[0], input_ids.device)
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        x = decoder.embed(input_ids)
        residual: torch.Tensor | None = None
        for layer in layers:
            q, k, v, residual = pre_attention(layer, positions, x, residual)
            attended = causal_attention(q, k, v, layer.self_attn.params.scale, layer.self_attn.params.window)
            x, residual = post_attention(layer, attended.to(q.dtype), residual)
        assert residual is not None
        out: torch.Tensor = final_norm(decoder.norm, x, residual)
        return out

    return hidden_states


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Attention of one sequence over itself, causal (and within ``window`` tokens back, if any), in float32:
    q [T, heads, d], k and v [T, kv_heads, d] -> [T, heads * d]."""
    tokens, heads, _ = q.shape
    group = heads // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    values = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    position = torch.arange(tokens, device=q.device)
    distance = position[:, None] - position[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1).reshape(tokens, -1)
