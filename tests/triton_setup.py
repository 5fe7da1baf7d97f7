"""Imported by the triton tests before triton itself: without a GPU the kernels run in Triton's
interpreter, which must be switched on before any function (triton.language's own included) is
decorated with @triton.jit, that is before triton is first imported."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/triton_setup.py could switch its interpreter on")
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
