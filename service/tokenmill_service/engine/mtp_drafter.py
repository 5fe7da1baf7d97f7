"""Draft tokens from the model's multi-token-prediction layers (``--speculative-method mtp``;
models/deepseek_mtp.py says what a layer computes).

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
many tokens a step keeps, never which (engine/speculation.py says why), so this costs speed at most.
"""

from __future__ import annotations

import torch

from tokenmill_service.engine.block_manager import BlockManager
from tokenmill_service.engine.causal_lm import CausalLM
from tokenmill_service.engine.config import EngineConfig
from tokenmill_service.engine.model_runner import StepPlan
from tokenmill_service.engine.scheduler import ScheduledBatch
from tokenmill_service.engine.sequence import Sequence, SequenceStatus
from tokenmill_service.kernels.attention_metadata import build_attention_metadata


class MTPDrafter:
    def __init__(self, model: CausalLM, config: EngineConfig, block_manager: BlockManager) -> None:
        layers = getattr(model, "mtp", None)
        if not layers:
            raise ValueError(
                "speculative_method mtp needs the model's multi-token-prediction layers loaded "
                "(load it with speculative_method='mtp'; only DeepSeek-V3 checkpoints have them)"
            )
        self.model = model
        self.layer = layers[0]
        self.config = config
        self.block_manager = block_manager

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
    def propose(
        self,
        batch: ScheduledBatch,
        plan: StepPlan,
        hidden: torch.Tensor,
        running: int,
        max_model_len: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Set ``mtp_drafts`` of every sequence of the step just run (``plan``, whose main-model hidden
        states are ``hidden``), writing the block's cache entries for the positions it computed."""
        device = hidden.device
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # per token: its previous hidden state's row in ``previous`` below
        carried: list[torch.Tensor] = []  # hidden states kept from the step before, one per sequence
        query_lens, starts, tables = [], [], []
        chains: list[tuple[Sequence, int, int]] = []  # (sequence, drafts wanted, its last row in the pass)
        zero = torch.zeros(hidden.shape[-1], dtype=hidden.dtype, device=device)
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
                    rows.append(-1 - len(carried))
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
        # Rows >= 0 are this step's hidden states; row -1 - j the j-th carried one.
        pool = torch.cat((hidden, torch.stack(carried).to(hidden.dtype)))
        index = torch.tensor([r if r >= 0 else hidden.shape[0] + (-1 - r) for r in rows], device=device)
        out = self._run(ids, positions, pool.index_select(0, index), query_lens, starts, tables, k_cache, v_cache)
        seqs = [seq for seq, _, _ in chains]
        wants = [w for _, w, _ in chains]
        last = out.index_select(0, torch.tensor([row for _, _, row in chains], dtype=torch.long, device=device))
        active = list(range(len(seqs)))
        k = 0
        while active:
            guesses = self.layer.compute_logits(last).argmax(dim=-1)
            for seq_index, token in zip(active, guesses.tolist()):
                seqs[seq_index].mtp_drafts.append(int(token))
            k += 1
            keep = [j for j, i in enumerate(active) if wants[i] > k]
            if not keep:
                break
            active = [active[j] for j in keep]
            chosen = torch.tensor(keep, dtype=torch.long, device=device)
            at = [seqs[i].num_tokens - 1 + k for i in active]
            tokens = guesses.index_select(0, chosen).tolist()
            last = self._run(
                tokens,
                at,
                last.index_select(0, chosen),
                [1] * len(at),
                at,
                [seqs[i].block_table for i in active],
                k_cache,
                v_cache,
            )

    def _run(
        self,
        ids: list[int],
        positions: list[int],
        previous: torch.Tensor,
        query_lens: list[int],
        starts: list[int],
        tables: list[list[int]],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        device = previous.device
        meta = build_attention_metadata(query_lens, starts, tables, k_cache, v_cache)
        tokens = torch.tensor(ids, dtype=torch.long, device=device)
        embeds = self.model.model.embed(tokens)  # type: ignore[attr-defined]
        where = torch.tensor(positions, dtype=torch.long, device=device)
        out: torch.Tensor = self.layer(embeds, where, previous, meta)
        return out
