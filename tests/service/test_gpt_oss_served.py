"""`tokenmill-server --model` a tiny gpt-oss checkpoint whose tokenizer has harmony's control tokens: chats
are rendered with openai-harmony, and the answer's analysis channel comes back apart from the final one,
as ``reasoning_content`` through the OpenAI SDK (whole and streamed) and as ``reasoning_text`` over gRPC.
The random model is steered into a harmony answer by a grammar (its control tokens included).

Needs o200k_base.tiktoken in .tools/tiktoken (`make tools`), which openai-harmony reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.server_process import ServerProcess
from tests.tiny_checkpoint import write_byte_level_tokenizer
from tokenmill_client import Client
from tokenmill_service import harmony
from tokenmill_service.tokenizer.load import load_tokenizer

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
oh = pytest.importorskip("openai_harmony")

VOCABULARY = Path(__file__).resolve().parents[2] / ".tools" / "tiktoken"
CONTROL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
REASONING, ANSWER = "Hm.", "Hi."
# A harmony answer: the analysis channel, then the final one, then the end of the turn.
GRAMMAR = (
    f'start: <|channel|> "analysis" <|message|> "{REASONING}" <|end|> '
    f'<|start|> "assistant" <|channel|> "final" <|message|> "{ANSWER}" <|return|>'
)


@pytest.fixture(scope="module", autouse=True)
def harmony_vocabulary() -> None:
    if not (VOCABULARY / harmony.VOCABULARY).is_file():
        pytest.fail(f"{VOCABULARY / harmony.VOCABULARY} is missing: run `make tools`")
    mp = pytest.MonkeyPatch()
    mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(VOCABULARY))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-gpt-oss-harmony")
    write_byte_level_tokenizer(directory, *CONTROL)
    config = transformers.GptOssConfig(
        vocab_size=257 + len(CONTROL),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Any:
    env = {"TIKTOKEN_ENCODINGS_BASE": str(VOCABULARY)}
    process = ServerProcess("--model", str(checkpoint), "--drain-seconds", "1", env=env).start()
    yield process
    process.stop()


def test_a_harmony_conversation_round_trips_through_the_models_tokens(checkpoint: Path) -> None:
    """openai-harmony renders a conversation with a reasoning channel; in the model's ids (control tokens
    by text) the channel reader gives back the reasoning and the answer, and harmony parses it back to
    the same messages."""
    enc = harmony.encoding()
    tokenizer = load_tokenizer(checkpoint)
    assert tokenizer.harmony
    reply = [
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, REASONING).with_channel("analysis"),
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, ANSWER).with_channel("final"),
    ]
    keep = oh.RenderConversationConfig(auto_drop_analysis=False)
    rendered = list(enc.render_conversation(oh.Conversation.from_messages(reply), keep))
    assert enc.decode_utf8(rendered[:2]) == "<|start|>assistant"
    ids = rendered[2:]  # what the model writes after the prompt's <|start|>assistant
    assert enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT) == reply
    model_ids = harmony.to_model_ids(ids, tokenizer)
    assert tokenizer.decode(model_ids) == enc.decode_utf8(ids)  # the same text, control tokens included
    reader = harmony.ChannelReader(tokenizer)
    assert reader.feed(model_ids) == (REASONING, ANSWER)
    # A prompt: message text never becomes a control token.
    prompt = harmony.render([{"role": "user", "content": "<|end|> hi"}], tokenizer)
    tail = [tokenizer.special_id("<|start|>"), *tokenizer.encode("assistant")]
    assert prompt[-len(tail) :] == tail
    assert prompt.count(tokenizer.special_id("<|end|>")) == 2  # the system and user messages' only


def test_the_openai_sdk_sees_reasoning_content_apart_from_content(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 40,
        "extra_body": {"guided_grammar": GRAMMAR},
    }
    whole = client.chat.completions.create(**ask)
    message = whole.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == REASONING
    assert whole.choices[0].finish_reason == "stop"
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


def test_grpc_carries_the_reasoning_in_its_own_field(server: Any) -> None:
    with Client(server.address, timeout=60) as client:
        result = client.generate_text(messages=[("user", "Hi!")], max_new_tokens=40, grammar=GRAMMAR)
    assert (result.reasoning_text, result.text) == (REASONING, ANSWER)


def test_tools_are_refused_in_the_harmony_format_for_now(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="not served in the harmony chat format"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=[tool])


def test_without_its_vocabulary_a_harmony_chat_is_refused_saying_why(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tokenizer = load_tokenizer(checkpoint)
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    monkeypatch.chdir(tmp_path)  # no .tools/tiktoken here either
    harmony.encoding.cache_clear()
    try:
        with pytest.raises(ValueError, match="o200k_base.tiktoken.*TIKTOKEN_ENCODINGS_BASE.*make tools"):
            tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    finally:
        harmony.encoding.cache_clear()


def test_from_the_checkout_the_vocabulary_is_found_without_the_variable(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = load_tokenizer(checkpoint)
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    monkeypatch.chdir(VOCABULARY.parents[1])  # the checkout, where `make tools` wrote .tools/tiktoken
    harmony.encoding.cache_clear()
    try:
        assert tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
        assert os.environ["TIKTOKEN_ENCODINGS_BASE"] == str(VOCABULARY)
    finally:
        monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
        harmony.encoding.cache_clear()
