"""The native CPU latent attention (worker/kernels/cpu/latent_attention.cpp, the native ops' ``latent_attention``):
within float32 rounding of the torch reference (worker/kernels/latent_attention.py) over float32 and float16
caches, and a query's result bitwise the same alone, beside other sequences' queries and as a row of
its sequence's prefill (whole or in chunks)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_latent_attention import CONTEXT, NUM_BLOCKS, cache_of, params_of
from tokenmill_service.worker.kernels.attention_metadata import KEY_CHUNK, build_attention_metadata
from tokenmill_service.worker.kernels.attention_params import LatentCache
from tokenmill_service.worker.kernels.cpu import latent_attention
from tokenmill_service.worker.kernels.cpu.ops import NativeCpuOps
from tokenmill_service.worker.kernels.torch_ops import TorchOps

pytestmark = pytest.mark.skipif(latent_attention.unavailable_reason() is not None, reason="native kernel unavailable")

# (heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, block size): a tiny model's,
# and more heads than a tile takes (12 > 8) with DeepSeek-V3's rope 64 and a nope dim not in 16s.
DIMS = [(4, 64, 64, 32, 32, 16), (12, 32, 16, 24, 16, 4)]


def _setup(
    heads: int, latent: int, rope: int, nope: int, v: int, block: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ops = TorchOps()
    assert ops.latent_cache_layout is not None
    c_shape, r_shape = ops.latent_cache_layout.shapes(1, NUM_BLOCKS, block, latent, rope)
    latent_cache, rope_cache = torch.zeros(c_shape, dtype=dtype)[0], torch.zeros(r_shape, dtype=dtype)[0]
    slots = NUM_BLOCKS * block
    c, r = torch.randn(slots, latent, generator=gen), torch.randn(slots, rope, generator=gen)
    ops.store_latent(c, r, LatentCache(latent_cache, rope_cache), torch.arange(slots))
    # Queries as the model hands them: nope and rope halves of one [T, H, nope + rope] tensor.
    w_kv_b = torch.randn(heads, nope + v, latent, generator=gen) * 0.3
    q = torch.randn(CONTEXT + 40, heads, nope + rope, generator=gen)
    q_nope, q_rope = q.split([nope, rope], -1)
    return {
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


def _tables(block: int) -> list[list[int]]:
    width = -(-CONTEXT // block)
    return [
        list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - width, -1)),  # out of order
        [0, 2, 1],
        list(range(width + 1, width + 2 + 40 // block)),
    ]


@pytest.mark.parametrize(("dtype", "copies"), [(torch.float32, False), (torch.float16, False), (torch.float32, True)])
@pytest.mark.parametrize(("heads", "latent", "rope", "nope", "v", "block"), DIMS)
@torch.inference_mode()
def test_native_latent_attention_is_the_references_within_float32_rounding(
    heads: int, latent: int, rope: int, nope: int, v: int, block: int, dtype: torch.dtype, copies: bool
) -> None:
    """Over float32 and float16 caches; w_uv a view of kv_b_proj's rows (as the model has it) or a copy."""
    t = _setup(heads, latent, rope, nope, v, block, dtype)
    if copies:
        t["w_uk"], t["w_uv"] = t["w_uk"].contiguous(), t["w_uv"].contiguous()
    assert latent_attention.fits(t["q_nope"], t["q_rope"], cache_of(t), params_of(t, 0.15))
    tables = _tables(block)
    # A prefill beside two decode tokens of other sequences, as one step.
    meta = build_attention_metadata([CONTEXT, 1, 1], [0, 7, 30], tables, t["latent_cache"][None], t["rope_cache"][None])
    q_nope = torch.cat((t["q_nope"], t["others_nope"][:2]))
    q_rope = torch.cat((t["q_rope"], t["others_rope"][:2]))
    args = (q_nope, q_rope, cache_of(t), meta, params_of(t, 0.15))
    native, reference = NativeCpuOps().latent_attention(*args), TorchOps().latent_attention(*args)
    torch.testing.assert_close(native, reference, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "latent", "rope", "nope", "v", "block"), DIMS)
@torch.inference_mode()
def test_a_native_query_is_bitwise_the_same_alone_beside_others_and_in_its_prefill(
    heads: int, latent: int, rope: int, nope: int, v: int, block: int
) -> None:
    t = _setup(heads, latent, rope, nope, v, block, torch.float32)
    tables, ops = _tables(block), NativeCpuOps()

    def run(
        query_lens: list[int], starts: list[int], nope_rows: torch.Tensor, rope_rows: torch.Tensor, seqs: list[int]
    ) -> torch.Tensor:
        meta = build_attention_metadata(
            query_lens, starts, [tables[s] for s in seqs], t["latent_cache"][None], t["rope_cache"][None]
        )
        return ops.latent_attention(nope_rows, rope_rows, cache_of(t), meta, params_of(t, 0.2))

    prefill = run([CONTEXT], [0], t["q_nope"], t["q_rope"], [0])
    on, orr = t["others_nope"], t["others_rope"]
    for p in (0, 5, 13, KEY_CHUNK - 1, CONTEXT - 1):
        n, r = t["q_nope"][p : p + 1], t["q_rope"][p : p + 1]
        alone = run([1], [p], n, r, [0])
        crowd = run(
            [1, 1, 1], [3, p, 20], torch.cat((on[:1], n, on[1:2])), torch.cat((orr[:1], r, orr[1:2])), [1, 0, 2]
        )
        assert torch.equal(crowd[1], alone[0]), p
        assert torch.equal(alone[0], prefill[p]), p
    # The prefill in two chunks, the second beside another sequence's prefill.
    split = 37
    first = run([split], [0], t["q_nope"][:split], t["q_rope"][:split], [0])
    rest = CONTEXT - split
    mixed = run(
        [9, rest],
        [0, split],
        torch.cat((on[:9], t["q_nope"][split:])),
        torch.cat((orr[:9], t["q_rope"][split:])),
        [2, 0],
    )
    assert torch.equal(torch.cat((first, mixed[9:])), prefill)
