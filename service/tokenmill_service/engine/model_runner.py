"""How a step runs: the KV cache pool, the flat batch inputs, one forward pass, the logits needed.

The scheduler decided what runs; this turns it into tensors (token ids, positions, cache
slots, block tables), runs the model once for the whole batch, and returns the logits of the
rows that matter: each sequence's last position when it samples a token, and every position
of a prompt whose logprobs were asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from tokenmill_service.engine.causal_lm import CausalLM
from tokenmill_service.engine.scheduler import ScheduledBatch
from tokenmill_service.ops.attention_metadata import AttentionMetadata, build_attention_metadata

log = structlog.get_logger(__name__)


def kv_cache_shape(model: CausalLM, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[layers, blocks, block_size, kv heads of this rank, head_dim]."""
    return model.kv_cache_shape(num_blocks, block_size)


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * elem * int(torch.tensor(kv_cache_shape(model, 1, block_size)).prod())


def default_kv_cache_memory(device: torch.device) -> int:
    """A quarter of what is free, capped at 1 GiB on CPU (about 23k tokens of SmolLM2, plenty for 64
    streams, and quick to allocate); 90% of free GPU memory after the weights."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available = info.get("MemAvailable", 8 << 30)
    except OSError:
        available = 8 << 30
    return int(min(available // 4, 1 << 30))


@dataclass(slots=True)
class StepLogits:
    # [num_sampling_rows, vocab]: one row per sequence that samples a token, in batch order.
    sample_logits: torch.Tensor
    # Indices (into batch.seqs) of the sequences that sample a token this step.
    sample_seq_indices: list[int]
    # Per batch index: logits [n, vocab] of every new position, for prompt logprobs.
    prompt_logits: dict[int, torch.Tensor]


class ModelRunner:
    def __init__(self, model: CausalLM, block_size: int, num_blocks: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device, self.dtype = model.device, model.act_dtype
        shape = kv_cache_shape(model, num_blocks, block_size)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        log.info(
            "kv_cache_allocated",
            blocks=num_blocks,
            block_size=block_size,
            mib=round(2 * self.k_cache.numel() * self.k_cache.element_size() / 2**20, 1),
        )

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            starts.append(start)
        meta = build_attention_metadata(
            list(batch.num_new_tokens), starts, [s.block_table for s in batch.seqs], self.k_cache, self.v_cache
        )
        device = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            meta,
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepLogits:
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)

        sample_rows: list[int] = []
        sample_seq_indices: list[int] = []
        prompt_rows: dict[int, tuple[int, int]] = {}
        offset = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.collecting_prompt_logprobs and seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_rows[i] = (offset, n)
            if seq.num_computed_tokens + n == seq.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_seq_indices.append(i)
            offset += n

        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        prompt_logits = {
            i: self.model.compute_logits(hidden[start : start + n]) for i, (start, n) in prompt_rows.items()
        }
        return StepLogits(logits, sample_seq_indices, prompt_logits)


@torch.inference_mode()
def forward_prompt(model: CausalLM, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Hidden states [len(ids), hidden] of one prompt run as a single prefill, in a KV cache of its own."""
    num_blocks = -(-len(ids) // block_size)
    device = model.device
    shape = kv_cache_shape(model, num_blocks, block_size)
    k_cache = torch.zeros(shape, dtype=model.act_dtype, device=device)
    v_cache = torch.zeros(shape, dtype=model.act_dtype, device=device)
    meta = build_attention_metadata([len(ids)], [0], [list(range(num_blocks))], k_cache, v_cache)
    tokens = torch.tensor(ids, dtype=torch.long, device=device)
    return model(tokens, torch.arange(len(ids), device=device), meta)
