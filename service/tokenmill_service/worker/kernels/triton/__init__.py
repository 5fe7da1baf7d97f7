"""The triton backend: the hot operations as Triton kernels, one file each, tested against kernels/torch_ops.py.

Selected with ``--backend triton``. On a GPU the kernels are compiled; with ``TRITON_INTERPRET=1``
they run in Triton's interpreter on the CPU (slow; for tests), where the model runs float32 and ``tl.dot``
is interpreter.py's: each element of a product the same wherever it lies in the tile, as on a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
import torch

from tokenmill_service.worker.device import interpreter_enabled
from tokenmill_service.worker.kernels import latent_attention as reference_latent
from tokenmill_service.worker.kernels.interface import LatentCacheLayout, LoRADelta, Ops, register_ops
from tokenmill_service.worker.kernels.triton import interpreter
from tokenmill_service.worker.kernels.triton import lora as triton_lora
from tokenmill_service.worker.kernels.triton.attention import paged_attention
from tokenmill_service.worker.kernels.triton.latent_attention import latent_attention
from tokenmill_service.worker.kernels.triton.rms_norm import rms_norm
from tokenmill_service.worker.kernels.triton.rotary import rotary
from tokenmill_service.worker.kernels.triton.silu_and_mul import silu_and_mul
from tokenmill_service.worker.kernels.triton.store_kv import store_kv

if TYPE_CHECKING:
    from tokenmill_service.worker.device import DeviceFacts

log = structlog.get_logger(__name__)

if interpreter_enabled() and not interpreter.install():
    log.warning(
        "triton_interpreter_dot",
        message="this Triton's interpreter has no create_dot to replace: its tl.dot is the host BLAS's, whose rows "
        "may depend on their place in a tile (OpenBLAS's AVX2 kernels), so results may vary with the batch",
    )


@register_ops("triton")
class TritonOps(Ops):
    # The reference's latent cache: the plain-torch store writes it, the triton kernel reads it.
    latent_cache_layout = LatentCacheLayout()

    @classmethod
    def lora_delta(cls) -> LoRADelta:
        return triton_lora.lora_delta

    @classmethod
    def unavailable_reason(cls, facts: DeviceFacts, act_dtype: torch.dtype, head_dim: int) -> str | None:
        if facts.triton_missing is not None:
            return facts.triton_missing
        if facts.triton_interpreter and act_dtype != torch.float32:
            return "Triton's interpreter runs float32 only"
        return None

    def __init__(self) -> None:
        if interpreter_enabled():
            log.warning(
                "triton_interpreter",
                message="TRITON_INTERPRET=1: the triton kernels run in Triton's CPU interpreter, slowly, in float32; "
                "for testing only",
            )

    # Each op is its kernel file's function, which takes the op's arguments (``Ops``' signatures).
    rms_norm = staticmethod(rms_norm)
    rotary = staticmethod(rotary)
    silu_and_mul = staticmethod(silu_and_mul)
    store_kv = staticmethod(store_kv)
    attention = staticmethod(paged_attention)
    # The reference's store: the triton kernel reads the reference's latent cache layout.
    store_latent = staticmethod(reference_latent.store_latent)
    latent_attention = staticmethod(latent_attention)
