"""Compute backends: the torch reference ops and (later) triton kernels with the same signatures."""
