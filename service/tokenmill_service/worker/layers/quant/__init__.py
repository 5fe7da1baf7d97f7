"""Weight-only quantization methods behind the linear layers (see base.py)."""

from tokenmill_service.worker.layers.quant import blocks, dense, fp8_block, int4, int8, kquant  # noqa: F401 - registers the methods
from tokenmill_service.worker.layers.quant.base import (
    QuantMethod,
    available_quantizations,
    quant_method_class,
    register_quantization,
)

__all__ = ["QuantMethod", "available_quantizations", "quant_method_class", "register_quantization"]
