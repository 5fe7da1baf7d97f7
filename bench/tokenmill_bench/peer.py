"""The optional llama.cpp peer column: llama-cpp-python on the same GGUF, single stream, same prompt and length.

Only run when ``llama_cpp`` is importable; it is never installed by this project (it compiles for minutes).
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

from tokenmill_bench.load import RequestRecord, prompt_ids
from tokenmill_bench.stats import summarize_ms


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def run_llama_cpp(
    model_path: Path, *, prompt_tokens: int, output_tokens: int, requests: int, vocab_size: int
) -> dict[str, Any]:
    """Greedy generation of exactly ``output_tokens`` tokens (EOS is not checked: llama_cpp's ``generate``
    yields until the caller stops), timed per token like the gRPC streams; one warm-up run first."""
    import llama_cpp  # type: ignore[import-not-found,unused-ignore]  # optional, untyped

    threads = os.cpu_count() or 1
    llm = llama_cpp.Llama(
        model_path=str(model_path),
        n_ctx=max(512, prompt_tokens + output_tokens + 8),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    records: list[RequestRecord] = []
    for index in range(-1, requests):  # index -1 is the warm-up
        ids = prompt_ids(prompt_tokens, max(index, 0) + 10_000, vocab_size)
        llm.reset()
        record = RequestRecord(index=index, sent=time.perf_counter())
        for _token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            record.arrivals.append(time.perf_counter())
            record.counts.append(1)
            if len(record.arrivals) >= output_tokens:
                break
        record.done = time.perf_counter()
        if index >= 0:
            records.append(record)
    decode_tokens = sum(r.decode_span()[0] for r in records)
    decode_seconds = sum(r.decode_span()[1] for r in records)
    ttft = [t for r in records if (t := r.ttft_s) is not None]
    itl = [g for r in records for g in r.inter_token_s()]
    return {
        "name": "llama-cpp-python",
        "version": getattr(llama_cpp, "__version__", None),
        "threads": threads,
        "requests": len(records),
        "single_stream_tok_s": decode_tokens / decode_seconds if decode_seconds > 0 else None,
        "ttft_ms": summarize_ms(ttft),
        "itl_ms": summarize_ms(itl),
    }
