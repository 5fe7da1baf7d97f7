"""POST /v1/embeddings on a real server, driven by the openai SDK: a tiny BERT (Hugging Face directory, mean pooling),
the same BERT as a GGUF file (CLS pooling) and a tiny Qwen3 with last-token pooling each give sentence-transformers'
vectors over the same weights within 1e-5; an input's vector is the same bits alone and in a batch; dimensions,
base64, usage and the refusals (an encoder asked to generate, inputs past the context, empty inputs)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tests.embedding_checkpoints import (
    TEXTS,
    sentence_transformer,
    write_bert_gguf,
    write_tiny_bert,
    write_tiny_qwen3_embedding,
)
from tests.server_process import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("sentence_transformers")

FLAGS = ("--dtype", "float32", "--quantization", "none", "--drain-seconds", "1")
ATOL = 1e-5


class Served:
    """A server on one embedding model and the sentence-transformers model it must agree with."""

    def __init__(self, server: ServerProcess, reference: Any) -> None:
        self.server = server
        self.reference = reference
        self.client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)

    def vectors(self, inputs: list[str], **kwargs: Any) -> np.ndarray:
        reply = self.client.embeddings.create(model="tokenmill", input=inputs, encoding_format="float", **kwargs)
        assert [d.index for d in reply.data] == list(range(len(inputs)))
        return np.array([d.embedding for d in reply.data], dtype=np.float32)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("bert-source"))


@pytest.fixture(scope="module")
def bert(bert_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    reference = sentence_transformer(bert_dir, "mean")
    directory = tmp_path_factory.mktemp("bert-st")
    reference.save(str(directory))
    with ServerProcess("--model", str(directory), *FLAGS) as server:
        yield Served(server, reference)


@pytest.fixture(scope="module")
def bert_gguf(bert_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = write_bert_gguf(bert_dir, tmp_path_factory.mktemp("bert-gguf") / "tiny-bert.gguf", pooling_type=2)
    with ServerProcess("--model", str(path), *FLAGS) as server:
        yield Served(server, sentence_transformer(bert_dir, "cls"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory, reference = write_tiny_qwen3_embedding(tmp_path_factory.mktemp("qwen3") / "qwen3-embedding")
    with ServerProcess("--model", str(directory), *FLAGS) as server:
        yield Served(server, reference)


@pytest.mark.parametrize("model", ["bert", "bert_gguf", "qwen3"])
def test_the_vectors_are_sentence_transformers_within_1e_5(model: str, request: pytest.FixtureRequest) -> None:
    served: Served = request.getfixturevalue(model)
    expected = served.reference.encode(TEXTS, convert_to_numpy=True)
    got = served.vectors(TEXTS)
    assert got.shape == expected.shape
    assert float(np.abs(got - expected).max()) <= ATOL
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("model", ["bert", "qwen3"])
def test_an_inputs_vector_is_the_same_bits_alone_and_in_a_batch(model: str, request: pytest.FixtureRequest) -> None:
    served: Served = request.getfixturevalue(model)
    batch = served.vectors(TEXTS)
    for i, text in enumerate(TEXTS):
        assert served.vectors([text])[0].tobytes() == batch[i].tobytes()


def test_base64_is_little_endian_float32_and_the_sdk_decodes_it(bert: Served) -> None:
    floats = bert.vectors(TEXTS[:2])
    # The SDK asks for base64 itself when not told, and decodes it.
    decoded = bert.client.embeddings.create(model="tokenmill", input=TEXTS[:2])
    assert np.array([d.embedding for d in decoded.data], dtype=np.float32).tobytes() == floats.tobytes()
    raw = post(bert.server, {"input": TEXTS[0], "encoding_format": "base64"})[1]
    assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").tobytes() == floats[0].tobytes()


def test_dimensions_truncate_and_renormalize(qwen3: Served) -> None:
    whole = qwen3.vectors(TEXTS[:2])
    cut = qwen3.vectors(TEXTS[:2], dimensions=16)
    assert cut.shape == (2, 16)
    expected = whole[:, :16] / np.linalg.norm(whole[:, :16], axis=1, keepdims=True)
    assert float(np.abs(cut - expected).max()) <= 1e-6


def test_usage_counts_every_inputs_tokens_special_tokens_included(bert: Served) -> None:
    reply = bert.client.embeddings.create(model="tokenmill", input=TEXTS)
    tokenizer = bert.reference.tokenizer
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert reply.model == bert.client.models.list().data[0].id


def test_token_ids_are_embedded_as_given(bert: Served) -> None:
    ids = bert.reference.tokenizer(TEXTS[0])["input_ids"]
    reply = bert.client.embeddings.create(model="tokenmill", input=[ids], encoding_format="float")
    assert np.array(reply.data[0].embedding, dtype=np.float32).tobytes() == bert.vectors([TEXTS[0]])[0].tobytes()


def post(server: ServerProcess, body: dict[str, Any], path: str = "/v1/embeddings") -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        server.http_url + path, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["a", ""]}, "input", "input[1]"),
        ({"input": "the cat", "dimensions": 33}, "dimensions", "more than this model's 32"),
        ({"input": "the " * 80}, "input", "maximum context length is 64 tokens"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float, base64"),
        ({"input": "a", "colour": 1}, "colour", "Unrecognized"),
    ],
    ids=["empty-list", "empty-string", "empty-item", "dimensions", "too-long", "format", "unknown"],
)
def test_bad_bodies_are_refused_with_a_400_naming_the_field(
    bert: Served, body: dict[str, Any], param: str, says: str
) -> None:
    status, reply = post(bert.server, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and says in reply["error"]["message"], reply


def test_the_sdk_sees_a_too_long_input_as_a_bad_request(bert: Served) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        bert.client.embeddings.create(model="tokenmill", input=["the " * 80])


def test_an_encoder_refuses_to_generate_on_every_route(bert: Served) -> None:
    from tokenmill_client._proto import generate_pb2 as pb
    from tokenmill_client._proto import generate_pb2_grpc as pb_grpc

    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ):
        status, reply = post(bert.server, body, path)
        assert status == 400 and "embeds only" in reply["error"]["message"], reply
    with grpc.insecure_channel(bert.server.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "embeds only" in (caught.value.details() or "")
