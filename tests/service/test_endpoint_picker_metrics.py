"""The gauges the Gateway API Inference Extension's endpoint picker scrapes by default, under vLLM's
names and labels, on both Prometheus endpoints of a running server (default configuration)."""

from __future__ import annotations

import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import ServerProcess

PICKER_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(body)
    }


def test_the_endpoint_pickers_gauges_are_served_under_vllms_names_and_labels(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    # One request through the route the gateway sends to, so the cache has been used.
    client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0)
    for url in (f"http://127.0.0.1:{server.metrics_port}/metrics", f"{server.http_url}/metrics"):
        families = scrape(url)
        for name in PICKER_GAUGES:
            samples = families[name]
            # One series per server, labelled with the name requests ask for (what the picker matches).
            assert [labels for labels, _ in samples] == [{"model_name": model}], name
        # Nothing is running now: the request above has finished.
        assert families["vllm:num_requests_waiting"][0][1] == 0
        assert families["vllm:num_requests_running"][0][1] == 0
        usage = families["vllm:kv_cache_usage_perc"][0][1]
        assert 0.0 <= usage <= 1.0
        assert usage == families["tokenmill_kv_cache_usage_ratio"][0][1]
        [(labels, value)] = families["vllm:cache_config_info"]
        assert value == 1
        assert set(labels) == {"block_size", "num_gpu_blocks", "enable_prefix_caching"}
        assert int(labels["block_size"]) == 16  # --block-size's default
        assert int(labels["num_gpu_blocks"]) == families["tokenmill_kv_blocks_total"][0][1] > 0
        # tokenmill's own names are still there beside them.
        assert "tokenmill_queue_size" in families
        # The adapters' series (none running, adapters off by default), with vLLM's labels.
        [(labels, _)] = families["vllm:lora_requests_info"]
        assert labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "0"}
