"""Prometheus metrics: one documented series for every stage a request goes through.

Each server owns its own registry (so tests can run several servers in one process); the
gauges read the router's live state when scraped.

Beside tokenmill's own names, the gauges the Gateway API Inference Extension's endpoint picker
scrapes by default are served under vLLM's names and labels (its model-server protocol):
``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (0 to 1),
each labelled ``model_name``, and ``vllm:cache_config_info`` (always 1; labels ``block_size`` and
``num_gpu_blocks``, the pool's blocks over every worker), and ``vllm:lora_requests_info`` (the adapters
of running and waiting requests, and ``--max-loras``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# A WSGI application (wsgiref.types has the precise type from Python 3.11 on).
WSGIApp = Callable[[dict[str, Any], Any], Iterable[bytes]]

# The *_created series (a timestamp per counter and histogram) only add noise to every scrape.
disable_created_metrics()  # type: ignore[no-untyped-call]  # (prometheus_client leaves it unannotated)

# Latency buckets from 5 ms to 2 minutes.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tokenmill_requests", "Generate calls by final gRPC status code", ["code"], registry=r)
        self.queue_time = Histogram(
            "tokenmill_queue_seconds", "Time from arrival until the request first runs", buckets=_LATENCY, registry=r
        )
        self.time_to_first_token = Histogram(
            "tokenmill_time_to_first_token_seconds",
            "Time from arrival until the first generated token",
            buckets=_LATENCY,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "tokenmill_inter_token_latency_seconds",
            "Time between consecutive streamed responses of a request, per token",
            buckets=_ITL,
            registry=r,
        )
        self.request_duration = Histogram(
            "tokenmill_request_duration_seconds", "Whole Generate call duration", buckets=_LATENCY, registry=r
        )
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("tokenmill_generated_tokens", "Tokens generated", registry=r)
        self.worker_restarts = Counter("tokenmill_worker_restarts", "Worker processes restarted", registry=r)
        self.queue_size = Gauge("tokenmill_queue_size", "Requests waiting to run, all workers", registry=r)
        self.running = Gauge("tokenmill_running_batch_size", "Sequences in the running batches", registry=r)
        self.kv_blocks_used = Gauge("tokenmill_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge("tokenmill_kv_blocks_total", "KV cache blocks in the pools", registry=r)
        self.workers_serving = Gauge("tokenmill_workers_serving", "Workers loaded and serving", registry=r)
        self.kv_cache_usage = Gauge(
            "tokenmill_kv_cache_usage_ratio", "Share of the KV cache blocks in use, all workers (0 to 1)", registry=r
        )
        self.prefix_cache_hit_rate = Gauge(
            "tokenmill_prefix_cache_hit_rate",
            "Share of prompt tokens found in the prefix cache since the workers started (0 to 1)",
            registry=r,
        )
        self.draft_acceptance_rate = Gauge(
            "tokenmill_draft_acceptance_rate",
            "Share of speculative draft tokens (--speculative-tokens) kept since the workers started (0 to 1)",
            registry=r,
        )
        self.compiled_graphs = Gauge(
            "tokenmill_compiled_graphs",
            "Graphs torch.compile built in the serving workers (--compile); all are built before a worker is "
            "ready, so this does not move while serving",
            registry=r,
        )
        self.build_info = Gauge(
            "tokenmill_build_info",
            "Always 1; the labels say what is serving",
            ["version", "model", "backend", "dtype", "quantization"],
            registry=r,
        )

        # The endpoint picker's defaults (vLLM's names; see the module's docstring).
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to run, all workers", ["model_name"], registry=r
        )
        self.vllm_running = Gauge(
            "vllm:num_requests_running", "Requests in the running batches, all workers", ["model_name"], registry=r
        )
        self.vllm_kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Share of the KV cache blocks in use, all workers (0 to 1; 1 is 100 percent)",
            ["model_name"],
            registry=r,
        )
        self.vllm_cache_config = Gauge(
            "vllm:cache_config_info",
            "Always 1; the labels describe the KV cache (its blocks over every worker)",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=r,
        )

    def bind_state(self, read: Callable[[], dict[str, int]]) -> None:
        """Let the gauges read live engine state (summed over workers) at scrape time."""
        self.queue_size.set_function(lambda: read()["waiting"])
        self.running.set_function(lambda: read()["running"])
        self.kv_blocks_used.set_function(lambda: read()["kv_blocks_used"])
        self.kv_blocks_total.set_function(lambda: read()["kv_blocks_total"])
        self.workers_serving.set_function(lambda: read()["serving"])
        self.kv_cache_usage.set_function(lambda: _ratio(read(), "kv_blocks_used", "kv_blocks_total"))
        self.prefix_cache_hit_rate.set_function(lambda: _ratio(read(), "prefix_cache_hits", "prefix_cache_queries"))
        self.compiled_graphs.set_function(lambda: read()["compiled_graphs"])
        self.draft_acceptance_rate.set_function(
            lambda: _ratio(read(), "draft_tokens_accepted", "draft_tokens_proposed")
        )

    def bind_adapters(self, read: Callable[[], AdapterState]) -> None:
        """LoRA adapter series, read at scrape time: vLLM's ``vllm:lora_requests_info`` (its labels name the
        adapters of running and waiting requests) and ``tokenmill_lora_adapters_loaded``."""
        self.registry.register(_AdapterCollector(read))

    def set_build_info(self, version: str, model: str, backend: str, dtype: str, quantization: str) -> None:
        self.build_info.clear()
        self.build_info.labels(version, model, backend, dtype, quantization).set(1)

    def bind_endpoint_picker(
        self, read: Callable[[], dict[str, int]], model_name: str, block_size: int, num_blocks: int
    ) -> None:
        """Serve the endpoint picker's gauges (vLLM's names) for `model_name`, the name requests use."""
        for gauge in (self.vllm_waiting, self.vllm_running, self.vllm_kv_cache_usage, self.vllm_cache_config):
            gauge.clear()
        self.vllm_waiting.labels(model_name).set_function(lambda: read()["waiting"])
        self.vllm_running.labels(model_name).set_function(lambda: read()["running"])
        self.vllm_kv_cache_usage.labels(model_name).set_function(
            lambda: _ratio(read(), "kv_blocks_used", "kv_blocks_total")
        )
        self.vllm_cache_config.labels(str(block_size), str(num_blocks), "True").set(1)

    def serve(self, port: int, host: str = "0.0.0.0", authorized: Callable[[str | None], bool] | None = None) -> None:
        """Serve /metrics on its own port, in a thread. ``authorized`` (given the Authorization header)
        guards it: a scrape it refuses gets 401 with ``WWW-Authenticate: Bearer``."""
        app = make_wsgi_app(self.registry)
        if authorized is not None:
            app = _guarded(app, authorized)
        server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not worth a log line


def _guarded(app: WSGIApp, authorized: Callable[[str | None], bool]) -> WSGIApp:
    def guarded(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if authorized(environ.get("HTTP_AUTHORIZATION")):
            return app(environ, start_response)
        body = b"missing or wrong bearer token in the Authorization header\n"
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer"), ("Content-Length", str(len(body)))],
        )
        return [body]

    return guarded


# The adapters of the running and the waiting requests, the slots per worker and the adapters loaded.
AdapterState = tuple[list[str], list[str], int, int]


class _AdapterCollector(Collector):
    def __init__(self, read: Callable[[], AdapterState]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:
        running, waiting, max_loras, loaded = self.read()
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (as vLLM's: the labels name the adapters; the value is when read)",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric([",".join(running), ",".join(waiting), str(max_loras)], time.time())
        yield info
        yield GaugeMetricFamily("tokenmill_lora_adapters_loaded", "LoRA adapters served (loaded and usable)", loaded)
        yield GaugeMetricFamily(
            "tokenmill_lora_adapters_running",
            "Distinct LoRA adapters of the running requests, all workers",
            len(running),
        )


def _ratio(state: dict[str, int], part: str, whole: str) -> float:
    return state[part] / state[whole] if state[whole] else 0.0
