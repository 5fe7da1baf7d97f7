"""The triton RMSNorm (fused residual add) gives the torch reference's output and residual stream."""

from __future__ import annotations

import pytest
import torch

from tests.triton_setup import DEVICE
from tokenmill_service.worker.kernels.torch_ops import TorchOps
from tokenmill_service.worker.kernels.triton.rms_norm import rms_norm


@pytest.mark.parametrize("tokens", [1, 5, 17])
@pytest.mark.parametrize("dim", [64, 96, 576])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_the_reference(tokens: int, dim: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(tokens * dim)
    x = torch.randn(tokens, dim, generator=gen).to(DEVICE)
    residual = torch.randn(tokens, dim, generator=gen).to(DEVICE) if with_residual else None
    weight = torch.randn(dim, generator=gen).to(DEVICE)
    want_out, want_h = TorchOps().rms_norm(x, weight, 1e-5, residual, torch.float32)
    out, h = rms_norm(x, weight, 1e-5, residual, torch.float32)
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)  # one float32 add: exact
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)


def test_rms_norm_reads_a_strided_input() -> None:
    x = torch.randn(6, 128, device=DEVICE)[:, :64]
    weight = torch.randn(64, device=DEVICE)
    want, _ = TorchOps().rms_norm(x, weight, 1e-6, None, torch.float32)
    out, _ = rms_norm(x, weight, 1e-6, None, torch.float32)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
