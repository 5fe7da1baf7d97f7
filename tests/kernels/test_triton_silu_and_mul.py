"""The triton SiLU-and-mul gives the torch reference's silu(gate) * up."""

from __future__ import annotations

import pytest
import torch

from tests.triton_setup import DEVICE
from tokenmill_service.worker.kernels.torch_ops import TorchOps
from tokenmill_service.worker.kernels.triton.silu_and_mul import silu_and_mul


@pytest.mark.parametrize("tokens", [1, 7, 17])
@pytest.mark.parametrize("inter", [64, 100, 1536])  # 1536: two column tiles, the second a tail
def test_silu_and_mul_matches_the_reference(tokens: int, inter: int) -> None:
    x = torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(DEVICE) * 4
    torch.testing.assert_close(silu_and_mul(x), TorchOps().silu_and_mul(x), rtol=1e-5, atol=1e-5)
