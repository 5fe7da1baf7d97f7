"""How a step runs: the KV cache pool, the flat batch inputs, one forward pass, the logits needed.

The scheduler decided what runs; this turns it into tensors (token ids, positions, cache
slots, block tables), runs the model once for the whole batch, and returns the logits of the
rows that matter: each sequence's last position when it samples a token, and every position
of a prompt whose logprobs were asked for.
"""

from __future__ import annotations

import math
import mmap
import time
from dataclasses import dataclass, field
from typing import Protocol

import structlog
import torch

from tokenmill_service.worker.engine.adapters import AdapterManager
from tokenmill_service.worker.engine.causal_lm import CausalLM
from tokenmill_service.worker.engine.executor import Executor, make_executor
from tokenmill_service.worker.engine.kv_cache_groups import KVCacheGroups, one_group
from tokenmill_service.worker.engine.scheduler import ScheduledBatch
from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata, build_attention_metadata

log = structlog.get_logger(__name__)


def _kv_cache_shapes(
    model: CausalLM, num_blocks: int, block_size: int, layers: int | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shapes = model.kv_cache_shapes(num_blocks, block_size)
    if layers is None:
        return shapes
    return (layers, *shapes[0][1:]), (layers, *shapes[1][1:])


def allocate_kv_cache(
    model: CausalLM, num_blocks: int, block_size: int, layers: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed key and value caches for every layer (``layers``: that many storage tensors instead, one
    per layer of a KV-cache group), in the model's ops backend's layout and its KV dtype."""
    k_shape, v_shape = _kv_cache_shapes(model, num_blocks, block_size, layers)
    return zeroed(k_shape, model.kv_dtype, model.device), zeroed(v_shape, model.kv_dtype, model.device)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU, memory the kernel maps zeroed a page at a time when it is first touched
    (an anonymous mapping), so a pool costs nothing until its blocks are used: ``torch.zeros`` wrote all of
    it at start, 0.25 s for the default 1 GiB pool on a quiet machine and 1.4 s after an 8B model's load."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor holds the mapping (torch.frombuffer keeps its buffer alive), which is unmapped with it.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype, layers: int | None = None) -> int:
    """What one block id of the pool costs: every layer's keys and values for its tokens (``layers``: a
    KV-cache group's layers only, as a block of one group is stored for those)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return elem * sum(math.prod(shape) for shape in _kv_cache_shapes(model, 1, block_size, layers))


def default_kv_cache_memory(device: torch.device) -> int:
    """A quarter of what is free, capped at 1 GiB on CPU (about 23k tokens of SmolLM2, plenty for 64
    streams, and quick to allocate); 90% of free GPU memory after the weights."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    available = available_memory()
    return int(min((8 << 30 if available is None else available) // 4, 1 << 30))


def available_memory() -> int | None:
    """Bytes of memory the machine can hand out now (``MemAvailable``); None where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    except (OSError, ValueError, IndexError):
        return None
    return info.get("MemAvailable")


@dataclass(slots=True)
class StepLogits:
    # [num_sampling_rows, vocab]: one row per sequence that samples a token, in batch order.
    sample_logits: torch.Tensor
    # Per sampled row: the index (into batch.seqs) of its sequence; a sequence with drafts has
    # one row per draft after its own, consecutive.
    sample_seq_indices: list[int]
    # Per batch index: logits [n, vocab] of every new position, for prompt logprobs.
    prompt_logits: dict[int, torch.Tensor]


@dataclass(slots=True)
class StepPlan:
    """What one step runs, as plain lists (what rank 0 broadcasts to the other ranks): sequence i adds
    ``query_lens[i]`` tokens at positions ``starts[i]`` onwards into the blocks ``block_tables[i]``;
    logits are computed for ``sample_rows`` and each (start, count) of ``prompt_rows``. With several
    KV-cache groups (worker/engine/kv_cache_groups.py) ``block_tables`` holds every group's tables, group by
    group: group g's table of sequence i is ``block_tables[g * len(query_lens) + i]``."""

    token_ids: list[int]
    query_lens: list[int]
    starts: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    prompt_rows: list[tuple[int, int]]
    # The LoRA adapter slot of each sequence (-1: the base), and the adapters to write into slots
    # before running, as (slot, name, path): every rank loads its own shard of them.
    adapter_slots: list[int] = field(default_factory=list)
    adapter_loads: list[tuple[int, str, str]] = field(default_factory=list)


class PlanSink(Protocol):
    def send(self, plan: StepPlan) -> None: ...


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        num_blocks: int,
        executor: str | None = None,
        kv_groups: KVCacheGroups | None = None,
    ) -> None:
        self.model = model
        # How a forward pass runs (None: as the model's load plan chose; worker/engine/executor.py).
        self.executor: Executor = make_executor(model, executor)
        # Tensor parallelism: where rank 0 sends each step's plan before running it (None: one rank).
        self.broadcast: PlanSink | None = None
        # LoRA adapters: which slot each sequence's adapter holds (None: the model has no slots).
        self.adapters: AdapterManager | None = None
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device, self.dtype = model.device, model.kv_dtype
        # Which layers share a block table, and in which storage tensor each keeps its keys and values
        # (None: one group, every layer its own tensor, as the model's cache shapes say).
        self.kv_groups = kv_groups if kv_groups is not None and kv_groups.num_groups > 1 else None
        self.num_kv_groups = 1 if self.kv_groups is None else self.kv_groups.num_groups
        self._placement = None if self.kv_groups is None else self.kv_groups.placement()
        layers = None if self.kv_groups is None else self.kv_groups.group_size
        self.k_cache, self.v_cache = allocate_kv_cache(model, num_blocks, block_size, layers)
        # The last step's plan and the hidden states of all its tokens, kept for a drafter that reads them.
        self.keep_hidden = False
        self.last_plan: StepPlan | None = None
        self.last_hidden: torch.Tensor | None = None
        # Seconds the last step's forward pass took (metadata, forward, logits), for the worker's step timing.
        self.last_execute_s = 0.0
        log.info(
            "kv_cache_allocated",
            blocks=num_blocks,
            block_size=block_size,
            mib=round(sum(c.numel() * c.element_size() for c in (self.k_cache, self.v_cache)) / 2**20, 1),
            executor=self.executor.kind,
            kv_groups=(kv_groups or one_group(0)).describe(),
        )

    def plan(self, batch: ScheduledBatch) -> tuple[StepPlan, list[int], list[int]]:
        """The step as plain lists, with the batch index of the sequence of each sampled row (a
        sequence with drafts samples several consecutive rows) and of the sequences whose prompt
        logprobs are collected (in the order of ``plan.prompt_rows``)."""
        plan = StepPlan([], [], [], [], [], [])
        sample_seq_indices: list[int] = []
        prompt_seq_indices: list[int] = []
        offset = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            drafts = len(seq.drafts)
            plan.token_ids.extend(seq.token_ids[start : start + n - drafts])
            plan.token_ids.extend(seq.drafts)
            plan.query_lens.append(n)
            plan.starts.append(start)
            if seq.collecting_prompt_logprobs and start < seq.num_prompt_tokens:
                plan.prompt_rows.append((offset, n))
                prompt_seq_indices.append(i)
            if start + n == seq.num_tokens + drafts:
                # The last token's row and each draft's: one sampled position each.
                for row in range(offset + n - 1 - drafts, offset + n):
                    plan.sample_rows.append(row)
                    sample_seq_indices.append(i)
            offset += n
        plan.block_tables = [seq.block_tables[g] for g in range(self.num_kv_groups) for seq in batch.seqs]
        if self.adapters is not None:
            plan.adapter_slots = [self.adapters.slot_of(seq.request.adapter) for seq in batch.seqs]
            plan.adapter_loads = self.adapters.take_loads()
        return plan, sample_seq_indices, prompt_seq_indices

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One forward pass: the logits of the sampling rows and of each prompt range.

        Every rank of a tensor-parallel group runs this with the same plan (rank 0 broadcasts it);
        the collectives inside the model pair up because the plan is the same everywhere."""
        device = self.device
        self._set_adapters(plan)
        positions = [s + j for s, n in zip(plan.starts, plan.query_lens) for j in range(n)]
        meta = self._metadata(plan)
        input_ids = torch.tensor(plan.token_ids, dtype=torch.long, device=device)
        hidden = self.executor.forward(input_ids, torch.tensor(positions, dtype=torch.long, device=device), meta)
        if self.keep_hidden:
            self.last_plan, self.last_hidden = plan, hidden
        if plan.sample_rows == list(range(hidden.shape[0])):  # decoding: every row samples, in order
            sampled = hidden  # a tensor made and rows copied cost 0.1-0.15 ms a step, cold after the stack
        else:
            sampled = hidden.index_select(0, torch.tensor(plan.sample_rows, dtype=torch.long, device=device))
        logits = self.executor.compute_logits(sampled)
        prompt_logits = [self.executor.compute_logits(hidden[start : start + n]) for start, n in plan.prompt_rows]
        return logits, prompt_logits

    def _metadata(self, plan: StepPlan) -> AttentionMetadata:
        """The step's attention metadata: with several KV-cache groups, each group's (its tables and
        slots), every layer pointed at its group's and its storage tensor (``AttentionMetadata.for_layer``)."""
        if self._placement is None:
            return build_attention_metadata(plan.query_lens, plan.starts, plan.block_tables, self.k_cache, self.v_cache)
        n = len(plan.query_lens)
        if len(plan.block_tables) != n * self.num_kv_groups:
            raise ValueError(
                f"a step of {n} sequences over {self.num_kv_groups} KV-cache groups needs {n * self.num_kv_groups} "
                f"block tables, got {len(plan.block_tables)}"
            )
        metas = [
            build_attention_metadata(
                plan.query_lens, plan.starts, plan.block_tables[g * n : (g + 1) * n], self.k_cache, self.v_cache
            )
            for g in range(self.num_kv_groups)
        ]
        meta = metas[0]
        meta.layer_kv = [(metas[g], index) for g, index in self._placement]
        return meta

    def _set_adapters(self, plan: StepPlan) -> None:
        """Write the step's new adapters into their slots; say which tokens use which slot."""
        slots = getattr(self.model, "lora", None)
        if slots is None:
            if any(s >= 0 for s in plan.adapter_slots):
                raise ValueError("this model has no LoRA adapter slots (--max-loras 0)")
            return
        for slot, name, path in plan.adapter_loads:
            slots.load(slot, name, path)
        token_slots = [s for s, n in zip(plan.adapter_slots, plan.query_lens) for _ in range(n)]
        slots.batch.set(token_slots, self.device)

    def run(self, batch: ScheduledBatch) -> StepLogits:
        plan, sample_seq_indices, prompt_seq_indices = self.plan(batch)
        if self.broadcast is not None:
            self.broadcast.send(plan)
        started = time.perf_counter()
        logits, prompt_logits = self.execute(plan)
        self.last_execute_s = time.perf_counter() - started
        return StepLogits(logits, sample_seq_indices, dict(zip(prompt_seq_indices, prompt_logits)))


@torch.inference_mode()
def forward_prompt(model: CausalLM, ids: list[int], block_size: int = 16, executor: str | None = None) -> torch.Tensor:
    """Hidden states [len(ids), hidden] of one prompt run as a single prefill, in a KV cache of its own
    (``executor``: how; None: as the model's load plan chose)."""
    num_blocks = -(-len(ids) // block_size)
    device = model.device
    k_cache, v_cache = allocate_kv_cache(model, num_blocks, block_size)
    meta = build_attention_metadata([len(ids)], [0], [list(range(num_blocks))], k_cache, v_cache)
    tokens = torch.tensor(ids, dtype=torch.long, device=device)
    return make_executor(model, executor).forward(tokens, torch.arange(len(ids), device=device), meta)
