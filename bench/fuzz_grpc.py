"""Fuzzed Generate calls against a tokenmill server, and a table of the statuses they ended with:

    python bench/fuzz_grpc.py                                  # 5,000 calls to a server it starts (default flags)
    python bench/fuzz_grpc.py --requests 20000 --seed 7
    python bench/fuzz_grpc.py --server 127.0.0.1:50051         # a running server instead

Each call is a GenerateRequest with random values in every field (texts, chats with tool calls, token ids past
the vocabulary, floats that are NaN, infinite or denormal, integers at their types' ends, stop strings, logit
biases, request ids), random constraints (JSON schemas built from schema keywords with values of any type, broken
and endless ones, regexes, Lark and GBNF grammars, unknown enum values), random tools; or such a request's bytes
mutated; or random bytes; or a huge string. A call is answered once its first message or its error status comes
(the rest of a stream is not under test, so it is cancelled). UNKNOWN and INTERNAL are the server's own faults,
and so is a call that got no answer within --timeout: each is listed with the request that got it, and the script
exits 1 when there is any. Random values come from --seed, so a run can be repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from tokenmill_bench.server import ManagedServer
from tokenmill_client._proto import generate_pb2 as pb

GENERATE = "/tokenmill.v1.Generation/Generate"
FAULTS = {"UNKNOWN", "INTERNAL", "NO ANSWER"}

FLOATS = [0.0, -0.0, 1e-45, 1e-38, 1e-3, 0.5, 1.0, 1.1, 2.0, 2.5, -1.0, -2.0, 100.0, 3.4e38, 1e300]
FLOATS += [float("nan"), float("inf"), float("-inf")]
INTS = [0, 1, 2, 3, 16, 17, 20, 21, 49151, 49152, 2**31 - 1, 2**32 - 1]
TEXTS = [
    "",
    "Hi",
    "The capital of France is",
    " ",
    "\x00",
    "\n\n",
    "日本語のテキスト",
    "🙂" * 5,
    "<|im_end|>",
    "\ufeff",
]
ROLES = ["system", "user", "assistant", "tool", "developer", "", "USER", "function", "x" * 300]
REGEXES = [
    "[a-z]+",
    "a{3}",
    "(",
    "[",
    "\\",
    "a{1000000}",
    "(?<n>a)\\k<n>",
    ".*",
    "\\d+(\\.\\d+)?",
    "(a|b)*c",
    "^$",
    "[^\\s\\S]",
]
GRAMMARS = [
    'start: "yes" | "no"',
    'start: "a" start',
    'start: a\na: "x" a',
    "start: /[0-9]+/",
    'start: "a"{3,5}',
    "start: x",
    'start: "a" | ',
    "start: %json {}",
    'start: %json {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}',
    "%import common.WS\nstart: WS+",
    "start: <|im_end|>",
    "start: <[99999999]>",
    ":::",
    "start: " + " | ".join(f'"w{i}"' for i in range(2000)),
    'root ::= "a" root',
    'root ::= [a-z]+ ("," [a-z]+)*',
    "root ::= x",
    'root ::= "a" | "b" ::=',
]
KEYWORDS = [
    "type", "properties", "items", "required", "$ref", "anyOf", "oneOf", "allOf", "enum", "const", "minimum",
    "maximum", "exclusiveMinimum", "multipleOf", "minLength", "maxLength", "pattern", "format", "additionalProperties",
    "$defs", "definitions", "minItems", "maxItems", "uniqueItems", "not", "if", "then", "else", "prefixItems",
    "patternProperties", "minProperties", "contains", "propertyNames", "x-guidance", "$schema", "$id", "$anchor",
]  # fmt: skip
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null", "str", ""]
# JSON nested deeper than Python's parser recurses.
DEEP = "[" * 5000 + "]" * 5000
REFS = ["#", "#/$defs/a", "#/definitions/a", "#/properties/a", "#/$defs/%25", "#/$defs/a/items", "#a", "other.json"]


class Fuzz:
    """Random GenerateRequests (and bytes), from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def pick(self, values: list[Any]) -> Any:
        return self.r.choice(values)

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def text(self, long: bool = False) -> str:
        if self.chance(0.3):
            return str(self.pick(TEXTS))
        size = self.r.choice([1, 5, 40, 300]) if not long else self.r.randint(1_000, 100_000)
        alphabet = [chr(self.r.randint(32, 126)) for _ in range(20)]
        alphabet += [chr(self.r.randint(0x80, 0xD7FF)) for _ in range(5)] + ["\n", "\t", "\x01", "{", '"']
        return "".join(self.r.choice(alphabet) for _ in range(size))

    def integer(self) -> int:
        return int(self.pick(INTS)) if self.chance(0.7) else self.r.randint(0, 2**32 - 1)

    def number(self) -> float:
        return float(self.pick(FLOATS)) if self.chance(0.7) else self.r.uniform(-5, 5)

    def json_value(self, depth: int = 0) -> Any:
        kind = self.r.randint(0, 7 if depth < 4 else 4)
        if kind == 0:
            return None
        if kind == 1:
            return self.chance(0.5)
        if kind == 2:
            return self.pick([0, -1, 1, 2**63, -(2**63), 2**64, 10**30, 1.5, 1e308])
        if kind in (3, 4):
            return self.pick(["", "a", "#", "string", "object", self.text()])
        if kind == 5:
            return [self.json_value(depth + 1) for _ in range(self.r.randint(0, 3))]
        if kind == 6:
            return self.schema(depth + 1)
        return {self.text(): self.json_value(depth + 1) for _ in range(self.r.randint(0, 3))}

    def schema(self, depth: int = 0) -> Any:
        """A JSON schema built from schema keywords, with values of the right kind or of any kind."""
        if depth > 5 or self.chance(0.1):
            return self.pick([True, False, {}, {"type": self.pick(TYPES)}])
        node: dict[str, Any] = {}
        for key in self.r.sample(KEYWORDS, self.r.randint(1, 4)):
            if not self.chance(0.8):
                node[key] = self.json_value(depth + 1)
            elif key == "type":
                node[key] = self.pick(TYPES) if self.chance(0.8) else self.r.sample(TYPES, 2)
            elif key in ("properties", "$defs", "definitions", "patternProperties"):
                node[key] = {self.pick(["a", "b", self.text()]): self.schema(depth + 1) for _ in range(2)}
            elif key in ("items", "not", "if", "then", "else", "additionalProperties", "contains", "propertyNames"):
                node[key] = self.schema(depth + 1)
            elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
                node[key] = [self.schema(depth + 1) for _ in range(self.r.randint(0, 3))]
            elif key == "required":
                node[key] = self.r.sample(["a", "b", "c"], self.r.randint(0, 3))
            elif key == "$ref":
                node[key] = self.pick(REFS)
            elif key in ("enum",):
                node[key] = [self.json_value(depth + 1) for _ in range(self.r.randint(0, 3))]
            elif key == "pattern":
                node[key] = self.pick(REGEXES)
            else:
                node[key] = self.pick([0, 1, 5, -3, 2.5, 1e300, 2**70])
        return node

    def schema_text(self) -> str:
        special = [
            "{",
            "[]",
            "null",
            '{"type": "integer", "minimum": 1e400}',
            '{"type": "number", "maximum": NaN}',
            json.dumps({"$ref": "#"}),
            DEEP,
            json.dumps({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}),
        ]
        if self.chance(0.2):
            return str(self.pick(special))
        return json.dumps(self.schema(), ensure_ascii=self.chance(0.5))

    def constraint(self, r: pb.GenerateRequest) -> None:
        kind = self.r.randint(0, 4)
        if kind == 0:
            r.json_schema = self.schema_text()
            if self.chance(0.3):
                r.json_schema_name, r.json_schema_description = self.text(), self.text()
        elif kind == 1:
            r.json_object.SetInParent()
        elif kind == 2:
            r.regex = self.pick(REGEXES) if self.chance(0.8) else self.text()
        else:
            syntax = self.pick([0, 1, 2, 2, 7, -1]) if self.chance(0.9) else self.r.randint(-(2**31), 2**31 - 1)
            r.grammar.text = self.pick(GRAMMARS) if self.chance(0.8) else self.text()
            r.grammar.syntax = syntax  # type: ignore[assignment]  # an open enum: unknown values travel

    def chat(self, r: pb.GenerateRequest) -> None:
        for _ in range(self.r.randint(0, 4)):
            m = r.chat.messages.add(role=self.pick(ROLES), content=self.text())
            if self.chance(0.2):
                m.tool_calls.add(id=self.text(), name=self.pick(["add", "", self.text()]), arguments=self.pick(
                    ["{}", '{"a": 1}', "", "{", "[1]", DEEP, self.text()]
                ))  # fmt: skip
            if self.chance(0.1):
                m.tool_call_id, m.name, m.reasoning = self.text(), self.text(), self.text()

    def tools(self, r: pb.GenerateRequest) -> None:
        for _ in range(self.r.randint(0, 3)):
            parameters = (
                self.pick(["", "{", "[]", "null", DEEP, self.schema_text()])
                if self.chance(0.25)
                else json.dumps(
                    self.schema() if self.chance(0.5) else {"type": "object", "properties": {"a": {"type": "integer"}}}
                )
            )
            name = self.pick(["", "a b", "x" * 65, self.text()]) if self.wild() else self.pick(["add", "get_weather"])
            r.tools.add(name=name, description=self.text(), parameters=parameters)
        r.tool_choice = self.pick([9, -5]) if self.wild() else self.pick([0, 1, 2, 3])
        if self.chance(0.5):
            r.tool_choice_function = self.pick(["add", "get_weather", "nope", ""])
        if self.chance(0.5):
            r.parallel_tool_calls = self.chance(0.5)

    def wild(self) -> bool:
        """Whether this field gets a value from anywhere in its type (else an ordinary one): a request is mostly
        ordinary, so that one odd field reaches the code past the checks of the others."""
        return self.chance(0.07)

    def request(self) -> pb.GenerateRequest:
        r = pb.GenerateRequest()
        which = self.r.randint(0, 3)
        if which == 0:
            r.prompt = self.text() if self.wild() else self.pick(["Hi", "The capital of France is", "1, 2, 3,"])
        elif which == 1:
            if self.wild():
                self.chat(r)
            else:
                r.chat.messages.add(role="user", content=self.pick(["Hi", "Name a colour.", "What is 2+2?"]))
        elif which == 2:
            wild = self.wild()
            r.token_ids.ids.extend(
                self.integer() if wild else self.r.randint(0, 49151)
                for _ in range(self.r.randint(0 if wild else 1, 12))
            )
        s = r.sampling
        s.temperature = self.number() if self.wild() else self.pick([0.0, 0.7, 1.0])
        s.top_p = self.number() if self.wild() else self.pick([0.0, 0.9, 1.0])
        s.top_k = self.pick([0, 1, 40, -1, 2**31 - 1, -(2**31)]) if self.wild() else self.pick([0, 40])
        s.repetition_penalty = self.number() if self.wild() else self.pick([0.0, 1.1])
        s.presence_penalty = self.number() if self.wild() else self.pick([0.0, 0.5])
        s.frequency_penalty = self.number() if self.wild() else self.pick([0.0, -0.5])
        if self.chance(0.5):
            s.seed = self.r.randint(0, 2**64 - 1)
        if self.wild():
            for _ in range(self.pick([1, 3, 1100])):
                s.logit_bias[self.integer()] = self.number()
        elif self.chance(0.2):
            s.logit_bias[self.r.randint(0, 49151)] = self.r.uniform(-100, 100)
        # Short answers keep a run fast; 0 (the server's default) and the big ones must be refused or bounded.
        r.stopping.max_new_tokens = self.pick([0, 4096, 4097, 2**32 - 1]) if self.wild() else self.r.randint(1, 4)
        if self.wild():
            r.stopping.stop.extend(self.text() for _ in range(self.pick([1, 3, 17])))
            r.stopping.stop_token_ids.extend(self.integer() for _ in range(self.pick([1, 3, 257])))
        elif self.chance(0.2):
            r.stopping.stop.append(self.pick([".", "\n", "Paris"]))
        r.stopping.ignore_eos = self.chance(0.3)
        r.logprobs, r.prompt_logprobs = self.chance(0.3), self.chance(0.2)
        r.top_logprobs = self.pick([21, 2**32 - 1]) if self.wild() else self.pick([0, 0, 1, 5])
        if self.chance(0.3):
            r.request_id = self.text() if self.wild() else f"fuzz-{self.r.randrange(10**9)}"
        if self.chance(0.4):
            self.constraint(r)
        if self.chance(0.2):
            self.tools(r)
        if self.chance(0.03):
            r.adapter = self.text()
        if self.chance(0.2):
            r.n = self.pick([0, 17, 2**32 - 1]) if self.wild() else self.pick([1, 2, 3])
        return r

    def payload(self) -> bytes:
        """One call's bytes: mostly a request, else a mutated one, random bytes, or a huge string."""
        roll = self.r.random()
        if roll < 0.72:
            return self.request().SerializeToString()
        if roll < 0.87:
            raw = bytearray(self.request().SerializeToString())
            for _ in range(self.r.randint(1, 8)):
                if raw and self.chance(0.6):
                    raw[self.r.randrange(len(raw))] = self.r.randrange(256)
                else:
                    raw.insert(self.r.randint(0, len(raw)), self.r.randrange(256))
            return bytes(raw[: self.r.randint(0, len(raw))] if self.chance(0.2) else raw)
        if roll < 0.98:
            return self.r.randbytes(self.r.randint(0, 200))
        # A long text (a tokenizer's and a template's work) or a message past the server's limit.
        big = pb.GenerateRequest(stopping=pb.StoppingParams(max_new_tokens=1))
        if self.chance(0.5):
            big.prompt = self.text(long=True)
        else:
            big.chat.messages.add(role="user", content="word " * self.r.choice([200_000, 1_000_000]))
        return big.SerializeToString()


@dataclass
class Outcome:
    codes: Counter[str] = field(default_factory=Counter)
    faults: list[tuple[str, str, bytes]] = field(default_factory=list)


async def send_all(address: str, payloads: list[bytes], concurrency: int, timeout: float) -> Outcome:
    outcome = Outcome()
    gate = asyncio.Semaphore(concurrency)
    options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        generate = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)

        async def one(payload: bytes) -> None:
            async with gate:
                call = generate(payload, timeout=timeout)
                detail = ""
                try:
                    async for _ in call:
                        call.cancel()  # answered
                        break
                    code = "OK"
                except grpc.aio.AioRpcError as err:
                    code, detail = err.code().name, err.details() or ""
                    if code == "DEADLINE_EXCEEDED":
                        code = "NO ANSWER"  # (the server's own deadline is none here: this is ours)
                outcome.codes[code] += 1
                if code in FAULTS:
                    outcome.faults.append((code, detail, payload))

        await asyncio.gather(*(one(p) for p in payloads))
    return outcome


def describe(payload: bytes) -> str:
    try:
        text = str(pb.GenerateRequest.FromString(payload))
    except Exception:  # noqa: BLE001 - not a request at all
        text = "(not a GenerateRequest)"
    return f"{len(payload)} bytes: {payload[:200].hex()}\n{text[:1500]}"


def table(outcome: Outcome, seconds: float) -> str:
    total = sum(outcome.codes.values())
    lines = [f"{'status':<20} {'calls':>7} {'share':>7}"]
    for code, count in outcome.codes.most_common():
        lines.append(f"{code:<20} {count:>7} {count / total:>7.1%}")
    lines.append(f"{'total':<20} {total:>7}   in {seconds:.0f} s")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a call may wait for its answer")
    parser.add_argument("--server", help="host:port of a running server (default: start one)")
    parser.add_argument("--server-arg", action="append", default=[], help="a flag for the started server")
    args = parser.parse_args()

    fuzz = Fuzz(args.seed)
    payloads = [fuzz.payload() for _ in range(args.requests)]
    server = None if args.server else ManagedServer(args.server_arg).start()
    address = args.server or server.address  # type: ignore[union-attr]
    try:
        began = time.monotonic()
        outcome = asyncio.run(send_all(address, payloads, args.concurrency, args.timeout))
        seconds = time.monotonic() - began
        # The server must still answer an ordinary request after all that.
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
            after = pb.GenerateRequest(prompt="The capital of France is", stopping=pb.StoppingParams(max_new_tokens=4))
            answered = any(True for _ in call(after.SerializeToString(), timeout=60))
    finally:
        if server is not None:
            server.stop()
    print(table(outcome, seconds))
    print(f"an ordinary request afterwards: {'answered' if answered else 'NOT answered'}")
    if server is not None:
        print(f"server log: {server.log_path}")
    for code, detail, payload in outcome.faults[:10]:
        print(f"\n{code}: {detail}\n{describe(payload)}")
    return 1 if outcome.faults or not answered else 0


if __name__ == "__main__":
    sys.exit(main())
