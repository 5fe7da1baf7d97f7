"""Which tensor-parallel degrees split a model evenly, and the error that names them.

A degree ``d`` works when it divides the query heads, the MLP width and the vocabulary, and the
key/value heads either split over the ranks or are replicated (``d`` a multiple of them). When
weights are in 32-weight blocks (int4 groups, GGUF's quantized tensors), each rank's input slice
of a row-parallel layer (o_proj, down_proj) must hold whole blocks: a multiple of 32.
"""

from __future__ import annotations

from tokenmill_service.models.dims import ModelDims

BLOCK = 32  # weights per quantization group / GGUF block


def _problems(dims: ModelDims, degree: int, blocked: bool) -> list[str]:
    problems = []
    if dims.num_heads % degree:
        problems.append(f"{dims.num_heads} query heads")
    kv = dims.num_kv_heads
    if kv % degree and degree % kv:
        problems.append(f"{kv} key/value heads (neither split nor replicated evenly)")
    if dims.intermediate_size % degree:
        problems.append(f"MLP width {dims.intermediate_size}")
    if dims.vocab_size % degree:
        problems.append(f"vocabulary {dims.vocab_size}")
    if blocked and not problems:
        o_in = dims.num_heads * dims.head_dim // degree
        down_in = dims.intermediate_size // degree
        if o_in % BLOCK or down_in % BLOCK:
            problems.append(
                f"per-rank inputs of o_proj ({o_in}) and down_proj ({down_in}) must be multiples of {BLOCK} "
                "for quantized weights"
            )
    return problems


def working_degrees(dims: ModelDims, blocked: bool) -> list[int]:
    return [d for d in range(1, dims.num_heads + 1) if not _problems(dims, d, blocked)]


def check_degree(dims: ModelDims, degree: int, blocked: bool) -> None:
    """Raise ValueError naming the model's counts and the degrees that work unless ``degree`` does."""
    problems = _problems(dims, degree, blocked)
    if not problems:
        return
    works = ", ".join(map(str, working_degrees(dims, blocked)))
    raise ValueError(
        f"--tensor-parallel {degree} does not split this model evenly: {'; '.join(problems)} "
        f"(the model has {dims.num_heads} query heads, {dims.num_kv_heads} key/value heads, "
        f"MLP width {dims.intermediate_size}, vocabulary {dims.vocab_size}); degrees that work: {works}"
    )
