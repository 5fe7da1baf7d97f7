"""Which replica runs a request: the least loaded (``--routing least-load``), or the one best placed
by a score of the endpoint picker's kind, the prefill a replica would save against the load it already
carries (``--routing prefix``, the default):

    score = cached / TOKENS_PER_REQUEST − (load − least load − affinity)

``cached`` is the prompt's tokens in full blocks the replica probably holds (``PrefixIndex``, keyed by
the request's LoRA adapter as the workers' prefix caches are), ``load`` the requests it runs or queues.
Each request a replica runs beyond the least loaded one costs the newcomer a share of every step it
takes there (a CPU's steps, and a GPU's past a point, grow with the batch), TOKENS_PER_REQUEST tokens of
prefill saved make up for one. So requests that share a short prefix (a system prompt) go where it is
cached until that replica runs a request or two more than another, then spread, and the other replica
caches it too; a long conversation cached on one replica stays there unless it is far busier. (The
score once divided the load by --max-batch-size: a cached prefix outweighed any queue short of a full
batch, and eight chats with one system prompt ran on one of two workers while the other sat idle.)

``affinity`` keeps a LoRA adapter's requests together (the endpoint picker's LoRA affinity prefers a
server whose ``vllm:lora_requests_info`` names the adapter): a step reads the weights of every
adapter in its batch, so a replica whose steps carry fewer distinct adapters runs them faster (and
keeps them in its ``--max-loras`` slots). It is ``ADAPTER_AFFINITY`` × the replica's requests with
the request's adapter / the most any replica has (0 for requests on the base model): the replica
running most of an adapter's requests counts ``ADAPTER_AFFINITY`` requests lighter, one running a
few of them proportionally less (so an adapter that spilt over gathers again), one running none not
at all. The load it may cost is bounded: a replica is preferred for its adapter only while it runs
fewer than ``ADAPTER_AFFINITY`` requests more than another; an adapter that every request uses
spreads over every replica as the base model's requests do.

Equal scores go to the less loaded replica, then in turn, so unrelated prompts spread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenmill_service.contract.block_hash import full_block_hashes
from tokenmill_service.front.router.prefix_index import PrefixIndex

ROUTINGS = ("prefix", "least-load")

# Requests of load a replica running most of an adapter's requests is let carry above another, for
# that adapter's next request (the score's units: requests).
ADAPTER_AFFINITY = 4
# Tokens of prefill a cached prefix must save to be worth one request more on its replica.
TOKENS_PER_REQUEST = 256


class ReplicaChooser:
    def __init__(self, routing: str, block_size: int) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}: {' or '.join(ROUTINGS)}")
        self.routing = routing
        self.block_size = block_size
        self.index = PrefixIndex()
        self._turn = 0

    def replica_started(self, replica: int, kv_blocks: int) -> None:
        self.index.reset(replica, kv_blocks)

    def choose(
        self,
        prompt_ids: Sequence[int],
        loads: Mapping[int, int],
        adapter: str = "",
        users: Mapping[int, int] | None = None,
    ) -> int | None:
        """The replica (of `loads`: id -> requests in flight) to run `prompt_ids` on; records the choice.

        `adapter`: the key the request's LoRA adapter caches its blocks under ("": the base model);
        `users`: id -> the replica's requests in flight with that adapter (none given: no affinity).
        """
        if not loads:
            return None
        ids = sorted(loads)
        if self.routing == "least-load":
            return min(ids, key=lambda r: loads[r])
        hashes = full_block_hashes(prompt_ids, self.block_size, adapter_key=adapter)
        affinity = self._affinity(ids, users or {}) if adapter else dict.fromkeys(ids, 0.0)
        lightest = min(loads[r] for r in ids)
        scores = {r: self._score(r, hashes, loads[r] - lightest - affinity[r]) for r in ids}
        best = max(scores.values())
        tied = [r for r in ids if scores[r] == best]
        least = min(loads[r] for r in tied)
        tied = [r for r in tied if loads[r] == least]
        self._turn += 1
        chosen = tied[self._turn % len(tied)]
        self.index.record(chosen, hashes)
        return chosen

    @staticmethod
    def _affinity(ids: list[int], users: Mapping[int, int]) -> dict[int, float]:
        """Requests of load each replica counts lighter for running the request's adapter."""
        most = max((users.get(r, 0) for r in ids), default=0)
        return {r: ADAPTER_AFFINITY * users.get(r, 0) / most if most else 0.0 for r in ids}

    def _score(self, replica: int, hashes: list[int], load: float) -> float:
        cached = self.index.matched(replica, hashes) * self.block_size if hashes else 0
        return cached / TOKENS_PER_REQUEST - load
