"""Whether a constraint admits any finite text: a JSON schema whose every value must hold another of itself
({"properties": {"next": {"$ref": "#"}}, "required": ["next"]}), or a grammar whose start rule never ends
(start: "a" start), compiles into a matcher that lets a sequence generate until max_tokens without ever
completing. llguidance does not say so; this finds it before any token is generated.

Both are the productivity of a context-free grammar: a rule (a schema reached by $ref) is productive when one of
its alternatives needs only productive parts, found as a least fixed point. Whatever is not understood counts as
productive, so a constraint is refused only when no finite text can match it. Sound, and deliberately partial:
the check runs after llguidance compiled the constraint, on what it accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# Schema nodes (or grammar items) visited at most: past it the constraint counts as able to end, so that the check
# stays within a few tenths of a second of a compile's time limit.
MAX_VISITS = 200_000


class _TooBig(Exception):
    pass


# -- JSON schemas ------------------------------------------------------------------------------------


def _pointer(root: Any, ref: str) -> Any:
    """The local subschema a "#/..." reference names, or None (another document, an anchor, a wrong path)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _refs(node: Any) -> Iterator[str]:
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


class _Schema:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.productive: dict[str, bool] = {}
        self.targets: dict[str, Any] = {}
        for ref in _refs(root):
            target = _pointer(root, ref)
            if target is not None:
                self.targets[ref], self.productive[ref] = target, False
        self.visits = 0

    def solve(self) -> bool:
        changed = True
        while changed:
            changed = False
            for ref, target in self.targets.items():
                if not self.productive[ref] and self.ok(target):
                    self.productive[ref] = changed = True
        return self.ok(self.root)

    def ok(self, node: Any) -> bool:
        """Whether some finite value matches ``node``, given what is known of the references."""
        self.visits += 1
        if self.visits > MAX_VISITS:
            raise _TooBig
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and not self.productive.get(ref, True):
            return False
        if any(not self.ok(sub) for sub in _list(node.get("allOf"))):
            return False
        for key in ("anyOf", "oneOf"):
            options = _list(node.get(key))
            if key in node and options and not any(self.ok(sub) for sub in options):
                return False
        if isinstance(node.get("enum"), list) and not node["enum"]:
            return False
        if "enum" in node or "const" in node:
            return True
        kinds = node.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else None
        if kinds is None:  # any kind, scalars too
            return True
        return any(self._kind_ok(kind, node) for kind in kinds)

    def _kind_ok(self, kind: Any, node: dict[str, Any]) -> bool:
        if kind == "object":
            properties = node.get("properties")
            if not isinstance(properties, dict):
                properties = {}
            return all(self.ok(properties[name]) for name in _list(node.get("required")) if name in properties)
        if kind == "array":
            least = node.get("minItems", 0)
            least = least if isinstance(least, int) and not isinstance(least, bool) else 0
            prefix = _list(node.get("prefixItems"))
            if not all(self.ok(sub) for sub in prefix[:least]):
                return False
            if least > len(prefix) and "items" in node and not self.ok(node["items"]):
                return False
            contains = node.get("contains")
            return contains is None or node.get("minContains", 1) == 0 or self.ok(contains)
        return True


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def unproductive_refs(schema: Any) -> list[str] | None:
    """None when some finite value matches the schema (or the check gives up); else the references whose schemas
    admit no finite value (empty when the root itself is, say, {"enum": []})."""
    check = _Schema(schema)
    try:
        if check.solve():
            return None
    except (_TooBig, RecursionError):
        return None
    return sorted(ref for ref, ok in check.productive.items() if not ok)


# -- Lark grammars (a GBNF grammar is read as llguidance's Lark translation of it) ----------------------

_TOKEN = re.compile(
    r"""(?P<skip>[ \t\r]+|//[^\n]*|\#[^\n]*)
      | (?P<nl>\n)
      | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
      | (?P<regex>/(?:[^/\\\n]|\\.)+/[imsux]*)
      | (?P<special><\[[^\]\n]*\]>|<[^<>\s]+>)
      | (?P<name>[?!]?[A-Za-z_][A-Za-z_0-9]*)
      | (?P<number>\d+)
      | (?P<json>%json\b|%regex\b)
      | (?P<directive>%[a-z]+)
      | (?P<punct>\.\.|[:|()\[\]?*+~,{}.@=])""",
    re.VERBOSE,
)


class _Unknown(Exception):
    """A construct this reader does not know: the grammar counts as able to end."""


def _lex(text: str) -> list[tuple[str, str, int]]:
    tokens: list[tuple[str, str, int]] = []
    at = 0
    while at < len(text):
        m = _TOKEN.match(text, at)
        if m is None:
            raise _Unknown
        kind = m.lastgroup or ""
        if kind in ("json", "directive"):
            # %json {...}, %llguidance {...}: a JSON value follows.
            rest = text[m.end() :]
            skipped = len(rest) - len(rest.lstrip(" \t"))
            if rest[skipped : skipped + 1] == "{":
                value, end = json.JSONDecoder().raw_decode(rest, skipped)
                tokens.append((kind, f"{m.group()} {json.dumps(value)}", m.start()))
                at = m.end() + end
                continue
            if kind == "json":
                raise _Unknown
        if kind != "skip":
            tokens.append((kind, m.group(), m.start()))
        at = m.end()
    return tokens


class _Lark:
    """Each rule's alternatives, as lists of (atom, optional) where an atom is a rule's name, a group (a list of
    alternatives) or True (text that always matches something: a literal, a regex, a special token) or a JSON
    schema's productivity."""

    def __init__(self, text: str) -> None:
        self.tokens = _lex(text)
        self.at = 0
        self.rules: dict[str, list[list[tuple[Any, bool]]]] = {}
        while (token := self.peek()) is not None:
            if token[0] == "nl":
                self.at += 1
            elif token[0] == "directive":
                self.skip_line()
            elif token[0] == "name":
                self.rule()
            else:
                raise _Unknown

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.at][:2] if self.at < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.at >= len(self.tokens):
            raise _Unknown
        self.at += 1
        return self.tokens[self.at - 1][:2]

    def skip_line(self) -> None:
        while self.peek() is not None and self.peek() != ("nl", "\n"):
            self.at += 1

    def rule(self) -> None:
        name = self.take()[1].lstrip("?!")
        if self.peek() == ("punct", "."):  # a priority
            self.take()
            if self.take()[0] != "number":
                raise _Unknown
        if self.peek() == ("punct", "["):  # llguidance's attributes: [max_tokens=5], [lazy], ...
            while self.take() != ("punct", "]"):
                pass
        if self.peek() == ("punct", "{"):  # a template (its parameters): not followed here
            raise _Unknown
        if self.take() != ("punct", ":"):
            raise _Unknown
        self.rules.setdefault(name, []).extend(self.alternatives(depth=0))

    def alternatives(self, depth: int) -> list[list[tuple[Any, bool]]]:
        options = [self.sequence(depth)]
        while True:
            # A rule goes on past a line's end only where the next line starts with "|".
            if depth == 0 and self.peek() == ("nl", "\n"):
                ahead = self.at
                while ahead < len(self.tokens) and self.tokens[ahead][0] == "nl":
                    ahead += 1
                if ahead < len(self.tokens) and self.tokens[ahead][:2] == ("punct", "|"):
                    self.at = ahead
            if self.peek() != ("punct", "|"):
                return options
            self.take()
            options.append(self.sequence(depth))

    def sequence(self, depth: int) -> list[tuple[Any, bool]]:
        items: list[tuple[Any, bool]] = []
        while True:
            token = self.peek()
            while depth > 0 and token == ("nl", "\n"):  # (inside brackets lines do not end the rule)
                self.take()
                token = self.peek()
            if token is None or token in (("nl", "\n"), ("punct", "|"), ("punct", ")"), ("punct", "]")):
                return items
            items.append(self.item(depth))

    def item(self, depth: int) -> tuple[Any, bool]:
        kind, value = self.take()
        optional = False
        if (kind, value) == ("punct", "("):
            atom: Any = self.alternatives(depth + 1)
            if self.take() != ("punct", ")"):
                raise _Unknown
        elif (kind, value) == ("punct", "["):
            atom, optional = self.alternatives(depth + 1), True
            if self.take() != ("punct", "]"):
                raise _Unknown
        elif kind == "name":
            atom = value
            if value[0] in "?!" or self.peek() == ("punct", "{"):  # (a template's use is not followed)
                raise _Unknown
        elif kind == "json":
            directive, _, payload = value.partition(" ")
            atom = directive == "%regex" or unproductive_refs(json.loads(payload)) is None
        elif kind in ("string", "regex", "special"):
            atom = True
            if self.peek() == ("punct", ".."):  # "a".."z"
                self.take()
                self.take()
        elif (kind, value) == ("punct", "@"):  # another grammar of a TopLevelGrammar
            self.take()
            atom = True
        else:
            raise _Unknown
        return atom, self.quantifier(optional)

    def quantifier(self, optional: bool) -> bool:
        token = self.peek()
        if token in (("punct", "?"), ("punct", "*")):
            self.take()
            return True
        if token == ("punct", "+"):
            self.take()
        elif token == ("punct", "~"):  # item ~ n or item ~ n..m
            self.take()
            least = self.take()
            if least[0] != "number":
                raise _Unknown
            optional = optional or int(least[1]) == 0
            if self.peek() == ("punct", ".."):
                self.take()
                self.take()
        elif token == ("punct", "{"):  # item{n}, item{n,m}, item{,m}
            self.take()
            least = self.take()
            optional = optional or least == ("punct", ",") or (least[0] == "number" and int(least[1]) == 0)
            while self.take() != ("punct", "}"):
                pass
        return optional

    def productive(self) -> dict[str, bool]:
        done = dict.fromkeys(self.rules, False)
        visits = 0

        def ok(atom: Any) -> bool:
            nonlocal visits
            visits += 1
            if visits > MAX_VISITS:  # (a long chain of rules, each defined before the one it needs)
                raise _Unknown
            if isinstance(atom, bool):
                return atom
            if isinstance(atom, str):
                return done.get(atom, True)  # (a name defined elsewhere, %import-ed, counts as productive)
            return any(all(optional or ok(a) for a, optional in seq) for seq in atom)

        changed = True
        while changed:
            changed = False
            for name, options in self.rules.items():
                if not done[name] and ok(options):
                    done[name] = changed = True
        return done


def endless_rules(lark: str, start: str = "start") -> list[str] | None:
    """None when the Lark grammar's start rule derives some finite text (or the grammar holds what this reader
    does not follow); else the rules that never end, start first."""
    try:
        grammar = _Lark(lark)
        done = grammar.productive()
    except (_Unknown, ValueError, RecursionError):
        return None
    if start not in grammar.rules or done[start]:
        return None
    return [start, *sorted(name for name, ok in done.items() if not ok and name != start)]
