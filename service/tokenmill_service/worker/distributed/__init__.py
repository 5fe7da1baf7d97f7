"""Tensor-parallel state and collectives (gloo on CPU, NCCL on GPU)."""
