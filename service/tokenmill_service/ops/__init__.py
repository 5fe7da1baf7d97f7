"""The hot operations by backend (see interface.py); the torch reference is always registered."""

from tokenmill_service.ops import torch_ops  # noqa: F401 - registers "torch"
from tokenmill_service.ops.interface import Ops, available_backends, get_ops, register_ops

__all__ = ["Ops", "available_backends", "get_ops", "register_ops"]
