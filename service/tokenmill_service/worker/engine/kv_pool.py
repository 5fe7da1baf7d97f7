"""The KV cache pool's size: how many blocks it holds (--kv-cache-memory, or a share of the device's memory),
which layers share a block table, and the longest context it can serve (--max-model-len, or the model's own,
capped), with what one sequence's cache costs at most."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.worker.engine.block_manager import BlockManager
from tokenmill_service.worker.engine.causal_lm import CausalLM
from tokenmill_service.worker.engine.kv_cache_groups import KVCacheGroups, plan_kv_cache_groups
from tokenmill_service.worker.engine.model_runner import available_memory, default_kv_cache_memory, kv_bytes_per_block

log = structlog.get_logger(__name__)


class KVPoolTooSmall(ValueError):
    """The KV cache pool cannot hold one full context of the length asked for (--max-model-len): what was
    asked cannot be served (the worker reports it as a refusal, not a failure)."""


class KVPoolTooLarge(ValueError):
    """--kv-cache-memory asks for more memory than the machine has available (the worker reports it as a
    refusal): the pool's pages are mapped as its blocks are first used, so such a pool would run out under
    load instead of at start."""


def context_within_pool(
    asked: int, model_len: int, num_blocks: int, block_size: int, block_bytes: int, blocks_for: Callable[[int], int]
) -> int:
    """The context served: ``asked`` (--max-model-len) or the model's own, within what the pool holds,
    since a sequence can never hold more blocks than the whole pool (``blocks_for(tokens)``: the most a
    sequence of that many tokens holds; fewer than its context's where layers free blocks behind their
    window). A length the caller asked for that the pool cannot hold is refused; the model's own is
    capped, with the memory a full one would need."""
    wanted = min(asked or model_len, model_len)
    if blocks_for(wanted) <= num_blocks:
        return wanted
    needed = blocks_for(wanted) * block_bytes
    lo, hi = 0, wanted  # the longest context the pool holds: blocks_for grows with the length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if blocks_for(mid) <= num_blocks else (lo, mid - 1)
    pool_tokens = lo
    if asked:
        raise KVPoolTooSmall(
            f"--max-model-len {asked} needs a KV cache pool of {_mib(needed)} ({block_bytes // block_size} "
            f"bytes per token for this model), but the pool holds {pool_tokens} tokens "
            f"({_mib(num_blocks * block_bytes)}): raise --kv-cache-memory to at least {_mib(needed)} "
            f"or lower --max-model-len"
        )
    log.warning(
        "context_capped_to_kv_pool",
        model_context=model_len,
        context=pool_tokens,
        kv_bytes_per_token=block_bytes // block_size,
        full_context_needs=_mib(needed),
        hint="--kv-cache-memory sets the pool",
    )
    return pool_tokens


def kv_cache_groups(model: CausalLM, config: EngineConfig) -> KVCacheGroups:
    """Which of ``model``'s layers share a block table (worker/engine/kv_cache_groups.py): windowed layers' tables
    free a sequence's blocks behind the widest window. One group that frees nothing with the MTP drafter,
    whose layer reads the cache on its own terms, and where the cache holds more layers than attend."""
    windows = model.attention_windows()
    if config.speculative_method == "mtp" and any(w is not None for w in windows):
        return plan_kv_cache_groups(windows, "the MTP drafter's layer reads the cache whole: every block kept")
    groups = plan_kv_cache_groups(windows)
    if groups.num_groups > 1 and model.kv_cache_shapes(1, 1)[0][0] != len(windows):
        return plan_kv_cache_groups(windows, "the cache holds other layers than those that attend: every block kept")
    return groups


def _mib(n: int) -> str:
    return f"{-(-n // 2**20)} MiB"


def _size(n: int) -> str:
    """Bytes as KiB, MiB (both rounded up) or GiB (one decimal), whichever reads best."""
    if n < 2**20:
        return f"{-(-n // 2**10)} KiB"
    return _mib(n) if n < 2**30 else f"{n / 2**30:.1f} GiB"


def pool_blocks(model: CausalLM, config: EngineConfig, block_bytes: int) -> int:
    """The blocks of a pool sized by memory: --kv-cache-memory, else the device's default share (KVPoolTooLarge:
    more than this machine has available)."""
    budget = config.kv_cache_memory or default_kv_cache_memory(model.device)
    num_blocks = max(1, budget // block_bytes)
    available = available_memory() if model.device.type == "cpu" else None
    if config.kv_cache_memory and available is not None and num_blocks * block_bytes > available:
        raise KVPoolTooLarge(
            f"--kv-cache-memory {_size(config.kv_cache_memory)} is more than the {_size(available)} "
            "of memory this machine has available: lower --kv-cache-memory"
        )
    return num_blocks


def fit_context(
    model: CausalLM,
    config: EngineConfig,
    block_manager: BlockManager,
    groups: KVCacheGroups,
    block_bytes: int,
) -> tuple[int, str]:
    """The context served (see context_within_pool), and what one sequence's KV cache costs at most, as "value
    (reason)" (GetModelInfo's load plan)."""
    block_size, num_blocks = block_manager.block_size, block_manager.num_blocks
    grouped = groups.num_groups > 1
    window = block_manager.window
    chunk = config.max_batch_tokens

    def blocks_for(tokens: int) -> int:
        return block_manager.blocks_per_sequence(tokens, chunk)

    max_model_len = context_within_pool(
        config.max_model_len, model.max_positions, num_blocks, block_size, block_bytes, blocks_for
    )
    # Every layer's blocks of a full context, as a model without windows stores them.
    full_bytes = -(-max_model_len // block_size) * kv_bytes_per_block(model, block_size, model.kv_dtype)
    held = blocks_for(max_model_len)
    windowed = sum(w is not None for w in groups.windows)
    blocks = f"{held} blocks of {groups.group_size} layer(s)" if grouped else f"{held * block_size} tokens' blocks"
    kv_per_sequence = f"{_size(held * block_bytes)}, {blocks} at most (" + (
        (
            f"{windowed} of {groups.num_groups} layer groups attend within a {window}-token window"
            if grouped
            else f"every layer attends within a {window}-token window"
        )
        + f": a full context without windows holds {_size(full_bytes)})"
        if window is not None and held * block_bytes < full_bytes
        else f"a full context of {max_model_len} tokens)"
    )
    if window is not None:
        log.info(
            "kv_cache_windowed",
            window=window,
            kv_groups=groups.describe(),
            context=max_model_len,
            blocks_per_sequence_max=held,
            kv_bytes_per_sequence_max=held * block_bytes,
            kv_bytes_per_full_context_without_windows=full_bytes,
        )
    return max_model_len, kv_per_sequence
