"""The server's default token limit: what a request that sets none gets, distinct from the hard cap."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill_client._proto import generate_pb2 as pb
from tokenmill_service.contract.config import Settings, load_settings
from tokenmill_service.front.validation import InvalidRequest, Limits, build_request

LIMITS = Limits(
    context_length=8192, vocab_size=49152, max_new_tokens=4096, max_top_logprobs=20, max_stop_strings=16,
    default_max_new_tokens=1024,
)  # fmt: skip


def test_the_default_is_1024_and_settable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().default_max_new_tokens == 1024
    assert load_settings(["--default-max-new-tokens", "64"], {}).default_max_new_tokens == 64
    assert load_settings([], {"TOKENMILL_DEFAULT_MAX_NEW_TOKENS": "32"}).default_max_new_tokens == 32
    with pytest.raises(ValueError, match="--default-max-new-tokens"):
        load_settings(["--default-max-new-tokens", "5000"], {})  # above the hard cap


def test_a_request_without_a_limit_gets_the_default(default_tokenizer: Any) -> None:
    request = build_request(pb.GenerateRequest(prompt="Hello"), default_tokenizer, LIMITS)
    assert request.stopping.max_new_tokens == 1024


def test_an_explicit_limit_is_kept_and_the_cap_still_applies(default_tokenizer: Any) -> None:
    asked = pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingParams(max_new_tokens=2000))
    assert build_request(asked, default_tokenizer, LIMITS).stopping.max_new_tokens == 2000
    with pytest.raises(InvalidRequest, match="max_new_tokens must be <= 4096"):
        build_request(pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingParams(max_new_tokens=5000)),
                      default_tokenizer, LIMITS)  # fmt: skip


def test_the_default_may_run_into_the_end_of_the_context(default_tokenizer: Any) -> None:
    # A long prompt leaves less room than the default: the request runs until the context is full.
    small = Limits(1100, 49152, 4096, 20, 16, default_max_new_tokens=1024)
    request = build_request(pb.GenerateRequest(prompt="Hello " * 200), default_tokenizer, small)
    assert request.stopping.max_new_tokens == 0  # the engine's "until the end of the context"
    roomy = build_request(pb.GenerateRequest(prompt="Hello " * 20), default_tokenizer, small)
    assert roomy.stopping.max_new_tokens == 1024
