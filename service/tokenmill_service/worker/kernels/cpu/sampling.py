"""Softmax and log-softmax over rows of logits with the same bits on every CPU (sampling.cpp), for the
sampler and the reported logprobs, and the greedy choice of each row. Where the kernel cannot be built,
torch's own (whose sums and exponentials depend on the CPU's vector width)."""

from __future__ import annotations

import ctypes

import torch

from tokenmill_service.worker.kernels.cpu import build


def _lib() -> ctypes.CDLL:
    return build.load("sampling")


def _native(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() in (1, 2)
        and x.stride(-1) == 1
        and build.unavailable_reason("sampling") is None
    )


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension of float32 ``x`` [rows, n] (or [n])."""
    if not _native(x):
        return torch.log_softmax(x, dim=-1)
    rows = x if x.dim() == 2 else x[None]
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    _lib().tm_log_softmax(
        rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out if x.dim() == 2 else out[0]


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax of float32 row ``x`` [n]."""
    if not _native(x) or x.dim() != 1:
        return x.softmax(dim=-1)
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib().tm_softmax(x.data_ptr(), x.shape[0], out.data_ptr())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum of float32 ``x`` [rows, n], int64 [rows]: ``x.max(dim=-1).indices``
    (what torch gives for a row with a NaN too: such rows are left to it)."""
    if not _native(x) or x.dim() != 2 or x.shape[1] == 0:
        return x.max(dim=-1).indices
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    _lib().tm_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    if bool((out < 0).any()):
        return x.max(dim=-1).indices
    return out
