"""The enumerated load options, one place each: the values a flag takes and what each means.

``Settings`` (config.py) takes each flag's choices and help text from here, ``resolve_plan`` checks a
``LoadOptions`` against them, and the registries that implement a value by name check that it is
declared here when an implementation registers (the ops backends in worker/kernels/interface.py, the
quantization methods in worker/layers/quant/base.py; tests/engine/test_seams.py holds every declared value to
an implementation). Torch-free, names only: the server process reads it; the implementations register
in the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill_service.contract.plan.cpu_isa import INSTRUCTION_SETS


@dataclass(frozen=True, slots=True)
class Choice:
    value: str
    help: str
    # Offered as a flag's value (False: a name the plan chooses by itself, as the native backend).
    selectable: bool = True


@dataclass(slots=True)
class Option:
    flag: str  # "--backend"
    lead: str  # what the flag sets, before its values
    choices: tuple[Choice, ...]
    tail: str = ""  # said after the values

    def declare(self, value: str, help: str) -> None:
        """One more value, for an implementation registered outside the package (a worker's plug-in, a test's):
        the plan takes it; the server's flag, which never sees the plug-in, does not offer it."""
        if not self.declares(value):
            self.choices = (*self.choices, Choice(value, help, selectable=False))

    def values(self, selectable_only: bool = True) -> list[str]:
        return [c.value for c in self.choices if c.selectable or not selectable_only]

    def check(self, value: str) -> None:
        """ValueError unless ``value`` is one of the flag's values."""
        if value not in self.values():
            raise ValueError(f"{self.flag} must be one of {', '.join(self.values())}, not {value!r}")

    def declares(self, name: str) -> bool:
        """Whether ``name`` is a value of this option, offered or the plan's own (for a registry)."""
        return name in self.values(selectable_only=False)

    @property
    def help(self) -> str:
        described = "; ".join(f"{c.value} = {c.help}" for c in self.choices if c.selectable)
        return f"{self.lead}: {described}" + (f". {self.tail}" if self.tail else "")


DTYPE = Option(
    "--dtype",
    "activations (and unquantized weights)",
    (
        Choice(
            "auto", "float32 with quantized weights, else bfloat16 where the CPU/GPU does it natively, else float32"
        ),
        Choice("float32", "float32"),
        Choice("bfloat16", "bfloat16"),
    ),
)
BACKEND = Option(
    "--backend",
    "compute backend",
    (
        Choice(
            "torch", "the best ops torch runs here: tokenmill's native CPU kernels where they serve, else plain torch"
        ),
        Choice("triton", "Triton kernels on a GPU (or in Triton's interpreter, TRITON_INTERPRET=1)"),
        Choice("native", "tokenmill's native CPU kernels (chosen by the plan under torch)", selectable=False),
    ),
)
QUANTIZATION = Option(
    "--quantization",
    "weight-only quantization of the linear layers",
    (
        Choice(
            "auto",
            "as the checkpoint stores them (a GGUF's blocks multiplied as stored by tokenmill's CPU kernels where "
            "they can be built, on any CPU: gguf-vnni, else gguf; a GGUF's k-quants by gguf-kquant; without a C++ "
            "compiler dense float32 on a CPU, Q4_0/Q4_1 as int4 on a GPU; FP8 block-scaled safetensors, "
            "DeepSeek-V3's, by fp8-block)",
        ),
        Choice("gguf-vnni", "a GGUF's blocks, integer products on 16-bit fixed-point activations, or fail"),
        Choice("gguf-kquant", "a GGUF's k-quant blocks as stored, or fail"),
        Choice("gguf", "a GGUF's blocks, float32 products, or fail"),
        Choice("fp8-block", "FP8 block-scaled weights as stored, or fail"),
        Choice("none", "dense"),
        Choice("int8", "int8 weights"),
        Choice("int4", "int4 weights in groups of 32 (the output head int8)"),
    ),
)
ACTIVATIONS = Option(
    "--activations",
    "what the native integer-product kernels (gguf-vnni, gguf-kquant) round the activations to per block of 32",
    (
        Choice("auto", "16-bit fixed point (logprobs within about 1e-3 of float32)"),
        Choice("int8", "8-bit integers as llama.cpp's Q8_0 does (one byte product a weight: faster, less precise)"),
    ),
    "Refused where no layer is served by those kernels. Either keeps a sequence's results independent of its batch",
)
CPU_ISA = Option(
    "--cpu-isa",
    "the instruction set tokenmill's CPU kernels are built for",
    (
        Choice("auto", "the fastest this CPU runs"),
        *(Choice(s.name, s.description) for s in reversed(INSTRUCTION_SETS)),
    ),
    "Every one gives the same tokens and logprobs bit for bit; forcing one measures it. One the CPU lacks is "
    "refused at start",
)
KV_CACHE_DTYPE = Option(
    "--kv-cache-dtype",
    "what the KV cache stores",
    (
        Choice("auto", "the activations' dtype"),
        Choice("float32", "float32 (with float32 activations)"),
        Choice(
            "float16",
            "half the bytes a decode step reads from the cache and twice the tokens a pool holds, for native "
            "attention (CPU, float32 activations; logprobs move by about 1e-3)",
        ),
    ),
)
COMPILE = Option(
    "--compile",
    "compile the forward pass with torch.compile, every graph built during start-up",
    (
        Choice(
            "auto",
            "where it can (CPU, torch backend, one rank, a C++ compiler), else eager with a log line saying why; "
            "a compile that fails at start-up is planned without, and the plan says why",
        ),
        Choice("off", "never"),
    ),
    "Off by default: on CPU it measured no faster (bench/history.md) and adds 10-40 s to a worker's start",
)
SPECULATIVE_METHOD = Option(
    "--speculative-method",
    "where draft tokens come from",
    (
        Choice("ngram", "prompt lookup: the sequence's own history"),
        Choice(
            "mtp",
            "the checkpoint's multi-token-prediction layers, DeepSeek-V3's; --speculative-tokens of them chained, "
            "1 to 3 pays best",
        ),
    ),
)
