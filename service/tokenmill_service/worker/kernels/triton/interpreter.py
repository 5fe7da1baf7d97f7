"""Triton's CPU interpreter (``TRITON_INTERPRET=1``, for tests) with a ``tl.dot`` that computes every
element of its product the same way wherever it lies in the tile, as a GPU's does.

The kernels' batch invariance (a query's or a token's result bitwise the same alone, in a crowd, in a
prefill or a decode) rests on tile shapes the batch does not choose and on ``tl.dot`` computing each
element from its row of A and its column of B alone. A GPU's dot does: Triton lowers a float32
``input_precision="ieee"`` dot to FMAs, one chain over K per element in the same order for all, and a
tensor-core MMA treats every element of its tile alike. The interpreter runs ``tl.dot`` as NumPy's
``matmul``, that is the host's BLAS, which promises no such thing: OpenBLAS's AVX2 (Haswell) SGEMM, what
NumPy runs on an AVX2-only CPU, gives a row of a [16, K] @ [K, N] product other bits depending on the
row's place in the tile (its kernel takes the rows in blocks, a tail by other code), where its AVX-512
kernels, for these shapes, happen not to. A query whose row in its tile differs between a prefill chunk
and a decode step then gets other bits.

So under the interpreter ``tl.dot`` on floating-point operands is replaced by an explicit product:
every product a[i, k] * b[k, j] in the accumulator's dtype, summed over k in one fixed pairwise tree,
then added to the accumulator; elementwise NumPy operations only, each exactly rounded, so an element's
bits depend on its row and column alone, on any CPU (AVX2, AVX-512, ARM) and whatever the tile holds
elsewhere. Integer dots (exact in any order), 8-bit and bfloat16 operands keep Triton's own path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


def elementwise_dot(a: npt.NDArray[Any], b: npt.NDArray[Any], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """``a [..., M, K] @ b [..., K, N]`` in ``dtype``, each element its K products summed pairwise in
    a fixed order: bitwise a function of its row of ``a`` and its column of ``b`` alone."""
    prods = a.astype(dtype, copy=False)[..., :, :, None] * b.astype(dtype, copy=False)[..., None, :, :]
    k = prods.shape[-2]
    if k == 0:
        return np.zeros(prods.shape[:-2] + prods.shape[-1:], dtype=dtype)
    while k > 1:  # the first half plus the second, an odd last row carried over as it is
        half = k // 2
        summed = prods[..., :half, :] + prods[..., half : 2 * half, :]
        prods = np.concatenate((summed, prods[..., 2 * half :, :]), axis=-2) if k % 2 else summed
        k = prods.shape[-2]
    out: npt.NDArray[Any] = prods[..., 0, :]
    return out


def _deterministic_create_dot(original: Any) -> Any:
    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if not all(x.data.dtype.kind == "f" for x in (a, b, d)):  # integers, fp8 and bfloat16 (stored as uint)
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = elementwise_dot(a.data, b.data, d.data.dtype) + d.data
        return type(d)(out, d.dtype.scalar)

    create_dot.deterministic = True  # type: ignore[attr-defined]
    return create_dot


def install() -> bool:
    """Give the interpreter the element-by-element ``tl.dot`` (once; harmless again). False when this
    Triton's interpreter is not laid out as expected (its dot then stays the host BLAS's)."""
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:
        return False
    original = getattr(InterpreterBuilder, "create_dot", None)
    if original is None:
        return False
    if not getattr(original, "deterministic", False):
        InterpreterBuilder.create_dot = _deterministic_create_dot(original)
    return True


def installed() -> bool:
    """Whether the interpreter's ``tl.dot`` is the element-by-element one."""
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:
        return False
    return bool(getattr(getattr(InterpreterBuilder, "create_dot", None), "deterministic", False))
