"""The online softmax both paged attention kernels (attention.py, latent_attention.py) keep per query row.

A row's state over the keys seen so far is (max m, sum l, weighted values acc): ``empty_state`` has seen
none, ``online_softmax_step`` folds in a tile of keys, ``combine`` folds one split's state into the
running one, ``finish`` divides.
Each is inlined into its caller's kernel, so sharing them changes no arithmetic and no order.
"""

from __future__ import annotations

import triton
import triton.language as tl

# @triton.jit is untyped, and the kernels' parameters stay unannotated (triton reads a parameter's
# annotation to choose how it specialises the kernel), hence their narrow type-ignores.


@triton.jit  # type: ignore[untyped-decorator]
def empty_state(ROWS: tl.constexpr, D: tl.constexpr):  # type: ignore[no-untyped-def]
    """The state of ROWS rows of D values that have seen no key."""
    return tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, D], tl.float32)


@triton.jit
def online_softmax_step(m, l, acc, scores, values):  # type: ignore[no-untyped-def]
    """One tile of keys folded into a running softmax (max m, sum l, weighted values acc); scores of
    invisible keys are -inf."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def combine(m_run, l_run, acc_run, m, l, acc):  # type: ignore[no-untyped-def]
    """Fold one split's state into the running one (exact no-op for an empty split)."""
    m_new = tl.maximum(m_run, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m_run - m_safe)
    b = tl.exp(m - m_safe)
    return m_new, l_run * a + l * b, acc_run * a[:, None] + acc * b[:, None]


@triton.jit
def finish(l, acc):  # type: ignore[no-untyped-def]
    """The softmax-weighted values acc / l: 0 in a row that saw no key (one that is not stored)."""
    return acc / tl.where(l == 0.0, 1.0, l)[:, None]
