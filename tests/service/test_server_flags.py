"""The flags people bring from vLLM and llama.cpp, on a real server: --served-model-name,
--chat-template, --max-model-len, --api-key, --metrics-without-auth and --json-schema-permissive (some given
as flags, some as TOKENMILL_* variables),
and the 401 that says how to authenticate.

/tokenize and /detokenize in the default configuration are in test_openai_http.py.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from tests.server_process import ServerProcess
from tokenmill_client import AuthenticationError, Client
from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_client._proto import generate_pb2_grpc as pb_grpc
from tokenmill_service.contract.config import load_settings

KEY = "sk-local"
NAME = "smol-chat"
CONTEXT = 256
# The checkpoint's ChatML, with a marker the checkpoint's own template never writes.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\nAnswer in French:{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("flags") / "template.jinja"
    template.write_text(TEMPLATE)
    env = {"TOKENMILL_MAX_MODEL_LEN": str(CONTEXT), "TOKENMILL_CHAT_TEMPLATE": str(template)}
    env["TOKENMILL_METRICS_WITHOUT_AUTH"] = "true"
    env["TOKENMILL_JSON_SCHEMA_PERMISSIVE"] = "true"
    proc = ServerProcess("--served-model-name", NAME, "--api-key", KEY, env=env, metrics=True).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key=KEY, max_retries=0, timeout=600) as c:
        yield c


def post(url: str, body: dict[str, Any], token: str | None = KEY) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def test_the_served_model_name_is_what_models_responses_and_model_info_say(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    # Whatever name the request used: the server has one model, and says its name.
    reply = client.completions.create(model="anything", prompt="Hello", max_tokens=1)
    assert reply.model == NAME
    streamed = list(client.completions.create(model="anything", prompt="Hello", max_tokens=2, stream=True))
    assert {c.model for c in streamed} == {NAME}
    with Client(server.address, token=KEY) as grpc_client:
        info = grpc_client.model_info()
    assert info.name == NAME and info.context_length == CONTEXT


def test_the_chat_template_file_replaces_the_checkpoints(server: ServerProcess, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    status, tokenized, _ = post(server.http_url + "/tokenize", {"messages": messages})
    assert status == 200
    status, text, _ = post(server.http_url + "/detokenize", {"tokens": tokenized["tokens"]})
    assert status == 200 and text["prompt"].endswith("<|im_start|>assistant\nAnswer in French:")
    with Client(server.address, token=KEY) as grpc_client:
        assert list(grpc_client.tokenize([("user", "Hi")]).ids) == tokenized["tokens"]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens == tokenized["count"]


def test_max_model_len_caps_the_context(server: ServerProcess, client: openai.OpenAI) -> None:
    """A long prompt without a limit gets the room left (HTTP and gRPC); a limit the caller set is theirs: too
    large for the room left is an error naming it, not a shorter answer. (At a small --max-model-len so that the
    prompt is short; the rule is the same at the default context.)"""
    left = 5
    prompt = [28] * (CONTEXT - left)
    reply = client.completions.create(model=NAME, prompt=prompt, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage is not None
    assert reply.usage.completion_tokens == left and reply.usage.total_tokens == CONTEXT
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt=prompt, max_tokens=left + 1)
    assert f"must be <= {CONTEXT}" in err.value.message and "max_tokens" in err.value.message
    assert "max_new_tokens" not in err.value.message
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "max_tokens"
    assert err.value.body["code"] == "context_length_exceeded"

    auth = (("authorization", f"Bearer {KEY}"),)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), stopping=pb.StoppingParams(ignore_eos=True))
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        last = list(stub.Generate(request, timeout=600, metadata=auth))[-1]
        assert last.finish_reason == pb.FINISH_REASON_CONTEXT_LIMIT and last.usage.completion_tokens == left
        request.stopping.max_new_tokens = left + 1
        with pytest.raises(grpc.RpcError) as rpc_err:
            list(stub.Generate(request, timeout=600, metadata=auth))
    assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"given {CONTEXT - left} prompt tokens and max_new_tokens {left + 1}" in rpc_err.value.details()
    status, tokenized, _ = post(server.http_url + "/tokenize", {"prompt": "Hello"})
    assert status == 200 and tokenized["max_model_len"] == CONTEXT


def test_api_key_guards_every_route_and_a_401_names_the_bearer_scheme(server: ServerProcess) -> None:
    wrong = openai.OpenAI(base_url=server.http_url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with wrong, pytest.raises(openai.AuthenticationError) as err:
        wrong.completions.create(model=NAME, prompt="Hello", max_tokens=1)
    assert err.value.response.headers["www-authenticate"] == "Bearer"
    for route, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [28]})):
        status, reply, headers = post(server.http_url + route, body, token=None)
        assert status == 401 and reply["error"]["type"] == "authentication_error", route
        assert headers["www-authenticate"] == "Bearer"
    with Client(server.address, max_retries=0) as anonymous, pytest.raises(AuthenticationError):
        anonymous.model_info()


def test_metrics_without_auth_leaves_metrics_open_on_both_ports_and_nothing_else(server: ServerProcess) -> None:
    for url in (f"http://127.0.0.1:{server.metrics_port}/metrics", server.http_url + "/metrics"):
        with urllib.request.urlopen(url, timeout=30) as reply:
            assert reply.status == 200 and "tokenmill_requests_total" in reply.read().decode(), url
    status, _, _ = post(server.http_url + "/tokenize", {"prompt": "Hi"}, token=None)
    assert status == 401


def test_every_new_flag_is_also_an_environment_variable(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    env = {
        "TOKENMILL_SERVED_MODEL_NAME": NAME,
        "TOKENMILL_CHAT_TEMPLATE": str(template),
        "TOKENMILL_MAX_MODEL_LEN": "512",
        "TOKENMILL_API_KEY": KEY,
    }
    settings = load_settings([], env)
    assert (settings.served_model_name, settings.max_model_len, settings.auth_token) == (NAME, 512, KEY)
    assert settings.chat_template_source() == TEMPLATE
    # The flag wins over the variable, and --api-key is --auth-token.
    assert load_settings(["--api-key", "other"], env).auth_token == "other"
    assert load_settings(["--auth-token", "third"], {}).auth_token == "third"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    for bad, message in ((str(tmp_path / "missing.jinja"), "No such file"), (str(broken), "does not compile")):
        with pytest.raises(ValueError, match=message):
            load_settings(["--chat-template", bad], {})
    with pytest.raises(ValueError, match="--max-model-len"):
        load_settings(["--max-model-len", "-1"], {})


def test_a_server_open_beyond_this_machine_without_a_token_warns_at_start() -> None:
    from tokenmill_service.front.main import loopback

    assert loopback("127.0.0.1") and loopback("::1") and loopback("[::1]") and loopback("localhost")
    assert not loopback("0.0.0.0") and not loopback("::") and not loopback("10.1.2.3") and not loopback("my-host")
    proc = ServerProcess(host="0.0.0.0").launch()
    try:
        deadline = time.monotonic() + 120
        while "listening_without_auth" not in proc.logs() and time.monotonic() < deadline:
            time.sleep(0.2)
        line = next(json.loads(x) for x in proc.logs().splitlines() if "listening_without_auth" in x)
    finally:
        proc.stop()
    assert line["level"] == "warning" and line["host"] == "0.0.0.0" and "--auth-token" in line["message"]


def test_json_schema_permissive_reads_a_schema_as_json_schema_does(client: openai.OpenAI) -> None:
    """An array schema without items admits any items here (the default server refuses this one: closed, it
    admits no item, yet needs one: test_structured_clients.py)."""
    reply = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Numbers."}],
        max_tokens=12,
        temperature=0,
        extra_body={"guided_json": {"type": "array", "minItems": 1}},
    )
    assert (reply.choices[0].message.content or "").startswith("[")
    assert load_settings([], {"TOKENMILL_JSON_SCHEMA_PERMISSIVE": "true"}).json_schema_permissive
    assert load_settings(["--json-schema-permissive"], {}).json_schema_permissive
    assert not load_settings([], {}).json_schema_permissive
