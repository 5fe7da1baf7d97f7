"""The triton latent attention (worker/kernels/triton/latent_attention.py; its interpreter on a CPU, float32)
matches the torch reference (worker/kernels/latent_attention.py) on a step mixing a prefill chunk and decode
tokens over shuffled block tables, and a query's result is bitwise the same alone, beside other
sequences' queries and as a row of its sequence's prefill. Splits of 64 keys here, to get several
from a short context."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_latent_attention import cache_of, params_of
from tests.triton_setup import DEVICE
from tokenmill_service.worker.kernels.attention_metadata import build_attention_metadata
from tokenmill_service.worker.kernels.attention_params import LatentCache
from tokenmill_service.worker.kernels.latent_attention import store_latent
from tokenmill_service.worker.kernels.torch_ops import TorchOps
from tokenmill_service.worker.kernels.triton.latent_attention import latent_attention

SPLIT = 64
NUM_BLOCKS = 24
CONTEXT = 100  # over two splits
# (heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, block size): a tiny model's
# (the invariance test's; against the reference in tests/engine/test_deepseek_v3_triton.py, as a
# model), and dims that are not powers of two (the reference test's).
DIMS = [(4, 64, 64, 32, 32, 16), (3, 48, 16, 24, 40, 8)]


def _setup(heads: int, latent: int, rope: int, nope: int, v: int, block: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    latent_cache = torch.zeros(NUM_BLOCKS, block, 1, latent)
    rope_cache = torch.zeros(NUM_BLOCKS, block, 1, rope)
    slots = NUM_BLOCKS * block
    c, r = torch.randn(slots, latent, generator=gen), torch.randn(slots, rope, generator=gen)
    store_latent(c, r, LatentCache(latent_cache, rope_cache), torch.arange(slots))
    w_kv_b = torch.randn(heads, nope + v, latent, generator=gen) * 0.3
    q = torch.randn(CONTEXT + 8, heads, nope + rope, generator=gen)  # halves of one tensor, as the model's
    q_nope, q_rope = q.split([nope, rope], -1)
    tensors = {
        "latent_cache": latent_cache,
        "rope_cache": rope_cache,
        # The up-projections as the model keeps them: views of kv_b_proj's weight [H, nope + v, L].
        "w_uk": w_kv_b[:, :nope],
        "w_uv": w_kv_b[:, nope:].transpose(1, 2),
        "q_nope": q_nope[:CONTEXT],
        "q_rope": q_rope[:CONTEXT],
        "others_nope": q_nope[CONTEXT:],
        "others_rope": q_rope[CONTEXT:],
    }
    return {name: x.to(DEVICE) for name, x in tensors.items()}


def _tables(block: int) -> list[list[int]]:
    width = -(-CONTEXT // block)
    return [list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - width, -1)), [0, 2], [1]]  # out of order


@pytest.mark.parametrize(("heads", "latent", "rope", "nope", "v", "block"), DIMS[1:])
@torch.inference_mode()
def test_triton_latent_attention_matches_the_reference(
    heads: int, latent: int, rope: int, nope: int, v: int, block: int
) -> None:
    t = _setup(heads, latent, rope, nope, v, block)
    # A prefill chunk after cached positions, beside two decode tokens of other sequences.
    meta = build_attention_metadata(
        [CONTEXT - 70, 1, 1], [70, 9, 4], _tables(block), t["latent_cache"][None], t["rope_cache"][None]
    )
    q_nope = torch.cat((t["q_nope"][70:], t["others_nope"][:2]))
    q_rope = torch.cat((t["q_rope"][70:], t["others_rope"][:2]))
    args = (q_nope, q_rope, cache_of(t), meta, params_of(t, 0.15))
    got = latent_attention(*args, split_keys=SPLIT)
    torch.testing.assert_close(got, TorchOps().latent_attention(*args), rtol=1e-5, atol=2e-5)


@torch.inference_mode()
def test_a_triton_query_is_bitwise_the_same_alone_beside_others_and_in_its_prefill() -> None:
    heads, latent, rope, nope, v, block = DIMS[0]
    t = _setup(heads, latent, rope, nope, v, block)
    tables = _tables(block)

    def run(
        query_lens: list[int], starts: list[int], nope_rows: torch.Tensor, rope_rows: torch.Tensor, seqs: list[int]
    ) -> torch.Tensor:
        meta = build_attention_metadata(
            query_lens, starts, [tables[s] for s in seqs], t["latent_cache"][None], t["rope_cache"][None]
        )
        return latent_attention(nope_rows, rope_rows, cache_of(t), meta, params_of(t, 0.2), SPLIT)

    prefill = run([CONTEXT], [0], t["q_nope"], t["q_rope"], [0])
    on, orr = t["others_nope"], t["others_rope"]
    for p in (17, SPLIT, CONTEXT - 1):
        n, r = t["q_nope"][p : p + 1], t["q_rope"][p : p + 1]
        alone = run([1], [p], n, r, [0])
        crowd = run([1, 1, 2], [3, p, 5], torch.cat((on[:1], n, on[1:3])), torch.cat((orr[:1], r, orr[1:3])), [1, 0, 2])
        assert torch.equal(crowd[1], alone[0]), p
        assert torch.equal(alone[0], prefill[p]), p
