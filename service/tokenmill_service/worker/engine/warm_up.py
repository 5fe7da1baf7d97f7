"""A new engine's first steps, run before it serves: so that the first caller pays for no lazy set-up.

Compiled (``--compile auto``), the warm-up builds every graph: each region has one graph for any number
of tokens (worker/engine/compile.py), and tests/engine/test_compile.py checks that no step shape builds another
afterwards. Where building them fails, the load plan is made again without compiling (``replan``): the
new plan says why, and the engine is made again from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import structlog

from tokenmill_service.contract.plan.plan import LoadPlan
from tokenmill_service.contract.request import GenerationRequest, StoppingParams
from tokenmill_service.worker.engine.compile import compiled_graphs
from tokenmill_service.worker.engine.llm_engine import LLMEngine

log = structlog.get_logger(__name__)


def warm_up(engine: LLMEngine) -> None:
    """One real prefill and decode."""
    tokens = engine.tokenizer.encode("Hello")
    engine.add_request(GenerationRequest("warmup", tokens, stopping=StoppingParams(max_new_tokens=2, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()


def warmed_engine(
    make_engine: Callable[[int | None], LLMEngine], replan: Callable[[Mapping[str, str]], LoadPlan]
) -> LLMEngine:
    """``make_engine(None)`` warmed up. Should its compiled step fail to build, ``replan`` makes the model's
    plan without it (the choice -> what it raised) and ``make_engine(num_blocks)`` the engine again, its KV
    cache pool as large as the first one's (the size the other ranks took)."""
    engine = make_engine(None)
    if engine.runner.executor.kind != "compiled":
        warm_up(engine)
        return engine
    started = time.monotonic()
    try:
        warm_up(engine)
    except Exception as exc:  # noqa: BLE001 - whatever the compiler raised: the plan is made without it
        error = str(exc).splitlines()[0] if str(exc) else repr(exc)
        plan = replan({"compiled": error})
        log.warning("compile_failed", error=error, running=plan.executor.value, reason=plan.skipped.get("compile"))
        num_blocks = engine.block_manager.num_blocks
        del engine
        engine = make_engine(num_blocks)
        warm_up(engine)
        return engine
    log.info("compiled", graphs=compiled_graphs(), seconds=round(time.monotonic() - started, 1))
    return engine
