"""The engine API the service drives: add a request, advance one step, cancel a request.

    engine = LLMEngine(load_model(path), load_tokenizer(path))   # see loader.py, contract/tokenizer/load.py
    engine.add_request(GenerationRequest("r1", engine.tokenizer.encode_chat(messages)))
    while engine.has_unfinished():
        for out in engine.step():                   # token events of this step, per request
            ...

One step runs every scheduled sequence through one forward pass; nothing here assumes a
batch of one.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import structlog
import torch

from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.grammar import ConstraintError, GrammarCompiler
from tokenmill_service.contract.request import (
    EngineStats,
    FinishReason,
    GenerationRequest,
    RequestError,
    RequestOutput,
    TokenOutput,
    TopLogprob,
)
from tokenmill_service.contract.tokenizer import Tokenizer
from tokenmill_service.worker.engine.adapters import AdapterError, AdapterManager
from tokenmill_service.worker.engine.block_manager import BlockManager
from tokenmill_service.worker.engine.causal_lm import CausalLM
from tokenmill_service.worker.engine.compile import compiled_graphs
from tokenmill_service.worker.engine.kv_events import KVEventLog
from tokenmill_service.worker.engine.kv_pool import (
    KVPoolTooLarge,
    KVPoolTooSmall,
    fit_context,
    kv_cache_groups,
    pool_blocks,
)
from tokenmill_service.worker.engine.model_runner import ModelRunner, StepLogits, kv_bytes_per_block
from tokenmill_service.worker.engine.mtp_drafter import MTPDrafter
from tokenmill_service.worker.engine.sampler import SamplerOutput, sample
from tokenmill_service.worker.engine.scheduler import ScheduledBatch, Scheduler
from tokenmill_service.worker.engine.sequence import Sequence
from tokenmill_service.worker.engine.token_masks import MaskFiller, MaskJob, allowed_tokens
from tokenmill_service.worker.kernels import log_softmax

log = structlog.get_logger(__name__)

# The pool's refusals are the engine's too (the worker reports them as refusals, not failures).
__all__ = ["KVPoolTooLarge", "KVPoolTooSmall", "LLMEngine", "kv_cache_groups"]


class LLMEngine:
    def __init__(
        self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig | None = None, executor: str | None = None
    ) -> None:
        self.config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        block_size = self.config.block_size
        # Which layers share a block table; a block id stands for one group's layers (all of them
        # but for models that mix windowed and global layers).
        self.kv_groups = kv_cache_groups(model, self.config)
        grouped = self.kv_groups.num_groups > 1
        block_bytes = kv_bytes_per_block(
            model, block_size, model.kv_dtype, self.kv_groups.group_size if grouped else None
        )
        num_blocks = self.config.num_kv_blocks
        if num_blocks <= 0:
            num_blocks = pool_blocks(model, self.config, block_bytes)
        # What enters and leaves the prefix cache, when asked for (the worker publishes it after each step).
        self.kv_events = KVEventLog() if self.config.kv_events else None
        self.block_manager = BlockManager(
            num_blocks,
            block_size,
            self.config.enable_prefix_caching,
            self.kv_events,
            group_windows=self.kv_groups.windows,
        )
        self.max_model_len, self.kv_per_sequence = fit_context(
            model, self.config, self.block_manager, self.kv_groups, block_bytes
        )
        # LoRA adapters, where the model has slots for them (--max-loras).
        slots = getattr(model, "lora", None)
        self.adapters = None if slots is None else AdapterManager(slots.max_loras, slots.max_rank, model.config)
        self.scheduler = Scheduler(self.config, self.block_manager, self.adapters)
        # executor: how each forward pass runs (None: as the model's load plan chose).
        self.runner = ModelRunner(model, block_size, num_blocks, executor, self.kv_groups)
        self.runner.adapters = self.adapters
        # --speculative-method mtp: drafts from the model's multi-token-prediction layers, after each step.
        self.drafter: MTPDrafter | None = None
        if self.config.speculative_method == "mtp":
            self.drafter = MTPDrafter(model, self.config, self.block_manager, self.runner)
        self.sequences: dict[str, Sequence] = {}
        # Draft tokens checked and kept (speculation.py), since start.
        self.drafts_proposed = self.drafts_accepted = 0
        # Constrained decoding: compiled grammars (cached) and the thread filling their masks.
        self.grammars = GrammarCompiler(tokenizer)
        self.masks = MaskFiller(tokenizer.vocab_size)

    # -- the API ---------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Raise RequestError when the engine could never run this request."""
        n = len(request.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty: give at least one token")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in request.prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if n >= self.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens but the context holds {self.max_model_len}: "
                "shorten the prompt so at least one token can be generated"
            )
        max_new = request.stopping.max_new_tokens
        if max_new and n + max_new > self.max_model_len:
            raise RequestError(
                f"prompt tokens + max_new_tokens must be <= {self.max_model_len}; "
                f"given {n} prompt tokens and max_new_tokens {max_new}"
            )
        done = len(request.resume_ids)
        if done and (max_new and done >= max_new or n + done >= self.max_model_len):
            raise RequestError(
                f"a resumed request has nothing left to generate ({done} tokens already sent, "
                f"max_new_tokens {max_new}, context {self.max_model_len})"
            )
        bad = next((t for t in request.resume_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"resumed token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if request.request_id in self.sequences:
            raise RequestError(f"request id {request.request_id!r} is already running")
        if request.adapter and (self.adapters is None or request.adapter not in self.adapters.registered):
            raise RequestError(f"the LoRA adapter {request.adapter!r} is not loaded")

    # -- LoRA adapters -----------------------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` as ``name`` (AdapterError: it does not fit, or adapters are off)."""
        if self.adapters is None:
            raise AdapterError("LoRA adapters are off: start the server with --max-loras 1 or more")
        adapter = self.adapters.register(name, path)
        log.info("lora_adapter_loaded", name=name, path=path, rank=adapter.rank, targets=adapter.targets)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; refused (AdapterError) while a request uses it, never breaking one."""
        if self.adapters is None or name not in self.adapters.registered:
            raise KeyError(name)
        users = sum(seq.request.adapter == name for seq in self.sequences.values())
        if users:
            raise AdapterError(f"the LoRA adapter {name!r} is in use by {users} request(s); unload it when they finish")
        self.adapters.unregister(name)
        log.info("lora_adapter_unloaded", name=name)

    def add_request(self, request: GenerationRequest) -> None:
        self.validate(request)
        seq = Sequence(request, self.tokenizer)
        if request.constraint is not None:
            try:
                seq.matcher = self.grammars.matcher(request.constraint)
            except ConstraintError as exc:
                raise RequestError(str(exc)) from None
            # A resumed request: the grammar's state after the tokens already sent.
            if request.resume_ids and not seq.matcher.consume_tokens(request.resume_ids):
                raise RequestError(f"the resumed tokens do not match the {request.constraint.kind}")
        if request.adapter and self.adapters is not None:
            seq.adapter_key = self.adapters.keys[request.adapter]
        self.sequences[request.request_id] = seq
        self.scheduler.add(seq)

    def cancel(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is not here (already done)."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        seq.finish_reason = FinishReason.CANCELLED
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            kv_block_size=self.block_manager.block_size,
            prefix_cache_queries=self.block_manager.prefix_queries,
            prefix_cache_hits=self.block_manager.prefix_hits,
            compiled_graphs=compiled_graphs(),
            draft_tokens_proposed=self.drafts_proposed,
            draft_tokens_accepted=self.drafts_accepted,
            running_adapters=sorted({s.request.adapter for s in self.scheduler.running if s.request.adapter}),
            waiting_adapters=sorted({s.request.adapter for s in self.scheduler.waiting if s.request.adapter}),
            adapters=sorted(self.adapters.registered) if self.adapters is not None else [],
        )

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule(self.max_model_len)
        if not batch.seqs:
            return []
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        for seq in batch.preempted:
            log.info("sequence_preempted", request_id=seq.request_id, tokens=seq.num_tokens)
        if self.adapters is not None:
            # How many adapters' weights the step reads (what adapter-aware routing keeps down).
            log.debug(
                "step_scheduled",
                sequences=len(batch.seqs),
                tokens=sum(batch.num_new_tokens),
                adapters=len({seq.request.adapter for seq in batch.seqs if seq.request.adapter}),
            )
        masks = self._submit_masks(batch)
        logits = self.runner.run(batch)
        outputs: dict[int, RequestOutput] = {}
        self._collect_prompt_logprobs(batch, logits)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            # A sequence with drafts has computed only what its checks keep (in _sample).
            seq.num_computed_tokens += n - len(seq.drafts)
            if not seq.drafts:
                self.block_manager.register_computed_blocks(seq)
        self._sample(batch, logits, outputs, masks)
        if self.drafter is not None and self.config.speculative_tokens:
            self._propose_mtp_drafts(batch)
        return [outputs[i] for i in sorted(outputs)]

    def _propose_mtp_drafts(self, batch: ScheduledBatch) -> None:
        assert self.drafter is not None
        self.drafter.propose(batch, len(self.scheduler.running), self.max_model_len)
        self.runner.last_plan = self.runner.last_hidden = None

    # -- internals -------------------------------------------------------------------------

    def _token(self, token_id: int, logprob: float | None, top: list[tuple[int, float]]) -> TokenOutput:
        tok = self.tokenizer
        return TokenOutput(
            id=token_id,
            text=tok.token_text(token_id),
            logprob=logprob,
            top_logprobs=[TopLogprob(i, tok.token_text(i), lp) for i, lp in top],
            special=tok.is_special(token_id),
        )

    def _collect_prompt_logprobs(self, batch: ScheduledBatch, logits: StepLogits) -> None:
        for i, rows in logits.prompt_logits.items():
            seq = batch.seqs[i]
            start = seq.num_computed_tokens
            if start == 0:
                seq.prompt_tokens = [self._token(seq.token_ids[0], None, [])]
            lps = log_softmax(rows)
            n_top = seq.request.top_logprobs
            # Row r predicts the token at start + r + 1; stop at the end of the prompt.
            upto = min(rows.shape[0], seq.num_prompt_tokens - 1 - start)
            if upto <= 0:
                continue
            targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + upto], dtype=torch.long, device=rows.device)
            chosen = lps[:upto].gather(1, targets[:, None]).squeeze(1).tolist()
            tops: list[list[tuple[int, float]]] = [[] for _ in range(upto)]
            if n_top:
                vals, idx = lps[:upto].topk(n_top, dim=-1)
                tops = [list(zip(ix, vs)) for ix, vs in zip(idx.tolist(), vals.tolist())]
            for r in range(upto):
                seq.prompt_tokens.append(self._token(int(targets[r]), chosen[r], tops[r]))

    def _submit_masks(self, batch: ScheduledBatch) -> tuple[list[int], Future[torch.Tensor]] | None:
        """Start filling the masks of the constrained sequences that sample this step (while the
        forward pass runs): the sampled rows they cover, and the future bitmask of every sampled row."""
        jobs: list[MaskJob] = []
        rows: list[int] = []
        num_rows = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens + n != seq.num_tokens + len(seq.drafts):
                continue  # a prompt chunk that samples nothing (the order is ModelRunner.plan's)
            if seq.matcher is not None:
                jobs.append(MaskJob(num_rows, seq.matcher, list(seq.drafts), sorted(seq.stop_token_ids)))
                rows.extend(range(num_rows, num_rows + 1 + len(seq.drafts)))
            num_rows += 1 + len(seq.drafts)
        if not jobs:
            return None
        return rows, self.masks.submit(jobs, num_rows)

    def _sample(
        self,
        batch: ScheduledBatch,
        logits: StepLogits,
        outputs: dict[int, RequestOutput],
        masks: tuple[list[int], Future[torch.Tensor]] | None = None,
    ) -> None:
        allowed = None
        if masks is not None:
            masked, pending = masks  # the rows a grammar constrains, and their bitmasks
            bitmask = pending.result()
            allowed = (
                masked,
                allowed_tokens(bitmask[masked], logits.sample_logits.shape[-1], logits.sample_logits.device),
            )
        if not logits.sample_seq_indices:
            return
        # Row r samples the position after seen[r]: a draft's row sees the drafts before it.
        seqs = [batch.seqs[i] for i in logits.sample_seq_indices]
        seen: list[list[int]] = []
        for row, (i, seq) in enumerate(zip(logits.sample_seq_indices, seqs)):
            first = row == 0 or logits.sample_seq_indices[row - 1] != i
            seen.append(seq.token_ids if first else [*seen[-1], seq.drafts[len(seen[-1]) - seq.num_tokens]])
        result = sample(
            logits.sample_logits,
            [s.request.sampling for s in seqs],
            [s.seed for s in seqs],
            seen,
            [s.request.top_logprobs if s.request.logprobs or s.request.top_logprobs else 0 for s in seqs],
            [s.num_prompt_tokens for s in seqs],
            allowed,
            [s.request.logprobs or s.request.top_logprobs > 0 for s in seqs],
        )
        row = 0
        while row < len(seqs):
            i = logits.sample_seq_indices[row]
            rows = logits.sample_seq_indices.count(i)
            outputs[i] = self._accept(seqs[row], result, row, rows)
            row += rows

    def _accept(self, seq: Sequence, result: SamplerOutput, row: int, rows: int) -> RequestOutput:
        """A sequence's sampled rows ``row`` to ``row + rows`` (its drafts' checks, then the next token) taken as
        its new tokens, up to the first draft that differs from what was sampled or the end of the sequence."""
        out = RequestOutput(request_id=seq.request_id, prompt_len=seq.num_prompt_tokens)
        if seq.collecting_prompt_logprobs:
            out.prompt_tokens = seq.prompt_tokens
            seq.prompt_logprobs_sent = True
        if seq.num_completion_tokens == 0 and seq.first_scheduled_time is not None:
            out.queue_s = seq.first_scheduled_time - seq.arrival_time
        wants_lp = seq.request.logprobs or seq.request.top_logprobs > 0
        reason = None
        for j in range(rows):
            # Keep sampling while each draft equals what was sampled at its position.
            token_id = result.token_ids[row + j]
            seq.token_ids.append(token_id)
            out.tokens.append(
                self._token(token_id, result.logprobs[row + j] if wants_lp else None, result.top_logprobs[row + j])
            )
            out.text += seq.detokenizer.add(token_id)
            if seq.matcher is not None and not seq.matcher.consume_token(token_id):
                log.warning("grammar_refused_token", request_id=seq.request_id, token_id=token_id)
            reason = self._finish_reason(seq, token_id)
            if reason is not None or j == rows - 1 or token_id != seq.drafts[j]:
                break
        if seq.drafts:
            self._settle_drafts(seq, rows - 1, len(out.tokens) - 1)
        if reason is not None:
            self._finish(seq, reason, out)
        out.completion_len = seq.num_completion_tokens
        return out

    def _settle_drafts(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Each kept draft is in the cache now (the token sampled after them is not)."""
        seq.num_computed_tokens += accepted
        seq.drafts = []
        self.block_manager.register_computed_blocks(seq)
        self.drafts_proposed += proposed
        self.drafts_accepted += accepted
        seq.drafts_proposed += proposed
        seq.drafts_accepted += accepted

    def _finish(self, seq: Sequence, reason: FinishReason, out: RequestOutput) -> None:
        if seq.drafts_proposed:
            log.info(
                "speculation_finished",
                request_id=seq.request_id,
                method=self.config.speculative_method,
                drafts_proposed=seq.drafts_proposed,
                drafts_accepted=seq.drafts_accepted,
                acceptance_rate=round(seq.drafts_accepted / seq.drafts_proposed, 3),
            )
        out.text += seq.detokenizer.flush()
        out.finish_reason = reason
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.sequences.pop(seq.request_id, None)

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        if token_id in seq.stop_token_ids:
            return FinishReason.EOS
        if seq.matcher is not None and (seq.matcher.is_stopped() or seq.matcher.is_error()):
            return FinishReason.EOS  # the grammar is complete: nothing may follow
        if seq.detokenizer.stopped:
            return FinishReason.STOP_SEQUENCE
        max_new = seq.request.stopping.max_new_tokens
        if max_new and seq.num_completion_tokens >= max_new:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.CONTEXT_LIMIT
        return None
