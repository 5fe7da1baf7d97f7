"""Which tensor-parallel degrees split a model evenly, and the error that names them.

A degree ``d`` works when it divides the query heads, the MLP width and the vocabulary, and the
key/value heads either split over the ranks or are replicated (``d`` a multiple of them). When
weights are in blocks (GGUF's quantized tensors: 32 weights a block, 256 a k-quant super-block;
int4's groups of 32), each rank's input slice of a row-parallel layer (o_proj, down_proj) must hold
whole blocks: a multiple of the checkpoint's largest block (``ModelDims.block``), or of 32 under int4.

A mixture of experts splits each expert's width as a dense MLP's, or, with ``--expert-parallel``,
gives each rank whole experts: then ``d`` must divide the number of experts instead.
"""

from __future__ import annotations

from tokenmill_service.contract.model_dims import ModelDims

INT4_GROUP = 32  # weights per int4 quantization group


def _block(dims: ModelDims, int4_groups: bool) -> tuple[int, str]:
    """The weights per block a rank's input slice must hold whole, and what those blocks are."""
    if int4_groups and INT4_GROUP > dims.block:
        return INT4_GROUP, f"int4's groups of {INT4_GROUP} weights"
    return dims.block, f"the checkpoint's {dims.block_format} blocks of {dims.block} weights"


def _problems(dims: ModelDims, degree: int, int4_groups: bool, expert_parallel: bool = False) -> list[str]:
    problems = []
    if expert_parallel and not dims.num_experts:
        problems.append("--expert-parallel needs a mixture-of-experts model, and this one has no experts")
    elif expert_parallel and dims.num_experts % degree:
        problems.append(f"{dims.num_experts} experts (--expert-parallel gives each rank whole experts)")
    elif dims.num_experts and not expert_parallel and dims.expert_width % degree:
        problems.append(f"expert width {dims.expert_width}")
    if dims.num_heads % degree:
        problems.append(f"{dims.num_heads} query heads")
    kv = dims.num_kv_heads
    if kv % degree and degree % kv:
        problems.append(f"{kv} key/value heads (neither split nor replicated evenly)")
    if dims.intermediate_size % degree:
        problems.append(f"MLP width {dims.intermediate_size}")
    if dims.vocab_size % degree:
        problems.append(f"vocabulary {dims.vocab_size}")
    block, blocks = _block(dims, int4_groups)
    if block > 1 and not problems:
        o_in = dims.num_heads * dims.head_dim // degree
        down_in = dims.intermediate_size // degree
        if dims.num_experts:
            down_in = dims.expert_width // (1 if expert_parallel else degree)
        if o_in % block or down_in % block:
            problems.append(
                f"per-rank inputs of o_proj ({o_in}) and down_proj ({down_in}) must be multiples of {block} "
                f"for quantized weights (a rank cannot split one of {blocks})"
            )
    return problems


def working_degrees(dims: ModelDims, int4_groups: bool = False, expert_parallel: bool = False) -> list[int]:
    return [d for d in range(1, dims.num_heads + 1) if not _problems(dims, d, int4_groups, expert_parallel)]


def check_degree(dims: ModelDims, degree: int, int4_groups: bool = False, expert_parallel: bool = False) -> None:
    """Raise ValueError naming the model's counts and the degrees that work unless ``degree`` does
    (``int4_groups``: the weights are quantized to int4 here, in groups of 32, whatever the checkpoint's blocks)."""
    problems = _problems(dims, degree, int4_groups, expert_parallel)
    if not problems:
        return
    works = ", ".join(map(str, working_degrees(dims, int4_groups, expert_parallel))) or "none"
    experts = f", {dims.num_experts} experts {dims.expert_width} wide" if dims.num_experts else ""
    raise ValueError(
        f"--tensor-parallel {degree} does not split this model evenly: {'; '.join(problems)} "
        f"(the model has {dims.num_heads} query heads, {dims.num_kv_heads} key/value heads, "
        f"MLP width {dims.intermediate_size}, vocabulary {dims.vocab_size}{experts}); degrees that work: {works}"
    )
