"""Quickstart: stream an answer, get a whole result, inspect the model, handle errors.

tokenmill-server --port 50051 &            # or: make run
python client/examples/quickstart.py       # TOKENMILL_SERVER=host:port to point elsewhere
"""

from __future__ import annotations

import sys

from tokenmill_client import ChatMessage, Client, GenerateResult, InvalidRequestError, TokenmillError


def main() -> int:
    with Client(timeout=60) as client:
        info = client.model_info()
        sys.stdout.write(f"{info.name} on {info.device}, context {info.context_length} tokens\n")

        # Stream a chat answer as it is generated.
        conversation = [ChatMessage("system", "Answer in one sentence."), ChatMessage("user", "Why is the sky blue?")]
        for event in client.generate(messages=conversation, max_new_tokens=64):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            if event.finish_reason is not None and event.usage is not None:
                sys.stdout.write(f"\n[{event.finish_reason.value}, {event.usage.completion_tokens} tokens]\n")

        # Or wait for the whole result, here with log-probabilities.
        result: GenerateResult = client.generate_text(
            "The capital of France is", max_new_tokens=5, logprobs=True, temperature=0.7, seed=42
        )
        for token in result.tokens:
            sys.stdout.write(f"{token.text!r}\t{token.logprob}\n")

        # The server validates parameters; errors are typed.
        try:
            client.generate_text("Hello", top_p=2.0)
        except InvalidRequestError as exc:
            sys.stdout.write(f"rejected as expected: {exc.message}\n")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except TokenmillError as exc:
        sys.stderr.write(f"error: {exc} ({exc.code})\n")
        raise SystemExit(1) from None
