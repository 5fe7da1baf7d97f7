"""Multi-head latent attention over the latent cache (worker/kernels/latent_attention.py, the torch ops'
``latent_attention``): the absorbed form equals attention over the keys and values ``kv_b_proj``
expands from the latents (computed here the plain way), and a query's result is bitwise the same
alone, beside other sequences and as a row of its sequence's prefill, across key chunks."""

from __future__ import annotations

import pytest
import torch

from tokenmill_service.worker.kernels.attention_metadata import KEY_CHUNK, build_attention_metadata
from tokenmill_service.worker.kernels.attention_params import LatentAttentionParams, LatentCache
from tokenmill_service.worker.kernels.torch_ops import TorchOps

NUM_BLOCKS = 128
CONTEXT = 300  # more than one KEY_CHUNK of keys


def _setup(heads: int, latent: int, rope: int, nope: int, v: int, block: int) -> dict[str, torch.Tensor]:
    ops, gen = TorchOps(), torch.Generator().manual_seed(0)
    assert ops.latent_cache_layout is not None
    c_shape, r_shape = ops.latent_cache_layout.shapes(1, NUM_BLOCKS, block, latent, rope)
    latent_cache, rope_cache = torch.zeros(c_shape), torch.zeros(r_shape)
    slots = NUM_BLOCKS * block
    c, r = torch.randn(slots, latent, generator=gen), torch.randn(slots, rope, generator=gen)
    ops.store_latent(c, r, LatentCache(latent_cache[0], rope_cache[0]), torch.arange(slots))
    w_kv_b = torch.randn(heads, nope + v, latent, generator=gen) * 0.3
    return {
        "latent_cache": latent_cache[0],
        "rope_cache": rope_cache[0],
        "c": c,
        "r": r,
        # The up-projections as the model keeps them: views of kv_b_proj's weight [H, nope + v, L].
        "w_uk": w_kv_b[:, :nope],
        "w_uv": w_kv_b[:, nope:].transpose(1, 2),
        "q_nope": torch.randn(CONTEXT, heads, nope, generator=gen),
        "q_rope": torch.randn(CONTEXT, heads, rope, generator=gen),
        "others_nope": torch.randn(40, heads, nope, generator=gen),
        "others_rope": torch.randn(40, heads, rope, generator=gen),
    }


def cache_of(t: dict[str, torch.Tensor]) -> LatentCache:
    return LatentCache(t["latent_cache"], t["rope_cache"])


def params_of(t: dict[str, torch.Tensor], scale: float) -> LatentAttentionParams:
    return LatentAttentionParams(t["w_uk"], t["w_uv"], scale)


# (heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, block size)
DIMS = [(4, 32, 16, 16, 8, 16), (3, 64, 64, 32, 32, 4)]


@pytest.mark.parametrize(("heads", "latent", "rope", "nope", "v", "block"), DIMS[:1])
@torch.inference_mode()
def test_the_absorbed_form_is_attention_over_the_expanded_keys_and_values(
    heads: int, latent: int, rope: int, nope: int, v: int, block: int
) -> None:
    t = _setup(heads, latent, rope, nope, v, block)
    table = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - -(-CONTEXT // block), -1))  # out of order
    meta = build_attention_metadata([CONTEXT], [0], [table], t["latent_cache"][None], t["rope_cache"][None])
    scale = 0.17
    out = TorchOps().latent_attention(t["q_nope"], t["q_rope"], cache_of(t), meta, params_of(t, scale))
    slots = torch.tensor([table[p // block] * block + p % block for p in range(CONTEXT)])
    c, r = t["c"][slots].double(), t["r"][slots].double()
    k_nope = torch.einsum("jl,hnl->hjn", c, t["w_uk"].double())  # each head's keys, expanded
    values = torch.einsum("jl,hlv->hjv", c, t["w_uv"].double())
    scores = torch.einsum("ihn,hjn->hij", t["q_nope"].double(), k_nope)
    scores = (scores + torch.einsum("ihr,jr->hij", t["q_rope"].double(), r)) * scale
    scores.masked_fill_(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hij,hjv->ihv", scores.softmax(-1), values)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "latent", "rope", "nope", "v", "block"), DIMS)
@torch.inference_mode()
def test_a_query_is_bitwise_the_same_alone_beside_others_and_in_its_prefill(
    heads: int, latent: int, rope: int, nope: int, v: int, block: int
) -> None:
    t = _setup(heads, latent, rope, nope, v, block)
    ops = TorchOps()
    width = -(-CONTEXT // block)
    tables = [list(range(width)), [NUM_BLOCKS - 1, NUM_BLOCKS - 3], list(range(width, width + 40 // block + 1))]

    def run(
        query_lens: list[int], starts: list[int], nope_rows: torch.Tensor, rope_rows: torch.Tensor, seqs: list[int]
    ) -> torch.Tensor:
        meta = build_attention_metadata(
            query_lens, starts, [tables[s] for s in seqs], t["latent_cache"][None], t["rope_cache"][None]
        )
        return ops.latent_attention(nope_rows, rope_rows, cache_of(t), meta, params_of(t, 0.2))

    prefill = run([CONTEXT], [0], t["q_nope"], t["q_rope"], [0])
    on, orr = t["others_nope"], t["others_rope"]
    for p in (0, 5, 13, KEY_CHUNK - 1, KEY_CHUNK, CONTEXT - 1):
        n, r = t["q_nope"][p : p + 1], t["q_rope"][p : p + 1]
        alone = run([1], [p], n, r, [0])
        crowd = run(
            [1, 1, 1], [3, p, 20], torch.cat((on[:1], n, on[1:2])), torch.cat((orr[:1], r, orr[1:2])), [1, 0, 2]
        )
        assert torch.equal(crowd[1], alone[0]), p
        assert torch.equal(alone[0], prefill[p]), p
    # The prefill in two chunks, the second beside another sequence's prefill.
    first = run([KEY_CHUNK + 7], [0], t["q_nope"][: KEY_CHUNK + 7], t["q_rope"][: KEY_CHUNK + 7], [0])
    rest = CONTEXT - KEY_CHUNK - 7
    mixed = run(
        [9, rest],
        [0, KEY_CHUNK + 7],
        torch.cat((on[:9], t["q_nope"][KEY_CHUNK + 7 :])),
        torch.cat((orr[:9], t["q_rope"][KEY_CHUNK + 7 :])),
        [2, 0],
    )
    assert torch.equal(torch.cat((first, mixed[9:])), prefill)
