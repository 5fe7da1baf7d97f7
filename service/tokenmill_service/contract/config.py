"""The server's settings in one typed place: every flag is also a TOKENMILL_* environment variable.

Precedence: command-line flag, then environment variable, then the default.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from tokenmill_service.contract.plan import choices

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# A value another part of the server is given, built from the settings (``Settings.subset``).
View = TypeVar("View", bound="DataclassInstance")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024, "m": 1000**2, "mb": 1000**2}
_UNITS |= {"mi": 1024**2, "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3}
_UNITS |= {"t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648; '0' or '' -> 0 (pick automatically)."""
    if not text.strip():
        return 0
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(slots=True)
class Settings:
    model: str = field(default="", metadata={"help": "GGUF file or Hugging Face directory (default: embedded SmolLM2)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on (0.0.0.0 in containers)"})
    port: int = field(default=50051, metadata={"help": "gRPC port"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda", "choices": ["cpu", "cuda"]})
    workers: int = field(
        default=0,
        metadata={"help": "model replicas, each of --tensor-parallel processes (0: 1 on CPU, all GPUs on CUDA)"},
    )
    routing: str = field(
        default="prefix",
        metadata={
            "help": "how the router picks a worker for a request: prefix = where the prompt's prefix is probably "
            "cached and its LoRA adapter already runs, balanced against each worker's load; least-load = the "
            "worker running the fewest requests",
            "choices": ["prefix", "least-load"],
        },
    )
    tensor_parallel: int = field(
        default=1,
        metadata={
            "help": "ranks (processes, devices) per replica; must divide the model's query heads, MLP width "
            "and vocabulary, and divide or be a multiple of its key/value heads"
        },
    )
    expert_parallel: bool = field(
        default=False,
        metadata={
            "help": "mixture-of-experts models: each of a replica's --tensor-parallel ranks holds whole experts "
            "(experts / ranks of them; the degree must divide the experts) instead of a slice of every expert; "
            "attention stays tensor-parallel",
        },
    )
    backend: str = field(default="torch", metadata={"option": choices.BACKEND})
    dtype: str = field(default="auto", metadata={"option": choices.DTYPE})
    quantization: str = field(default="auto", metadata={"option": choices.QUANTIZATION})
    activations: str = field(default="auto", metadata={"option": choices.ACTIVATIONS})
    cpu_isa: str = field(default="auto", metadata={"option": choices.CPU_ISA})
    kv_cache_dtype: str = field(default="auto", metadata={"option": choices.KV_CACHE_DTYPE})
    compile: str = field(default="off", metadata={"option": choices.COMPILE})
    threads: int = field(default=0, metadata={"help": "torch threads per worker (0: the cores shared among workers)"})
    max_queue: int = field(default=256, metadata={"help": "requests allowed to wait beyond the running batches"})
    max_batch_size: int = field(default=64, metadata={"help": "sequences in one forward pass, per worker"})
    max_batch_tokens: int = field(default=512, metadata={"help": "tokens in one forward pass, per worker"})
    max_batch_tokens_decoding: int = field(
        default=256, metadata={"help": "tokens in one forward pass beside decoding streams (their pauses), per worker"}
    )
    speculative_tokens: int = field(
        default=6,
        metadata={
            "help": "draft tokens a decoding sequence guesses from its own history (prompt lookup) and checks in "
            "the same step: the same tokens and logprobs as without, more per read of the weights; 0 = off"
        },
    )
    speculative_method: str = field(default="ngram", metadata={"option": choices.SPECULATIVE_METHOD})
    speculative_max_batch: int = field(
        default=4, metadata={"help": "guess drafts only while at most this many sequences run, per worker"}
    )
    max_new_tokens_limit: int = field(default=4096, metadata={"help": "largest max_new_tokens a request may ask"})
    default_max_new_tokens: int = field(
        default=1024, metadata={"help": "max_new_tokens of a request that sets none (at most --max-new-tokens-limit)"}
    )
    max_top_logprobs: int = field(default=20, metadata={"help": "largest top_logprobs a request may ask"})
    max_stop_strings: int = field(default=16, metadata={"help": "most stop strings in one request"})
    json_schema_permissive: bool = field(
        default=False,
        metadata={
            "help": "read JSON schemas (response_format, guided_json, tools' parameters) as JSON Schema does: an "
            "object schema that does not say additionalProperties admits any further key, an array schema "
            "without items any items (default: only the keys and items it declares, as xgrammar's strict mode)"
        },
    )
    max_model_len: int = field(
        default=0,
        metadata={
            "help": "the most tokens (prompt and generated) one request may hold: caps the model's context "
            "(0: the model's own, within the KV cache pool)"
        },
    )
    served_model_name: str = field(
        default="",
        metadata={
            "help": "the model's name in /v1/models, HTTP responses and GetModelInfo (default: the checkpoint's)"
        },
    )
    chat_template: str = field(
        default="", metadata={"help": "a Jinja chat template file, used instead of the checkpoint's (default: none)"}
    )
    kv_cache_memory: str = field(default="", metadata={"help": "KV cache pool per worker, e.g. 2GiB (default: auto)"})
    max_request_bytes: str = field(
        default="4MiB",
        metadata={
            "help": "largest request body (HTTP: 413) and gRPC message (RESOURCE_EXHAUSTED) taken, e.g. 16MiB: "
            "a bound on what one request can make the server read and tokenize"
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    log_format: str = field(default="", metadata={"help": "json or console (default: console on a terminal)"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    banner: str = field(
        default="auto",
        metadata={
            "help": "once ready, print the commands that call the server on stderr; auto = on a terminal only "
            "(a log collector gets the server_ready line alone), on = always (make run), off = never",
            "choices": ["auto", "on", "off"],
        },
    )
    drain_seconds: float = field(default=30.0, metadata={"help": "on SIGTERM, time in-flight calls get to finish"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics HTTP port (0: off)"})
    metrics_without_auth: bool = field(
        default=False,
        metadata={
            "help": "serve /metrics (on --metrics-port and --http-port) without the bearer token even when "
            "--auth-token is set, for a scraper that sends none"
        },
    )
    http_port: int = field(
        default=8000, metadata={"help": "OpenAI-compatible HTTP API port, with /health and /metrics (0: off)"}
    )
    auth_token: str = field(
        default="",
        metadata={
            "help": "if set, calls must send 'authorization: Bearer TOKEN'",
            # vLLM's and llama.cpp's name for it, flag and variable.
            "aliases": ["--api-key"],
            "env_aliases": ["TOKENMILL_API_KEY"],
        },
    )
    kv_events_endpoint: str = field(
        default="",
        metadata={
            "help": "publish KV-cache events (blocks stored in and removed from the prefix cache) on this ZMQ "
            "endpoint in vLLM's format, e.g. tcp://*:5557 (bound; a host name instead of * connects); worker N "
            "of --workers uses the port + N (default: off)"
        },
    )
    kv_events_topic: str = field(
        default="", metadata={"help": "the ZMQ topic of the KV-cache events (default: none, as vLLM's)"}
    )
    master_port: int = field(
        default=0,
        metadata={"help": "first torch.distributed port (0: pick free ports; 29500 with --nnodes above 1)"},
    )
    nnodes: int = field(
        default=1,
        metadata={
            "help": "servers (pods, machines) one tensor-parallel replica spans: its --tensor-parallel ranks are "
            "split over them in order; node 0 runs the router and the APIs, the others their ranks only",
            # A LeaderWorkerSet's pods are told their group's size, their index and the leader's address.
            "env_aliases": ["LWS_GROUP_SIZE"],
        },
    )
    node_rank: int = field(
        default=0, metadata={"help": "this server's node among --nnodes, from 0", "env_aliases": ["LWS_WORKER_INDEX"]}
    )
    master_addr: str = field(
        default="127.0.0.1",
        metadata={
            "help": "the address of node 0, where the replica's ranks meet (with --nnodes above 1)",
            "env_aliases": ["LWS_LEADER_ADDRESS"],
        },
    )
    auth_token_file: str = field(
        default="", metadata={"help": "file of accepted bearer tokens, one per line (with --auth-token: both)"}
    )
    tls_cert: str = field(default="", metadata={"help": "PEM certificate chain: serve gRPC over TLS (with --tls-key)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: str = field(
        default="", metadata={"help": "PEM CA certificates: require client certificates they signed (mutual TLS)"}
    )
    health_port: int = field(
        default=0, metadata={"help": "also serve grpc.health.v1 alone in plaintext on this port (0: off), for probes"}
    )
    heartbeat_timeout: float = field(
        default=10.0, metadata={"help": "seconds without a heartbeat before a worker is declared hung and replaced"}
    )
    step_timeout: float = field(
        default=120.0,
        metadata={
            "help": "seconds one engine step of up to 512 tokens may run (more for larger steps) before "
            "its worker is declared hung and replaced"
        },
    )
    lora_modules: str = field(
        default="",
        metadata={
            "help": "LoRA adapters (PEFT directories) served from the start, as name=path, several separated by "
            "spaces; a request names one as its model (OpenAI) or adapter (gRPC); without --max-loras, one slot "
            "an adapter named",
            "nargs": "*",
        },
    )
    max_loras: int = field(
        default=0,
        metadata={
            "help": "LoRA adapters resident at once (slots; the least recently used one makes room); "
            "0: adapters off, and the model runs without their side path, unless --lora-modules names some "
            "(then one slot each)"
        },
    )
    max_lora_rank: int = field(default=16, metadata={"help": "the largest LoRA rank an adapter may have"})
    max_resumptions: int = field(
        default=2,
        metadata={"help": "times one stream may move to another worker after its worker failed (0: fail it instead)"},
    )

    def validate(self) -> None:
        if self.device == "cpu":
            from tokenmill_service.contract.plan.cpu_isa import choose

            choose(self.cpu_isa)  # ValueError naming what the CPU lacks
        if self.backend == "triton":
            from tokenmill_service.worker.device import triton_unavailable_reason

            reason = triton_unavailable_reason(self.device)
            if reason:
                raise ValueError(reason)
        if self.kv_cache_dtype == "float16" and (self.backend != "torch" or self.device != "cpu"):
            raise ValueError("--kv-cache-dtype float16 is read by the native CPU attention: --backend torch on the CPU")
        if self.tensor_parallel < 1:
            raise ValueError("--tensor-parallel must be at least 1")
        if self.log_format not in ("", "json", "console"):
            raise ValueError("--log-format must be json or console")
        if self.banner not in ("auto", "on", "off"):
            raise ValueError(f"--banner must be auto, on or off; given {self.banner!r}")
        for name in ("max_queue", "max_batch_size", "max_batch_tokens", "max_batch_tokens_decoding", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("speculative_tokens", "speculative_max_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative")
        if self.max_new_tokens_limit < 1:
            raise ValueError("--max-new-tokens-limit must be at least 1")
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError("--default-max-new-tokens must be between 1 and --max-new-tokens-limit")
        if min(self.workers, self.threads, self.max_top_logprobs, self.http_port) < 0 or self.drain_seconds < 0:
            raise ValueError(
                "--workers, --threads, --drain-seconds, --max-top-logprobs and --http-port must not be negative"
            )
        if self.max_model_len < 0:
            raise ValueError("--max-model-len must not be negative (0: the model's own context)")
        self.chat_template_source()  # an unreadable or broken template stops the server at start
        parse_size(self.kv_cache_memory)
        if self.request_bytes_limit < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1KiB; given {self.max_request_bytes!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both to serve over TLS")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        if self.heartbeat_timeout <= 0 or self.step_timeout <= 0:
            raise ValueError("--heartbeat-timeout and --step-timeout must be above 0 seconds")
        if self.kv_events_endpoint and not re.match(r"^(tcp://.+:\d+|ipc://.+|inproc://.+)$", self.kv_events_endpoint):
            raise ValueError(
                f"--kv-events-endpoint {self.kv_events_endpoint!r} is not a ZMQ endpoint: "
                "tcp://HOST:PORT (tcp://*:5557 to bind), ipc://PATH or inproc://NAME"
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("--nnodes must be at least 1 and --node-rank between 0 and --nnodes - 1")
        if self.nnodes > 1 and self.tensor_parallel < self.nnodes:
            raise ValueError(
                f"--nnodes {self.nnodes} splits one replica's ranks over servers: --tensor-parallel must be at "
                f"least {self.nnodes} (given {self.tensor_parallel})"
            )
        if self.nnodes > 1 and self.workers > 1:
            raise ValueError("--nnodes above 1 serves one replica spanning the nodes: --workers must be 1")
        if self.max_resumptions < 0:
            raise ValueError("--max-resumptions must not be negative")
        self.auth_tokens()  # an unreadable or empty token file stops the server at start
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("--max-loras must not be negative and --max-lora-rank must be at least 1")
        if self.lora_module_paths() and not self.max_loras:
            # As vLLM's users start it: the adapters named are served, one slot each.
            self.max_loras = len(self.lora_module_paths())

    def lora_module_paths(self) -> dict[str, str]:
        """--lora-modules as name -> path."""
        out: dict[str, str] = {}
        for item in self.lora_modules.split():
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes name=path, not {item!r}")
            if name in out:
                raise ValueError(f"--lora-modules names {name!r} twice")
            out[name] = path
        return out

    def auth_tokens(self) -> list[str]:
        """Every accepted bearer token: --auth-token and the lines of --auth-token-file (read now, so a
        rotated file is picked up on restart). Empty: no authentication."""
        tokens = [self.auth_token] if self.auth_token else []
        if self.auth_token_file:
            try:
                with open(self.auth_token_file, encoding="utf-8") as f:
                    tokens += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
            except OSError as exc:
                raise ValueError(f"--auth-token-file {self.auth_token_file}: {exc.strerror}") from None
            if not tokens:
                raise ValueError(f"--auth-token-file {self.auth_token_file} holds no token")
        return tokens

    def chat_template_source(self) -> str | None:
        """The text of --chat-template, checked to compile; None without the flag (the checkpoint's)."""
        if not self.chat_template:
            return None
        try:
            with open(self.chat_template, encoding="utf-8") as f:
                source = f.read()
        except OSError as exc:
            raise ValueError(f"--chat-template {self.chat_template}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"--chat-template {self.chat_template} is not UTF-8 text: {exc.reason}") from None
        from tokenmill_service.contract.chat.chat_template import ChatTemplate, ChatTemplateError

        try:
            ChatTemplate(source)
        except ChatTemplateError as exc:
            raise ValueError(f"--chat-template {self.chat_template}: {exc}") from None
        return source

    def subset(self, cls: type[View], **given: Any) -> View:
        """A ``cls`` (a dataclass) whose fields named as a setting take that setting, the others ``given`` or
        left at their defaults: each process's typed view of the flags is built by its own field list, so a
        field a flag feeds is copied nowhere by hand. A field named as a setting but typed otherwise (another
        unit or meaning: bytes for --kv-cache-memory's text) must be ``given``, or TypeError names it."""
        own = {f.name: f for f in fields(self)}
        values = dict(given)
        for f in fields(cls):
            setting = own.get(f.name)
            if setting is None or f.name in given:
                continue
            if _type_name(f.type) != _type_name(setting.type):
                raise TypeError(
                    f"{cls.__name__}.{f.name} is {_type_name(f.type)}, the setting {_type_name(setting.type)}: "
                    "give its value"
                )
            values[f.name] = getattr(self, f.name)
        return cls(**values)

    @property
    def kv_cache_bytes(self) -> int:
        return parse_size(self.kv_cache_memory)

    @property
    def request_bytes_limit(self) -> int:
        return parse_size(self.max_request_bytes)

    def resolved_log_format(self) -> str:
        return self.log_format or ("console" if sys.stderr.isatty() else "json")

    def resolved_master_port(self) -> int:
        """The first torch.distributed port; 0: free ports picked per replica (one node only)."""
        return self.master_port or (29500 if self.nnodes > 1 else 0)

    def node_ranks(self) -> list[int]:
        """The ranks of a replica this node runs: --tensor-parallel ranks split over --nnodes in order."""
        tp, n = self.tensor_parallel, self.nnodes
        return [rank for rank in range(tp) if rank * n // tp == self.node_rank]

    def resolved_workers(self) -> int:
        if self.nnodes > 1:
            return 1
        if self.workers:
            return self.workers
        if self.device == "cuda":
            return max(1, visible_gpus() // self.tensor_parallel)
        return 1


def _type_name(annotation: Any) -> str:
    """A field's type as written (a string under postponed annotations, else the class's name)."""
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, counted without torch (the server process never loads it):
    CUDA_VISIBLE_DEVICES where set, else the driver's list of GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def env_name(name: str) -> str:
    return "TOKENMILL_" + name.upper()


def env_names(f: Any) -> list[str]:
    """A setting's environment variables: its own name first, then any alias."""
    return [env_name(f.name), *f.metadata.get("env_aliases", [])]


def _switch(text: str) -> bool:
    """A switch's environment value: 1/true/yes/on or 0/false/no/off (any case)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(text)


def _version() -> str:
    from tokenmill_service import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill-server",
        description="Serve a Llama-family model over gRPC (tokenmill.v1.Generation) and an OpenAI-compatible HTTP API.",
        epilog="Every flag can also be set as an environment variable, e.g. --max-queue as TOKENMILL_MAX_QUEUE.",
    )
    parser.add_argument("--version", action="version", version=f"tokenmill-server {_version()}")
    for f in fields(Settings):
        option: choices.Option | None = f.metadata.get("option")  # an enumerated load option: its values' own
        text = option.help if option is not None else f.metadata["help"]
        # The default is shown unless the help already says it.
        shown = "" if "default" in text else f"default: {f.default if f.default != '' else 'none'}, "
        kw: dict[str, Any] = {"help": f"{text} [{shown}env {' or '.join(env_names(f))}]", "default": None}
        if option is not None or "choices" in f.metadata:
            kw["choices"] = option.values() if option is not None else f.metadata["choices"]
        if str(f.type) == "bool":  # a switch: present or not
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action="store_const", const=True, **kw)
            continue
        kw["type"] = {"int": int, "float": float}.get(str(f.type), str)
        if "nargs" in f.metadata:
            kw["nargs"] = f.metadata["nargs"]
        parser.add_argument("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", []), dest=f.name, **kw)
    return parser


_PARSERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "bool": _switch}


def load_settings(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    for f in fields(Settings):
        value = getattr(args, f.name)
        given = next((name for name in env_names(f) if name in env), None)
        if value is None and given is not None:
            raw = env[given]
            try:
                value = _PARSERS.get(str(f.type), str)(raw)
            except ValueError:
                raise ValueError(f"{given}={raw!r} is not a valid {f.type}") from None
        if isinstance(value, list):
            value = " ".join(value)
        if value is not None:
            values[f.name] = value
    settings = Settings(**values)
    settings.validate()
    return settings
