"""bench/fidelity.py's float32 reference, which holds one layer of the file at a time so that an 8B model's
fits in memory, gives transformers' GGUF loading's own logprobs, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 4, 2, 128, 300
SEQUENCES = [[1, 54, 258, 82, 49, 14, 9, 288], [3, 17, 99, 124, 5]]


def write_tiny_llama(path: Path, tied: bool) -> Path:
    """A Llama of the 8B's kind at a few hundred kilobytes, its matrices in Q8_0 (dequantized by gguf's code)."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(VOCAB)

    def matrix(name: str, rows: int, columns: int) -> None:
        values = rng.standard_normal((rows, columns), dtype=np.float32) * 0.2
        quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def norm(name: str) -> None:
        writer.add_tensor(name, 1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32))

    matrix("token_embd.weight", VOCAB, HIDDEN)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_the_streamed_reference_is_transformers_gguf_loading_bit_for_bit(tmp_path: Path, tied: bool) -> None:
    """An output matrix of its own (as the 8B's) and the embedding as the output; 4 query heads to 2 key-value
    heads, so the file's query/key permutation is undone for both."""
    import torch
    from streamed_reference import next_token_logprobs
    from transformers import AutoModelForCausalLM

    path = write_tiny_llama(tmp_path / "tiny.gguf", tied)
    streamed = next_token_logprobs(path, SEQUENCES)

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    for sequence, got in zip(SEQUENCES, streamed, strict=True):
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(torch.tensor([sequence])).logits[0].double(), -1)
        assert got == [logprobs[p, token].item() for p, token in enumerate(sequence[1:])]
