"""The native CPU ops (native/*.cpp, behind worker/kernels/cpu/ops.py) against the plain-torch reference
(worker/kernels/torch_ops.py), and their batch invariance: attention on random paged caches (head_dim 64, 128 and
256), RMSNorm, rotary, SiLU-and-mul and GeGLU on random rows."""

from __future__ import annotations

import pytest
import torch

from tokenmill_service.worker.device import DeviceFacts, probe_device
from tokenmill_service.worker.kernels.attention_metadata import build_attention_metadata
from tokenmill_service.worker.kernels.attention_params import AttentionParams
from tokenmill_service.worker.kernels.cpu import elementwise
from tokenmill_service.worker.kernels.cpu.ops import NativeCpuOps
from tokenmill_service.worker.kernels.torch_ops import TorchOps
from tokenmill_service.worker.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    probe_device("cpu").native("paged_attention", "elementwise") is not None,
    reason=f"native kernels unavailable: {probe_device('cpu').native('paged_attention', 'elementwise')}",
)
BLOCK = 16


def _setup(
    ops: TorchOps, kv_heads: int, head_dim: int, seed: int = 0, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's caches (as the runner allocates them), every slot written through ``ops.store_kv``
    (each implementation keeps its own layout) with the same random keys and values."""
    gen = torch.Generator().manual_seed(seed)
    k_shape, v_shape = ops.kv_cache_layout.shapes(1, 96 * BLOCK // block, block, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(k_shape), torch.zeros(v_shape)
    slots = 96 * BLOCK
    k = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(slots, kv_heads, head_dim, generator=gen)
    ops.store_kv(k, v, k_cache[0], v_cache[0], torch.arange(slots))
    return k_cache, v_cache


def _tables(lengths: list[int], block: int = BLOCK) -> list[list[int]]:
    """Scattered, non-overlapping block tables (reversed order), one per sequence."""
    tables, next_block = [], 96 * BLOCK // block - 1
    for n in lengths:
        count = -(-n // block)
        tables.append(list(range(next_block, next_block - count, -1)))
        next_block -= count
    return tables


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block"),
    [(9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 64, 16), (9, 3, 64, 8), (9, 3, 64, 32), (4, 2, 256, 16)],
)
def test_native_attention_matches_the_torch_reference_on_a_mixed_step(
    heads: int, kv_heads: int, head_dim: int, block: int
) -> None:
    # Two decodes (long and short context), a prefill chunk with cached context, a fresh prefill.
    query_lens, starts = [1, 1, 37, 300], [700, 3, 40, 0]
    lengths = [s + n for s, n in zip(starts, query_lens)]
    tables = _tables(lengths, block)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
    params = AttentionParams(head_dim**-0.5)
    outs = []
    for ops in (NativeCpuOps(), TorchOps()):
        k_cache, v_cache = _setup(ops, kv_heads, head_dim, block=block)
        meta = build_attention_metadata(query_lens, starts, tables, k_cache, v_cache)
        outs.append(ops.attention(q, k_cache[0], v_cache[0], meta, params))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (8, 4, 256)])
def test_a_querys_result_is_the_same_alone_in_a_crowd_and_in_a_prefill_chunk(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """A prefill chunk's rows are scored in tiles (up to 48 rows) against 64 keys at a time; the
    positions below sit on and beside both boundaries, and the cached-context chunk starts inside
    a tile of the whole prefill."""
    ops, params = NativeCpuOps(), AttentionParams(head_dim**-0.5)
    k_cache, v_cache = _setup(ops, kv_heads, head_dim)
    tables = _tables([200, 50, 130])
    q = torch.randn(200, heads, head_dim, generator=torch.Generator().manual_seed(2))

    def run(query_lens: list[int], starts: list[int], rows: list[torch.Tensor], seqs: list[int]) -> torch.Tensor:
        meta = build_attention_metadata(query_lens, starts, [tables[s] for s in seqs], k_cache, v_cache)
        return ops.attention(torch.cat(rows), k_cache[0], v_cache[0], meta, params)

    prefill = run([200], [0], [q], [0])  # sequence 0's 200 tokens in one chunk
    other = torch.randn(60, heads, head_dim)
    for position in (0, 11, 12, 15, 16, 47, 63, 64, 65, 130, 199):
        alone = run([1], [position], [q[position : position + 1]], [0])
        crowd = run([1, 1, 58], [position, 49, 72], [q[position : position + 1], other[:1], other[2:]], [0, 1, 2])
        assert torch.equal(alone[0], prefill[position]), position
        assert torch.equal(crowd[0], prefill[position]), position
    # A chunk of the prefill with cached context gives the same rows as the whole prefill.
    chunk = run([80], [100], [q[100:180]], [0])
    assert torch.equal(chunk, prefill[100:180])


def test_the_backend_says_where_native_attention_cannot_serve() -> None:
    cpu = probe_device("cpu")
    assert NativeCpuOps.unavailable_reason(cpu, torch.float32, 64) is None
    assert NativeCpuOps.unavailable_reason(cpu, torch.float32, 256) is None  # Gemma 2 2B/9B's, Gemma 3 1B-12B's
    assert "float32 activations" in str(NativeCpuOps.unavailable_reason(cpu, torch.bfloat16, 64))
    assert "head_dim 64, 128 or 256" in str(NativeCpuOps.unavailable_reason(cpu, torch.float32, 80))
    assert "on the CPU" in str(NativeCpuOps.unavailable_reason(DeviceFacts("cuda:0"), torch.float32, 64))


def _rows(t: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(t, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("with_residual", [True, False])
def test_native_rms_norm_matches_the_reference_row_by_row(with_residual: bool) -> None:
    x, residual, weight = _rows(37, 576, 1), _rows(37, 576, 2), _rows(1, 576, 3)[0]
    res = residual if with_residual else None
    normed, h = NativeCpuOps().rms_norm(x, weight, 1e-5, res, torch.float32)
    want_normed, want_h = TorchOps().rms_norm(x, weight, 1e-5, res, torch.float32)
    assert torch.equal(h, want_h)  # the residual add is one rounding either way
    torch.testing.assert_close(normed, want_normed, atol=1e-5, rtol=1e-5)
    alone, _ = NativeCpuOps().rms_norm(x[20:21], weight, 1e-5, None if res is None else res[20:21], torch.float32)
    assert torch.equal(alone[0], normed[20])


def test_native_rotary_matches_the_reference_on_strided_views_in_place() -> None:
    rotary = RotaryEmbedding(64, 4096, 10000.0, None, TorchOps())
    qkv = _rows(9, 9 * 64 + 2 * 3 * 64, 4)  # q, k and v side by side, as the q/k/v projection returns them
    positions = torch.tensor([0, 1, 2, 700, 701, 5, 4095, 17, 18])

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
        return q.view(9, 9, 64), k.view(9, 3, 64)

    want_q, want_k = TorchOps().rotary(*split(qkv), positions, rotary.cos, rotary.sin)
    packed = qkv.clone()
    got_q, got_k = NativeCpuOps().rotary(*split(packed), positions, rotary.cos, rotary.sin)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(packed[:, -3 * 64 :], qkv[:, -3 * 64 :])  # v untouched


def test_native_rotary_turns_the_first_dims_of_each_head_and_leaves_the_rest() -> None:
    """Partial rotary (Phi-4-mini's): views of each head's first 32 of 64 dims (heads 64 apart), tables of 16."""
    rotary = RotaryEmbedding(32, 4096, 10000.0, None, TorchOps())
    qkv = _rows(9, 9 * 64 + 2 * 3 * 64, 6)
    positions = torch.tensor([0, 1, 2, 700, 701, 5, 4095, 17, 18])

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
        return q.view(9, 9, 64)[..., :32], k.view(9, 3, 64)[..., :32]

    want_q, want_k = TorchOps().rotary(*split(qkv), positions, rotary.cos, rotary.sin)
    packed = qkv.clone()
    got_q, got_k = NativeCpuOps().rotary(*split(packed), positions, rotary.cos, rotary.sin)
    assert got_q.data_ptr() == packed.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)
    rest = packed[:, : 12 * 64].view(9, 12, 64)[..., 32:]
    assert torch.equal(rest, qkv[:, : 12 * 64].view(9, 12, 64)[..., 32:])  # the heads' other dims untouched
    assert torch.equal(packed[:, -3 * 64 :], qkv[:, -3 * 64 :])  # v untouched


def test_native_silu_and_mul_matches_the_reference_row_by_row() -> None:
    x = _rows(21, 2 * 1536, 5) * 4
    got = NativeCpuOps().silu_and_mul(x)
    torch.testing.assert_close(got, TorchOps().silu_and_mul(x), atol=1e-6, rtol=1e-5)
    assert torch.equal(NativeCpuOps().silu_and_mul(x[7:8])[0], got[7])


def test_native_gelu_tanh_and_mul_matches_torch_within_float32_rounding() -> None:
    """Gemma's GeGLU, gelu(g, tanh approximation) * up, g * sigmoid(z) * up with z = 2u: within 8 float32
    epsilons of |g * up| of torch's F.gelu(approximate="tanh") * up (whose 0.5 * g * (1 + tanh(u)) cancels to
    within an epsilon of 0 where g is well below 0), and within (8 + 3 |z|) epsilons of the float64 value
    (z's own rounding, magnified by the exponential) or 1e-35 (below, the exponential's clamp at e^-87);
    gates from -12 to 12, a masked tail, a row the same alone."""
    x = _rows(21, 2 * 200, 8) * 4  # 200: a masked tail of 8 after twelve full vectors
    x[0, :200] = torch.linspace(-12, 12, 200)
    got = NativeCpuOps().gelu_tanh_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert ((got - want).abs() <= 8 * 2**-24 * (gate * up).abs()).all()
    g = gate.double()
    z = 2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)
    exact = g * torch.sigmoid(z) * up.double()
    assert ((got.double() - exact).abs() <= (8 + 3 * z.abs()) * 2**-24 * exact.abs() + 1e-35).all()
    assert torch.equal(NativeCpuOps().gelu_tanh_and_mul(x[7:8])[0], got[7])
    assert torch.equal(TorchOps().gelu_tanh_and_mul(x), want)  # the reference is torch's


def test_native_clamped_swiglu_matches_the_reference_row_by_row() -> None:
    """gpt-oss's activation: values past the limit on both sides (clamped), NaN kept, a row the same alone."""
    x = _rows(21, 2 * 200, 7) * 6  # 200: a masked tail of 8 after twelve full vectors
    x[3, 5], x[4, 205] = float("nan"), float("nan")
    got = NativeCpuOps().clamped_swiglu_and_mul(x, 1.702, 7.0)
    want = TorchOps().clamped_swiglu_and_mul(x, 1.702, 7.0)
    assert (x[:, :200] > 7).any() and (x[:, 200:] < -7).any()
    assert got[3, 5].isnan() and got[4, 5].isnan()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, equal_nan=True)
    assert torch.equal(NativeCpuOps().clamped_swiglu_and_mul(x[7:8], 1.702, 7.0)[0], got[7])


def test_bfloat16_rows_go_to_the_reference() -> None:
    x = _rows(3, 64, 6).to(torch.bfloat16)
    assert not elementwise.fits(x)
    assert torch.equal(NativeCpuOps().silu_and_mul(x), TorchOps().silu_and_mul(x))
