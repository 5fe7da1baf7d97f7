"""Constraints compiled into grammar matchers: a JSON schema, any JSON object, a regex, a Lark or GBNF grammar.

The grammar engine is llguidance (its Rust matcher computes a sequence's allowed-token bitmask and
releases the GIL while it does). Measured against xgrammar on this project's tokenizer (SmolLM2's 49k
byte-level BPE) and a typical nested schema: llguidance compiles it cold in about 1.5 ms against
xgrammar's 480 ms, and fills a mask in about 0.05 ms against xgrammar's 0.01 ms. Both masks are far
below a decode step, and the cold compile is what a caller waits for before the first token (and what
must stay under the time limit for a new schema), so llguidance wins. It also reads Lark and GBNF, and
refuses schema keywords it cannot enforce instead of ignoring them.

JSON comes out the way ``json.dumps`` writes it (``", "`` and ``": "`` separators, no other
whitespace): flexible whitespace lets a small model pad forever with spaces and newlines.

Torch-free: the API process uses it to refuse a bad constraint before any token is generated, the
engine to drive each constrained sequence. Both keep compiled grammars in a bounded LRU keyed by the
constraint's canonical text; each sequence gets a cheap copy of the compiled matcher.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING

import llguidance as llg
import structlog

from tokenmill_service.contract.chat.harmony_constraint import answer_grammar
from tokenmill_service.contract.closed_schema import close_schema
from tokenmill_service.contract.grammar_finite import endless_rules, unproductive_refs
from tokenmill_service.contract.request import Constraint
from tokenmill_service.contract.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # (a type in llguidance's stubs only)

log = structlog.get_logger(__name__)

# Compiled grammars kept per process.
CACHE_SIZE = 256
# The longest constraint text accepted (a schema, a regex, a grammar), in characters.
MAX_CONSTRAINT_LENGTH = 64 * 1024
# How long compiling one constraint (building its matcher and its first mask) may take.
COMPILE_TIMEOUT_S = 2.0
# Schema -> grammar: the separators json.dumps writes, and no other whitespace.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Bounds on the work one grammar may cost: llguidance's defaults (lexer fuel, Earley items per step,
# grammar size), which refuse a pathological grammar rather than stall the engine.
LIMITS = llg.LLParserLimits(verbose_errors=False)

GRAMMAR_SYNTAXES = ("lark", "gbnf")


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message names the problem."""


def grammar_text(constraint: Constraint) -> str:
    """The constraint as llguidance's grammar text: its canonical form (the cache key). Raises
    ConstraintError for text that does not parse as its kind (a schema that is not JSON). A harmony
    answer's constraint holds its final channel's text (harmony_constraint.py)."""
    own = _own_grammar_text(constraint)
    return answer_grammar(own) if constraint.harmony else own


def _own_grammar_text(constraint: Constraint) -> str:
    if len(constraint.text) > MAX_CONSTRAINT_LENGTH:
        raise ConstraintError(
            f"the {constraint.kind} has {len(constraint.text)} characters; at most {MAX_CONSTRAINT_LENGTH} are allowed"
        )
    match constraint.kind:
        case "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        case "json_schema":
            try:
                schema = json.loads(constraint.text, parse_constant=_not_json)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
            except RecursionError:
                raise ConstraintError("the JSON schema is nested too deeply") from None
            if not isinstance(schema, dict | bool):
                raise ConstraintError("the JSON schema must be a JSON object (or true/false)")
            if schema is False:
                raise ConstraintError("the JSON schema is false, which no value matches")
            check_depth(schema)
            check_numbers(schema)
            if not constraint.permissive:
                schema = close_schema(schema)
            try:
                return llg.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema if schema is not True else {}, separators=(",", ":"), ensure_ascii=False),
                    defaults=JSON_OPTIONS,
                )
            except ValueError as exc:
                raise ConstraintError(f"the JSON schema cannot be used: {exc}{_closed_hint(constraint)}") from None
        case "regex":
            if not constraint.text:
                raise ConstraintError("the regex is empty")
            return llg.LLMatcher.grammar_from_regex(constraint.text)
        case "grammar":
            if constraint.syntax not in GRAMMAR_SYNTAXES:
                raise ConstraintError(
                    f"grammar syntax {constraint.syntax!r} is not one of {', '.join(GRAMMAR_SYNTAXES)}"
                )
            if not constraint.text.strip():
                raise ConstraintError("the grammar is empty")
            try:
                return llg.grammar_from(constraint.syntax, constraint.text)  # type: ignore[arg-type]
            except ValueError as exc:
                raise ConstraintError(f"the {constraint.syntax} grammar does not parse: {exc}") from None
    raise ConstraintError(f"unknown constraint kind {constraint.kind!r}")


# The grammar engine's integers are 64-bit: a bound beyond them would be clamped (an integer "minimum": 1e300
# allowed 9223372036854775807), which breaks the schema silently; such a schema is refused instead.
LARGEST_BOUND = 2**63 - 1
BOUND_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
     "minItems", "maxItems", "minProperties", "maxProperties", "minContains", "maxContains"}
)  # fmt: skip


def _not_json(name: str) -> float:
    raise ConstraintError(
        f"the JSON schema holds {name}, which is not a JSON number (a number beyond float64's, such as 1e400, reads "
        "as one)"
    )


# The deepest nesting of objects and arrays a JSON schema may have. llguidance refuses deeper ones (from about 180
# levels) with its parser's "recursion limit exceeded at line 1 column N", which says nothing of the schema.
MAX_SCHEMA_DEPTH = 128


def check_depth(schema: object) -> None:
    """ConstraintError when the schema nests objects and arrays more than MAX_SCHEMA_DEPTH deep."""
    stack: list[tuple[object, int]] = [(schema, 1)]
    deepest = 0
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((value, depth + 1) for value in (node.values() if isinstance(node, dict) else node))
    if deepest > MAX_SCHEMA_DEPTH:
        raise ConstraintError(
            f"the JSON schema is nested {deepest} levels deep (objects and arrays); at most {MAX_SCHEMA_DEPTH} are "
            "allowed"
        )


def check_numbers(schema: object) -> None:
    """ConstraintError naming where (properties.age.minimum) the schema holds a number JSON cannot (1e400 parses
    as infinity) or a bound beyond the grammar engine's 64-bit integers."""
    stack: list[tuple[object, str, str]] = [(schema, "", "")]
    while stack:  # (iterative: a schema nested deeper than Python recurses is refused by the parser already)
        node, at, key = stack.pop()
        if isinstance(node, dict):
            stack.extend((value, f"{at}.{k}" if at else str(k), str(k)) for k, value in node.items())
        elif isinstance(node, list):
            stack.extend((value, f"{at}[{i}]", "") for i, value in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            raise ConstraintError(f"{at} is beyond the numbers JSON holds")
        elif key in BOUND_KEYWORDS and isinstance(node, int | float) and abs(node) > LARGEST_BOUND:
            raise ConstraintError(f"{at} is {node:g}: a bound must lie within +-{LARGEST_BOUND} (64-bit integers)")


def lltokenizer(tokenizer: Tokenizer) -> llg.LLTokenizer:
    """llguidance's view of the tokenizer: every token's bytes, and the tokens that end generation
    (allowed by a mask once the grammar accepts). Takes a few hundred ms: build once per process."""

    class _Tokens:
        def __init__(self) -> None:
            self.eos_token_id = tokenizer.eos_token_id
            self.bos_token_id = tokenizer.bos_token_id
            self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
            self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]

        def __call__(self, text: bytes | str) -> list[int]:
            return tokenizer.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)

    return llg.LLTokenizer(
        llg.TokenizerWrapper(_Tokens()), n_vocab=tokenizer.vocab_size, eos_token=sorted(tokenizer.stop_token_ids)
    )


class GrammarCompiler:
    """Compiles constraints for one tokenizer, keeping the last ``cache_size`` compiled (thread-safe)."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._lltok: llg.LLTokenizer | None = None
        self._cache: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def lltok(self) -> llg.LLTokenizer:
        with self._lock:
            if self._lltok is None:
                start = time.perf_counter()
                self._lltok = lltokenizer(self.tokenizer)
                log.info("grammar_tokenizer_built", seconds=round(time.perf_counter() - start, 3))
            return self._lltok

    def matcher(self, constraint: Constraint) -> llg.LLMatcher:
        """A fresh matcher at the start of the constraint's grammar; ConstraintError naming the problem."""
        key = grammar_text(constraint)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return compiled.deep_copy()
        lltok = self.lltok
        start = time.perf_counter()
        compiled = llg.LLMatcher(lltok, key, log_level=0, limits=LIMITS)
        first = compiled.deep_copy()
        if not compiled.is_error():
            # Matchers build their lexer lazily: the first mask is part of compiling.
            first.compute_bitmask()
        if compiled.is_error():
            raise ConstraintError(
                f"the {constraint.kind} cannot be used: {_first_line(compiled.get_error())}{_closed_hint(constraint)}"
            )
        if constraint.kind == "json_schema" and first.is_stopped():
            # (llguidance compiles {"$ref": "#"}, a schema that is only itself, into a grammar that has ended
            # before its first token: every answer would be empty.)
            raise ConstraintError("the json_schema admits no value (a schema that only refers to itself, say)")
        endless = never_ends(constraint)
        if endless:
            raise ConstraintError(endless)
        log.debug("grammar_compiled", kind=constraint.kind, ms=round((time.perf_counter() - start) * 1000, 2))
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled.deep_copy()


def never_ends(constraint: Constraint) -> str | None:
    """Why no finite text can match the constraint (grammar_finite.py), or None. (Such a constraint compiles,
    and its sequences generated until max_tokens.)"""
    if constraint.kind == "json_schema":
        refs = unproductive_refs(json.loads(constraint.text))
        if refs is None:
            return None
        where = f" (the schema at {', '.join(refs[:3])} requires another of itself)" if refs else ""
        return f"the json_schema admits no finite value: every value would have to hold another, without end{where}"
    if constraint.kind == "grammar" and constraint.syntax in GRAMMAR_SYNTAXES:
        rules = endless_rules(llg.grammar_from(constraint.syntax, constraint.text))  # type: ignore[arg-type]
        if rules is None:
            return None
        if constraint.syntax == "gbnf":  # (llguidance's Lark names GBNF's root rule start)
            rules = ["root" if rule == "start" else rule for rule in rules]
        return f"the {constraint.syntax} grammar can never end: no finite text completes rule {', '.join(rules)}"
    return None


def _closed_hint(constraint: Constraint) -> str:
    """Why a JSON schema that JSON Schema's own reading would take is refused, when that is the reason: it
    needs more keys or items than it declares (closed_schema.py)."""
    if constraint.kind != "json_schema" or constraint.permissive:
        return ""
    try:
        text = _own_grammar_text(replace(constraint, permissive=True))
    except ConstraintError:
        return ""
    if not llg.LLMatcher.validate_grammar_with_warnings(text, limits=LIMITS)[0]:
        return (
            " (an object schema without additionalProperties admits only the keys it declares, an array schema "
            "without items only its prefixItems; say additionalProperties or items in the schema)"
        )
    return ""


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it may append."""
    return error.split("\n<state>")[0].strip()
