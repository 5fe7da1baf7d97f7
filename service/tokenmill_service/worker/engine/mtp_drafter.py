"""Draft tokens from the model's multi-token-prediction layers (``--speculative-method mtp``;
worker/models/deepseek_mtp.py says what a layer computes).

After each step, for every sequence that ran, the MTP block is run over the positions the main model
computed and kept this step, each with its token and the main model's hidden state of the position
before (the last one kept from the step before, zeros at the start of a context). That writes the
block's latents for those positions into its layer of the paged cache, where they stay as the main
model's do (the same blocks, the same prefix sharing), so no position is ever run twice for the
drafter's sake. A sequence that sampled a token gets drafts: the block at the new token's position
gives the first, and each guess is fed back with the block's own output for the next, up to
``--speculative-tokens`` (the first MTP layer chained, as vLLM does with one; DeepSeek-V3 and R1 have
one). Those chained positions are scratch: the step that computes them for real writes them again.

Where a context's start came from the prefix cache, the hidden state before its first computed position
is not known and zeros stand in: that position's draft entry is approximate. Drafts change only how
many tokens a step keeps, never which (worker/engine/speculation.py says why), so this costs speed at most.

Under tensor parallelism each rank holds its shard of the MTP layer, as of the decoder. Rank 0 decides
every pass (``MTPDrafter``, which owns the sequences) as a ``DraftPass`` of plain lists and broadcasts
it before running it, as it does each step's plan (worker/distributed/step_broadcast.py); every rank runs it
with a ``DraftPassRunner`` of its own, so the collectives inside the layer pair up. A pass names each
token's previous hidden state by its row in the step's hidden states, which every rank computed alike,
and carries only those kept from the step before (one per sequence), which no other rank keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, cast

import torch

from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.worker.engine.block_manager import BlockManager
from tokenmill_service.worker.engine.causal_lm import CausalLM
from tokenmill_service.worker.engine.model_runner import ModelRunner
from tokenmill_service.worker.engine.scheduler import ScheduledBatch
from tokenmill_service.worker.engine.sequence import Sequence, SequenceStatus
from tokenmill_service.worker.kernels.attention_metadata import AttentionMetadata, build_attention_metadata


@dataclass(slots=True)
class DraftPass:
    """One run of the MTP layer, as plain lists (what rank 0 broadcasts to the other ranks): token
    ``token_ids[j]`` at ``positions[j]``, sequence i's ``query_lens[i]`` of them from ``starts[i]`` on into
    the blocks ``block_tables[i]``. Token j's previous hidden state is row ``previous[j]`` of the step's
    hidden states followed by ``carried`` (the first pass after a step) or, ``chained``, of the rows the
    pass before kept. The pass keeps its output rows ``kept_rows`` and computes their logits."""

    token_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    starts: list[int]
    block_tables: list[list[int]]
    previous: list[int]
    kept_rows: list[int]
    chained: bool = False
    # [sequences, hidden]: the hidden states kept from the step before (rank 0's; on the CPU when sent).
    carried: torch.Tensor | None = None


class MTPLayer(Protocol):
    """What the drafter needs of a model's multi-token-prediction layer (worker/models/deepseek_mtp.py has one):
    the engine is written against protocols and never imports a model module."""

    def __call__(
        self, embeds: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class DraftSink(Protocol):
    def send(self, message: DraftPass) -> None: ...


def first_mtp_layer(model: CausalLM) -> MTPLayer:
    """The model's first multi-token-prediction layer, the one the drafts chain (a clear error without)."""
    layers = model.mtp
    if not len(layers):
        raise ValueError(
            "speculative_method mtp needs the model's multi-token-prediction layers loaded "
            "(load it with speculative_method='mtp'; only DeepSeek-V3 checkpoints have them)"
        )
    layer = cast(MTPLayer, layers[0])
    return layer


class DraftPassRunner:
    """Runs draft passes on one rank, with the main model's hidden states of the step just run (the
    runner keeps them) and the rows the last pass kept; every rank of a group runs the same passes."""

    def __init__(self, model: CausalLM, runner: ModelRunner) -> None:
        self.model = model
        self.layer = first_mtp_layer(model)
        self.runner = runner
        runner.keep_hidden = True
        self.kept: torch.Tensor | None = None

    @torch.inference_mode()
    def execute(self, draft: DraftPass) -> torch.Tensor | None:
        """The logits of the rows the pass keeps (None where it keeps none); writes the block's cache
        entries for its positions."""
        runner = self.runner
        device = runner.device
        index = torch.tensor(draft.previous, dtype=torch.long, device=device)
        if draft.chained:
            assert self.kept is not None, "a chained draft pass without one before it"
            pool = self.kept
        else:
            hidden = runner.last_hidden
            assert hidden is not None, "a draft pass without a step before it"
            carried = draft.carried
            pool = hidden if carried is None else torch.cat((hidden, carried.to(device, hidden.dtype)))
        previous = pool.index_select(0, index)
        meta = build_attention_metadata(
            draft.query_lens, draft.starts, draft.block_tables, runner.k_cache, runner.v_cache
        )
        tokens = torch.tensor(draft.token_ids, dtype=torch.long, device=device)
        embeds = self.model.model.embed(tokens)  # type: ignore[attr-defined]
        where = torch.tensor(draft.positions, dtype=torch.long, device=device)
        out: torch.Tensor = self.layer(embeds, where, previous, meta)
        if not draft.kept_rows:
            self.kept = None
            return None
        self.kept = out.index_select(0, torch.tensor(draft.kept_rows, dtype=torch.long, device=device))
        logits: torch.Tensor = self.layer.compute_logits(self.kept)
        return logits


class MTPDrafter:
    """Rank 0's side: decides each pass from the sequences, sends it where the other ranks listen
    (``broadcast``, set under tensor parallelism) and runs it."""

    def __init__(self, model: CausalLM, config: EngineConfig, block_manager: BlockManager, runner: ModelRunner) -> None:
        self.passes = DraftPassRunner(model, runner)
        self.config = config
        self.block_manager = block_manager
        self.broadcast: DraftSink | None = None

    def _room(self, seq: Sequence, running: int, max_model_len: int) -> int:
        """How many drafts to chain for a sequence that just sampled (what the scheduler could use)."""
        if running > self.config.speculative_max_batch:
            return 0
        room = min(self.config.speculative_tokens, max_model_len - seq.num_tokens)
        max_new = seq.request.stopping.max_new_tokens
        if max_new:
            room = min(room, max_new - seq.num_completion_tokens - 1)
        if room <= 0:
            return 0
        # The chained positions write the block's cache: blocks for them, leaving one per running sequence.
        last = seq.num_tokens - 1
        bm = self.block_manager
        if bm.blocks_needed(seq, last + room) <= bm.num_free_blocks - running and bm.allocate(seq, last + room):
            return room
        return max(0, min(room, len(seq.block_table) * bm.block_size - last))

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, running: int, max_model_len: int) -> None:
        """Set ``mtp_drafts`` of every sequence of the step just run (``batch``; the runner kept its plan
        and the main model's hidden states), writing the block's cache entries for the positions it computed."""
        runner = self.passes.runner
        plan, hidden = runner.last_plan, runner.last_hidden
        assert plan is not None and hidden is not None, "MTP drafts without a step run before them"
        ids: list[int] = []
        positions: list[int] = []
        # Per token: its previous hidden state's row in the step's hidden states followed by ``carried``.
        rows: list[int] = []
        carried: list[torch.Tensor] = []  # hidden states kept from the step before, one per sequence
        query_lens, starts, tables = [], [], []
        chains: list[tuple[Sequence, int, int]] = []  # (sequence, drafts wanted, its last row in the pass)
        zero = torch.zeros(hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
        offset = 0
        for seq, start, n in zip(batch.seqs, plan.starts, plan.query_lens):
            base, offset = offset, offset + n
            seq.mtp_drafts = []
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished (its blocks are gone) or preempted
            kept = seq.num_computed_tokens - start
            if kept <= 0:
                continue
            wanted = self._room(seq, running, max_model_len) if seq.num_uncomputed_tokens == 1 else 0
            count = kept + (1 if wanted else 0)
            for p in range(start, start + count):
                ids.append(seq.token_ids[p])
                positions.append(p)
                if p == start:
                    rows.append(hidden.shape[0] + len(carried))
                    carried.append(seq.mtp_hidden if seq.mtp_hidden is not None and start > 0 else zero)
                else:
                    rows.append(base + p - 1 - start)
            seq.mtp_hidden = hidden[base + kept - 1].clone()
            query_lens.append(count)
            starts.append(start)
            tables.append(seq.block_table)
            if wanted:
                chains.append((seq, wanted, len(ids) - 1))
        if not ids:
            return
        seqs = [seq for seq, _, _ in chains]
        wants = [w for _, w, _ in chains]
        first = DraftPass(
            ids, positions, query_lens, starts, tables, rows, [row for _, _, row in chains], False, torch.stack(carried)
        )
        logits = self._pass(first)
        active = list(range(len(seqs)))
        k = 0
        while active:
            assert logits is not None
            guesses = logits.max(dim=-1).indices.tolist()  # argmax's first maximal index (sampler.py)
            for seq_index, token in zip(active, guesses):
                seqs[seq_index].mtp_drafts.append(int(token))
            k += 1
            keep = [j for j, i in enumerate(active) if wants[i] > k]
            if not keep:
                break
            active = [active[j] for j in keep]
            at = [seqs[i].num_tokens - 1 + k for i in active]
            tables = [seqs[i].block_table for i in active]
            tokens = [int(guesses[j]) for j in keep]
            logits = self._pass(DraftPass(tokens, at, [1] * len(at), at, tables, keep, list(range(len(keep))), True))

    def _pass(self, draft: DraftPass) -> torch.Tensor | None:
        """Run ``draft`` here, after sending it to the other ranks (the carried states through the CPU)."""
        if self.broadcast is not None:
            carried = draft.carried
            self.broadcast.send(draft if carried is None else replace(draft, carried=carried.cpu()))
        return self.passes.execute(draft)
