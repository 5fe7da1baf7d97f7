"""The messages between the router and a replica's worker process: typed, picklable, torch-free.

The router imports this module and never torch; each side dispatches on the message's type
(`match`), never on a string tag. Both directions are batched: the router sends every command
gathered in one loop turn as one list; the worker answers each engine step with one
`StepOutputs` holding every request's outputs of that step (never one message per token).

    router -> worker: list[AddRequest | Cancel | LoadAdapter | UnloadAdapter | Embed | Shutdown]
    worker -> router: Ready | Failed | StepOutputs | Rejected | Stats | Heartbeat | AdapterResult | Embedded
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill_service.contract.engine_config import EngineConfig
from tokenmill_service.contract.plan.options import LoadOptions
from tokenmill_service.contract.request import EngineStats, GenerationRequest, RequestOutput

# -- what the router hands a worker process when it spawns it ---------------------------------


@dataclass(slots=True)
class WorkerSpec:
    worker_id: int
    rank: int
    # The GPU this process drives (replica * tensor_parallel + rank); unused on CPU.
    device_index: int
    world_size: int
    master_addr: str
    master_port: int
    # What the user asked of the model, whole; the worker's load plan decides what it means here.
    options: LoadOptions
    engine: EngineConfig
    threads: int
    log_format: str
    log_level: str
    # Seconds between two heartbeats (sent whether the engine is busy or idle).
    heartbeat_interval: float = 0.5
    # Seconds a rank waits in one collective (a step broadcast, an all-reduce) before it takes a
    # peer for dead; rank 0 sends an idle tick every quarter of it.
    collective_timeout: float = 120.0
    # --kv-events-endpoint as given (this worker offsets its port by its id) and --kv-events-topic.
    kv_events_endpoint: str = ""
    kv_events_topic: str = ""
    # LoRA adapters to serve from the start, (name, path): --lora-modules and those loaded since.
    lora_modules: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class EmbeddingInfo:
    """How the model served embeds (worker/models/embedding_spec.py read it from the checkpoint)."""

    dimensions: int  # the vector's size (the model's hidden size)
    pooling: str  # "cls", "mean" or "last": which hidden states make the vector
    normalize: bool  # the vector is scaled to length 1
    # The special tokens the model's tokenizer puts around a text ([CLS] ... [SEP]; Qwen3's EOS after it).
    prefix_ids: list[int] = field(default_factory=list)
    suffix_ids: list[int] = field(default_factory=list)
    # The most tokens one input may hold, its special tokens included.
    max_tokens: int = 0
    # False: an encoder, which only embeds (the generation routes refuse it).
    generates: bool = True


@dataclass(slots=True)
class WorkerInfo:
    worker_id: int
    pid: int
    model_name: str
    context_length: int
    vocab_size: int
    device: str
    dtype: str
    kv_blocks_total: int
    kv_block_size: int
    quantization: str = "none"  # what the linear layers run as ("int4+none": mixed)
    weight_bytes: int = 0  # bytes of weights one forward pass reads
    compiled_graphs: int = 0  # graphs torch.compile built during the warm-up (0: eager)
    backend: str = "torch"
    # The load plan's decisions, each "value (reason)" (LoadPlan.summary()), for GetModelInfo.
    plan: dict[str, str] = field(default_factory=dict)
    # The LoRA adapters it serves, by name.
    adapters: list[str] = field(default_factory=list)
    # What one sequence's KV cache costs at most, with why (LLMEngine.kv_per_sequence).
    kv_per_sequence: str = ""
    # How the model embeds; None: it does not (a chat model without a pooling configuration).
    embedding: EmbeddingInfo | None = None


# -- router -> worker ---------------------------------------------------------------------------


@dataclass(slots=True)
class AddRequest:
    """Admit a request (a new one, or a resumed one carrying `request.resume_ids`)."""

    request: GenerationRequest


@dataclass(slots=True)
class Cancel:
    request_id: str


@dataclass(slots=True)
class LoadAdapter:
    """Serve the LoRA adapter at ``path`` as ``name`` (answered by ``AdapterResult``)."""

    name: str
    path: str


@dataclass(slots=True)
class UnloadAdapter:
    """Stop serving the LoRA adapter ``name`` (answered by ``AdapterResult``)."""

    name: str


@dataclass(slots=True)
class Shutdown:
    """Cancel everything and exit."""


@dataclass(slots=True)
class Embed:
    """Embed each of ``inputs`` (token ids, special tokens included), each as its own sequence; answered by
    ``Embedded``. ``dimensions``: the size to truncate each vector to (0: whole), renormalized if the model
    normalizes."""

    request_id: str
    inputs: list[list[int]]
    dimensions: int = 0


Command = AddRequest | Cancel | LoadAdapter | UnloadAdapter | Embed | Shutdown


# -- worker -> router ---------------------------------------------------------------------------


@dataclass(slots=True)
class Ready:
    """The model is loaded and a warm-up step ran; the worker takes requests from now on."""

    info: WorkerInfo


@dataclass(slots=True)
class Failed:
    """The worker could not start (the process exits after sending it). ``usage``: the checkpoint or the
    flags cannot be served as asked (an unsupported architecture, a refused plan), not a fault."""

    message: str
    usage: bool = False


@dataclass(slots=True)
class StepOutputs:
    """Everything one engine step produced, with the engine's load after it."""

    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass(slots=True)
class Rejected:
    """The engine refused a request (a limit only the engine could check)."""

    request_id: str
    message: str


@dataclass(slots=True)
class Stats:
    """The engine's load changed without a step (a cancel freed its blocks)."""

    stats: EngineStats


@dataclass(slots=True)
class Heartbeat:
    """Sent every `WorkerSpec.heartbeat_interval` by a thread of the worker, so silence means the
    process is stopped or gone, and `step_elapsed` tells a step that runs too long from a slow one."""

    # Seconds the step in progress has run; None while the engine is between steps.
    step_elapsed: float | None = None
    # Tokens in that step (the step's size, which bounds how long it may take).
    step_tokens: int = 0


@dataclass(slots=True)
class AdapterResult:
    """The answer to ``LoadAdapter`` / ``UnloadAdapter`` (``load``: which): ``error`` empty when done, else
    why not, of ``kind`` "invalid" (the adapter does not fit), "not_found" or "in_use"."""

    name: str
    load: bool
    error: str = ""
    kind: str = ""


@dataclass(slots=True)
class Embedded:
    """The answer to ``Embed``: one vector per input, each little-endian float32 bytes; ``error`` (vectors
    empty) says why not."""

    request_id: str
    vectors: list[bytes] = field(default_factory=list)
    error: str = ""


Event = Ready | Failed | StepOutputs | Rejected | Stats | Heartbeat | AdapterResult | Embedded
