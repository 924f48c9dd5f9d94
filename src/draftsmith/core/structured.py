"""Structured outputs: a JSON schema, a regex, a list of choices or a Lark grammar constrains
every generated token (vLLM's `structured_outputs`, the OpenAI API's `response_format`), under
speculative decoding too.

The grammar engine is llguidance (a token-level matcher over the target's own tokenizer). Like
a penalty (core/penalties.py), a grammar makes the target distribution at a position depend on
the tokens before it: position j of a verify block is masked with the matcher's state after
the committed output *and drafts 0..j-1*, the context the target reaches j in. So p_j is the
constrained target's distribution there, the ratio test and the residual stay exact, and
greedy takes the constrained argmax. A draft the grammar refuses gets p = 0 and is rejected,
so the positions after the first refused draft are never reached and stay unmasked. Any q is
lossless: n-gram drafts come unconstrained (core/grammar_drafts.py cuts what the grammar
refuses), the model drafters draft inside the grammar (core/draft_masks.py).

Per request the matcher follows the committed output (`advance`); a block only borrows it:
it consumes the valid drafts to read each position's mask and rolls them back. Where the grammar
engine gives up (a grammar past its limits: LexerTooComplex) while taking drafts, the request gets
a fresh matcher at its committed output and goes on without drafts for that round (`renew`): so
whether a request succeeds never depends on what was drafted; it ends with "error" only where its
committed output itself is past the limits.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from draftsmith.errors import DraftsmithError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar",
               "json_object": "JSON object grammar"}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of (vLLM's names):

    json:        a JSON schema (a dict, or its JSON text); the output is one JSON value that
                 satisfies it, its properties in the schema's order. Keywords the grammar engine
                 cannot enforce (e.g. uniqueItems, which pydantic writes for a set) are ignored.
                 Objects are closed where the schema leaves them open, as vLLM's default backend
                 (xgrammar, strict mode) closes them: see `strict_json_schema`; a schema with a
                 feature xgrammar does not support (uniqueItems, multipleOf, ...) stays open, as
                 vLLM's "auto" backend gives it to guidance.
    regex:       the output matches this regular expression, whole.
    choice:      the output is exactly one of these strings.
    grammar:     a context-free grammar, in GBNF / EBNF (`root ::= ...`, as vLLM's docs write
                 them) or in Lark syntax (`start: ...`, llguidance's own).
    json_object: any JSON object (the OpenAI API's `response_format: {"type": "json_object"}`).

    disable_any_whitespace: JSON without free whitespace between tokens (compact separators);
                 by default any whitespace is allowed there, as in vLLM.
    whitespace_pattern: a regex for the whitespace allowed between JSON tokens instead.
    reasoning:   for a thinking model (vLLM applies the grammar after the reasoning ends):
                 "open": the answer starts inside a <think> block (the prompt opened it), free
                 text up to </think>, then the grammar; "optional": the answer may open with a
                 <think> ... </think> block of free text before the grammar (where the tokenizer
                 has <think> as a token: ThinkTags; else as None); None: the grammar from the
                 first token.
    """

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    reasoning: str | None = None
    kind: str = field(default="", init=False, compare=False)  # which one of the five was given
    _key: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise DraftsmithError("structured outputs need exactly one of json, regex, choice, grammar, json_object; "
                                  f"got {', '.join(given) or 'none'}")
        object.__setattr__(self, "kind", given[0])
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError) as e:
                    raise DraftsmithError(f"structured outputs: json must be a JSON schema; its text does not parse: {e}") from None
            if not isinstance(schema, dict):
                raise DraftsmithError(f"structured outputs: json must be a JSON schema object ({{\"type\": ...}}), "
                                      f"got {type(schema).__name__} {schema!r:.40}")
            object.__setattr__(self, "json", json.dumps(schema))  # key order kept: it orders the properties
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise DraftsmithError(f"structured outputs: {name} must be a non-empty string, got {v!r}")
        if self.reasoning not in (None, "open", "optional"):
            raise DraftsmithError(f"structured outputs: reasoning must be \"open\", \"optional\" or None, "
                                  f"got {self.reasoning!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise DraftsmithError(f"structured outputs: choice must be a non-empty list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        try:
            object.__setattr__(self, "_key", self._body_text())
            if self.reasoning is not None:
                import llguidance

                llguidance.LLMatcher.grammar_from_lark(self.grammar_text())  # (the wrapper parses)
        except (ValueError, TypeError) as e:
            raise DraftsmithError(f"structured outputs: the {self.describe()} does not compile: {_one_line(str(e))}") from None

    def describe(self) -> str:
        return _KIND_NAMES[self.kind]

    def grammar_text(self, tags: ThinkTags | None = None) -> str:
        """The llguidance grammar (JSON or Lark text) this asks for, for a tokenizer whose
        <think> / </think> are written as `tags` (ThinkTags.of(tokenizer); text by default)."""
        tags = tags or ThinkTags()
        if self.reasoning is None or (self.reasoning == "optional" and not tags.tokens):
            return self._key
        # the grammar as one rule of a Lark grammar that lets a <think> block come first
        try:  # llguidance's JSON form ({"grammars": [...]}), or Lark text
            g = json.loads(self._key)["grammars"][0]
        except ValueError:
            g = {"lark_grammar": self._key}
        body = "%json " + json.dumps(g["json_schema"]) if g.get("json_schema") is not None else \
            "%lark {\n" + g["lark_grammar"] + "\n}"
        ws = r"/[ \t\r\n]*/"
        first = f"think {ws} body" if self.reasoning == "open" else f"({ws} {tags.open} think {ws})? body"
        return f"start: {first}\n{tags.think_rule}\nbody: {body}"

    def _body_text(self) -> str:
        import llguidance
        from llguidance.gbnf_to_lark import any_to_lark

        M = llguidance.LLMatcher
        options: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace, "lenient": True}
        if self.whitespace_pattern is not None:
            options["whitespace_pattern"] = self.whitespace_pattern
        if self.json is not None:
            return _json_grammar(self.json, json.dumps(options))
        if self.json_object:
            return M.grammar_from_json_schema({"type": "object"}, defaults=options)
        if self.regex is not None:
            return M.grammar_from_regex(self.regex)
        if self.choice is not None:  # JSON string literals are valid Lark literals
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        try:
            lark = any_to_lark(self.grammar)
        except Exception as e:  # (llguidance's GBNF reader raises its own kinds: GbnfToLarkError, Exception)
            raise ValueError(str(e) or type(e).__name__) from None
        return M.grammar_from_lark(lark)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems")
_COMBINED = ("allOf", "anyOf", "oneOf")


def strict_json_schema(schema: Any) -> Any:
    """`schema` with the properties and items it does not list forbidden, as vLLM's default
    structured-outputs backend forbids them: xgrammar's `compile_json_schema(..., strict_mode=True)`
    ("will not allow properties and items that is not specified in the schema. This is equivalent
    to setting unevaluatedProperties and unevaluatedItems to false"). A new schema; `schema` is
    left as it was. llguidance, the grammar engine here, lets an object schema that does not say
    otherwise take any other property (JSON Schema's meaning), so a model could add keys.
    (The grammar compiler, `_json_grammar`, closes a schema only where vLLM's "auto" backend picks
    xgrammar: one with a feature xgrammar does not support, `uniqueItems` or `multipleOf` among
    them, goes to guidance there, left open, and is compiled as written here.)

    - An object schema that lists `properties` or `patternProperties` (`{}` too) and sets neither
      `additionalProperties` nor `unevaluatedProperties` gets `additionalProperties: false`; one that
      sets `unevaluatedProperties` alone gets it as its `additionalProperties` (xgrammar reads it so
      on the object itself; llguidance does not read unevaluatedProperties). One that sets
      `additionalProperties` (true, false or a schema) keeps it.
    - An object schema that lists no properties at all (`{"type": "object"}`, as the json_object
      response format asks) stays any object: xgrammar's `{"type": "object"}` is its built-in any
      object too (the same with only annotations: title, description, default, examples, ...).
      Where such a schema has other keywords (`{"type": "object", "maxProperties": 3}`), xgrammar's
      strict mode allows only `{}` (or refuses a minProperties, and vLLM's "auto" backend then falls
      back to llguidance, open): here it stays open, not `{}`-only.
    - An array schema with `prefixItems` and neither `items` nor `unevaluatedItems` gets `items:
      false` (`unevaluatedItems` as its `items` where only that is set): the items listed, no more.
      One that lists no items at all (`{"type": "array", ...}`) stays any array, as for objects.
    - Closed recursively: properties, patternProperties, $defs / definitions, additionalProperties /
      unevaluatedProperties / items / additionalItems / unevaluatedItems schemas, prefixItems and
      anyOf / oneOf / allOf members. Not inside `not`, if / then / else, dependentSchemas or contains
      (closing there changes the logic, not only what is listed).
    - Combined schemas are left open where closing one would forbid a property another one lists
      (llguidance intersects them, as JSON Schema does): an object with a `$ref` beside its
      properties, or with `allOf` / `anyOf` / `oneOf` members that list properties (or `$ref`); a
      member of an allOf whose other members list properties; an anyOf / oneOf member of an object
      that lists properties itself; and the schema a `$ref` in such a place points to (`"allOf":
      [{"$ref": "#/$defs/Base"}, {"properties": ...}]` leaves Base open, wherever it is used, and
      what Base is made of: the schema its own `$ref` names, its allOf / anyOf / oneOf members and
      the schemas their `$ref`s name, these too wherever they are used (Base = {"oneOf": [{"$ref":
      "#/$defs/Cat"}, ...]} leaves Cat open also as another property's items: a $defs entry is one
      schema here, closed or open for every use).
      xgrammar has no such rule: it takes an allOf of several members as any value at all.
    """
    found = _Closer(frozenset())
    found.node(schema, (), "#")  # (a first pass finds the $refs combined with properties: their schemas stay open)
    return _Closer(found.left_open()).node(schema, (), "#")


def _contributes(member: Any) -> bool:
    """Whether a schema combined with another may allow properties of its own."""
    if not isinstance(member, dict):
        return False
    return any(isinstance(member.get(k), dict) for k in ("properties", "patternProperties")) or \
        any(k in member for k in ("$ref", *_COMBINED))


def _pointer(at: str, *keys: Any) -> str:
    return at + "".join("/" + str(k).replace("~", "~0").replace("/", "~1") for k in keys)


class _Closer:
    """One pass of strict_json_schema. `open_refs`: the JSON pointers ("#/$defs/Base") of schemas
    a `$ref` combines with properties elsewhere (left open); `combined_refs`: those this pass found."""

    def __init__(self, open_refs: frozenset) -> None:
        self.open_refs = open_refs
        self.combined_refs: set[str] = set()
        self.parts: dict[str, list[str]] = {}  # pointer -> what the schema there is made of: its $ref, its members

    def left_open(self) -> frozenset:
        """The combined $refs and everything they are made of: a schema left open stays open through a
        chain of $refs (A = {"$ref": B}: B too) and its allOf / anyOf / oneOf members."""
        seen, todo = set(self.combined_refs), list(self.combined_refs)
        while todo:
            for part in self.parts.get(todo.pop(), ()):
                if part not in seen:
                    seen.add(part)
                    todo.append(part)
        return frozenset(seen)

    def node(self, node: Any, others: tuple, at: str) -> Any:
        """`node` (at JSON pointer `at`) closed; `others`: the schemas it is combined with."""
        if not isinstance(node, dict):
            return node
        out = dict(node)
        lists = any(isinstance(out.get(k), dict) for k in ("properties", "patternProperties"))
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: self.node(sub, (), _pointer(at, key, name)) for name, sub in out[key].items()}
        for key in (*_SCHEMA_ONE, "prefixItems"):
            if isinstance(out.get(key), list):  # (prefixItems; draft 7's `items: [...]`)
                out[key] = [self.node(sub, (), _pointer(at, key, i)) for i, sub in enumerate(out[key])]
            elif key in out:
                out[key] = self.node(out[key], (), _pointer(at, key))
        mine = (node,) if lists else ()
        members = []
        for key in _COMBINED:
            if not isinstance(out.get(key), list):
                continue
            group = out[key]
            members += group
            # allOf: each member is combined with the others and with this schema's own properties;
            # anyOf / oneOf: alternatives, each combined with this schema's own properties alone
            out[key] = [self.node(m, mine + (tuple(group[:i] + group[i + 1:]) if key == "allOf" else ()),
                                  _pointer(at, key, i)) for i, m in enumerate(group)]
        self.parts[at] = [_pointer(at, key, i) for key in _COMBINED if isinstance(out.get(key), list)
                          for i in range(len(out[key]))] + ([out["$ref"]] if isinstance(out.get("$ref"), str) else [])
        partners = any(map(_contributes, (*others, *members)))
        if isinstance(out.get("$ref"), str) and (lists or partners):
            self.combined_refs.add(out["$ref"])
        closable = lists and not partners and "$ref" not in out and at not in self.open_refs
        if closable and "additionalProperties" not in out:
            out["additionalProperties"] = out.get("unevaluatedProperties", False)
        if isinstance(out.get("prefixItems"), list) and "items" not in out:
            out["items"] = out.get("unevaluatedItems", False)
        return out


# string formats xgrammar compiles (its json_schema_converter; vLLM's STRING_SUPPORTED_FORMATS)
_XGRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                               "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})


def _xgrammar_unsupported(schema: Any) -> bool:
    """Whether vLLM's "auto" structured-outputs backend would not give `schema` to xgrammar
    (vllm/v1/structured_output/backend_xgrammar.py `has_xgrammar_unsupported_json_features`) and
    fall back to guidance, which leaves objects open. Any dict in the schema, at any depth, is read
    as a schema whose `type` (a name or a list of names) says which rules apply:
    integer / number with `multipleOf`; array with `uniqueItems`, `contains`, `minContains` or
    `maxContains`; string with a `format` xgrammar does not know, or with `pattern` / `format`
    and `minLength` / `maxLength` together; object with `propertyNames` that has such a pattern
    and length, or `propertyNames` beside `properties`, `patternProperties`, a schema
    `additionalProperties` or an `unevaluatedProperties` other than true; object with
    `patternProperties` beside `properties` or with more than one pattern."""
    def bounded(s: Any) -> bool:
        return isinstance(s, dict) and ("pattern" in s or "format" in s) and ("minLength" in s or "maxLength" in s)

    def feature(s: dict) -> bool:
        t = s.get("type")
        types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
        if types & {"integer", "number"} and "multipleOf" in s:
            return True
        if "array" in types and any(k in s for k in ("uniqueItems", "contains", "minContains", "maxContains")):
            return True
        if "string" in types and (("format" in s and s["format"] not in _XGRAMMAR_FORMATS) or bounded(s)):
            return True
        if "object" in types:
            if "propertyNames" in s and (bounded(s["propertyNames"]) or "properties" in s or "patternProperties" in s
                                         or isinstance(s.get("additionalProperties"), dict)
                                         or s.get("unevaluatedProperties", True) is not True):
                return True
            pp = s.get("patternProperties")
            if isinstance(pp, dict) and ("properties" in s or len(pp) > 1):
                return True
        return False

    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if feature(node):
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


@functools.lru_cache(maxsize=64)  # (as many as Grammars keeps: schema texts can be long)
def _json_grammar(schema_text: str, options_text: str) -> str:
    """The llguidance grammar of a JSON schema (its text), closed as `strict_json_schema` closes it;
    `options_text`: llguidance's JSON compile options as JSON text. Compiled as written (open), as
    vLLM's default "auto" backend falls back from xgrammar to guidance (schemas left open): a schema
    with a feature xgrammar does not support (`_xgrammar_unsupported`: pydantic's `uniqueItems` for
    a set among them), and one that only the closing makes unsatisfiable (`"minProperties": 2`
    with one property listed)."""
    import llguidance

    M = llguidance.LLMatcher
    options = json.loads(options_text)

    def loose() -> str:
        return M.grammar_from_json_schema(schema_text, defaults=options)

    schema = json.loads(schema_text)
    try:
        if _xgrammar_unsupported(schema):
            return loose()
        closed = strict_json_schema(schema)
    except RecursionError:
        raise ValueError("the schema is nested too deeply") from None
    if closed == schema:
        return loose()
    tight = M.grammar_from_json_schema(json.dumps(closed), defaults=options)
    if "nsatisfiable" in M.validate_grammar(tight):
        written = loose()
        if not M.validate_grammar(written):
            return written
    return tight


@dataclass(frozen=True)
class ThinkTags:
    """How a grammar writes <think> and </think> for one tokenizer: as text, or where the
    tokenizer has them as added tokens (Qwen3's, DeepSeek-R1's), as those single tokens
    (llguidance matches an added token only by its `<name>` form, never as text). `tokens`:
    the tokenizer has <think> as a token of its own, the mark of a thinking model: only then
    may an answer open a block the prompt did not (reasoning="optional"), so that a model that
    does not think is not let into free text before its grammar."""

    open: str = '"<think>"'
    think_rule: str = "think[lazy]: /(?s:.*)<\\/think>/"  # free text up to the first </think>
    tokens: bool = False

    @classmethod
    def of(cls, tokenizer) -> ThinkTags:
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        return cls(open="<think>" if "<think>" in added else cls.open,
                   think_rule="think: /(?s:.*)/ </think>" if "</think>" in added else cls.think_rule,
                   tokens="<think>" in added)


class _LLTokenizer:
    """llguidance's view of the target's tokenizer (built once, ~1 s for a large vocabulary;
    immutable, so every Grammars of one target shares it)."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._value = None

    def get(self, hf_tokenizer):
        """Built from `hf_tokenizer` (the caller's own copy: a fast tokenizer is not shared across threads)."""
        with self._lock:
            if self._value is None:
                import llguidance

                backend = getattr(hf_tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise DraftsmithError("structured outputs need a fast (tokenizers-backed) tokenizer; "
                                          f"this target's is {type(hf_tokenizer).__name__}")
                state = json.loads(backend.to_str())
                state["padding"] = state["truncation"] = None  # the matcher tokenizes text as is
                eos = self.eos_token_ids or [hf_tokenizer.eos_token_id]
                self._value = llguidance.LLTokenizer(json.dumps(state), n_vocab=self.vocab_size, eos_token=eos)
            return self._value


class Grammars:
    """Matchers for one target's tokenizer: `matcher(spec)` compiles the spec's grammar once
    (the last `capacity` grammars are kept) and gives every request a fresh copy; `check(spec)`
    only validates (remembering the last `capacity` that passed). `share`: another Grammars of
    the same target, whose llguidance tokenizer this one uses too. `limits`: the grammar
    engine's resource limits (llguidance.LLParserLimits; None: its defaults). One thread at a
    time uses `matcher`; `check` may be called from several."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], capacity: int = 64,
                 share: Grammars | None = None, limits: Any = None) -> None:
        self._hf = tokenizer
        self._tags = ThinkTags.of(tokenizer)
        self.capacity = capacity
        self.limits = limits
        self._lltok = share._lltok if share is not None else _LLTokenizer(vocab_size, eos_token_ids)
        self._executor = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._checked: OrderedDict[str, None] = OrderedDict()
        self._check_lock = threading.Lock()

    @property
    def executor(self):
        """llguidance's thread pool for a block's masks (its default size: most of the cores)."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise a DraftsmithError that quotes the grammar engine where `spec` does not compile
        (a bad regex, a schema it cannot handle, ...)."""
        import llguidance

        key = spec.grammar_text(self._tags)
        with self._check_lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return
        err = llguidance.LLMatcher.validate_grammar(key, self._lltok.get(self._hf), limits=self.limits)
        if err:
            raise DraftsmithError(f"structured outputs: the {spec.describe()} does not compile: {_one_line(err)}")
        with self._check_lock:
            self._checked[key] = None
            while len(self._checked) > self.capacity:
                self._checked.popitem(last=False)

    def forget(self, spec: StructuredOutputsParams) -> None:
        """Drop `spec`'s compiled grammar: a request's matcher gave up on it, and llguidance's
        copies share the lexer state whose limit it hit, so the next request compiles afresh."""
        self._compiled.pop(spec.grammar_text(self._tags), None)

    def matcher(self, spec: StructuredOutputsParams):
        """A matcher at the start of `spec`'s grammar (`check`'s error where it does not compile)."""
        import llguidance

        key = spec.grammar_text(self._tags)
        base = self._compiled.get(key)
        if base is None:
            base = llguidance.LLMatcher(self._lltok.get(self._hf), key, log_level=0, limits=self.limits)
            if base.is_error():
                raise DraftsmithError(f"structured outputs: the {spec.describe()} does not compile: "
                                      f"{_one_line(base.get_error())}")
            self._compiled[key] = base
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return base.deep_copy()


def _one_line(err: str) -> str:
    """llguidance's message without its source excerpt and caret lines."""
    lines = [ln.strip() for ln in err.splitlines()]
    return " ".join(ln for ln in lines if ln and set(ln) != {"^"} and not re.match(r"\d+ \|", ln))


def allowed_tokens(bits: torch.Tensor, V: int) -> torch.Tensor:
    """Bitmasks [..., words] int32 on the CPU (bit i of word w: token 32 w + i) as bools [..., V]."""
    as_bytes = bits.contiguous().numpy().view(np.uint8)  # little-endian words: bytes in token order
    unpacked = np.unpackbits(as_bytes, axis=-1, bitorder="little")  # [..., 32 words] of 0 / 1
    return torch.from_numpy(unpacked).view(torch.bool)[..., :V]


def grammar_bits(seqs: Sequence, drafts: torch.Tensor | None, lengths: Sequence[int], V: int,
                 executor) -> tuple[torch.Tensor | None, list[int]]:
    """The grammar masks of a verify block of 1 + K positions (position j follows drafts[b, :j];
    row b has lengths[b] drafts), read from the drafts alone, before the forward: bitmasks
    [B, 1 + K, words] int32 for `masked`, or None where no row has a grammar. Each grammar row's
    matcher consumes its valid drafts to read its masks and rolls them back (llguidance does
    every row in one call, on `executor`'s threads); the positions up to and including its first
    refused draft are masked, those after it are never reached and stay all-allowed. Also
    returned: the rows whose matcher the grammar engine gave up on here (grammar_failure: e.g.
    on a draft the target would never choose), left all-allowed for the caller to renew."""
    rows = [b for b, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
    if not rows:
        return None, []
    B, S, words = len(seqs), 1 + (drafts.shape[1] if drafts is not None else 0), (V + 31) // 32
    bits = torch.full((B, S, words), -1, dtype=torch.int32)  # -1: all allowed (other rows; never reached)
    jobs = [(seqs[b].grammar, b * S, drafts[b, : lengths[b]].tolist() if drafts is not None else []) for b in rows]
    if with_drafts := [j for j in jobs if j[2]]:
        executor.unsafe_compute_mask_ptr_with_draft_token(with_drafts, bits.data_ptr(), 4 * words, B * S)
    if without := [j[:2] for j in jobs if not j[2]]:
        executor.unsafe_compute_mask_ptr(without, bits.data_ptr(), 4 * words, B * S)
    failed = []
    for b in rows:
        if grammar_failure(seqs[b]) is not None:
            failed.append(b)
            bits[b] = -1
        elif seqs[b].grammar.is_error():
            raise RuntimeError(f"grammar matcher of request {seqs[b].request_id} is in an error state: "
                               f"{_one_line(seqs[b].grammar.get_error())}")
    # A matcher allows at least EOS until it has consumed one: an empty mask is a position after
    # an EOS draft, where the engine stops; leave it unmasked.
    bits[(bits == 0).all(-1)] = -1
    return bits, failed


def masked(logits: torch.Tensor, bits: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """logits [B, S, V] with -inf at every token `bits` (grammar_bits) refuses: a new tensor, or
    `logits` itself masked with `inplace` (a pass over B x S x V floats less, where nothing else
    reads the unmasked logits)."""
    allowed = allowed_tokens(bits, logits.shape[-1]).to(logits.device)
    if inplace:
        with torch.inference_mode():  # the target's logits come from an inference-mode forward
            return logits.masked_fill_(~allowed, float("-inf"))
    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


_GAVE_UP = ("Stop: LexerTooComplex", "Stop: ParserTooComplex")  # (in llguidance 1.9's error text: stop_reason()
# then says InternalError) a grammar past the engine's limits


def grammar_failure(seq) -> str | None:
    """Why `seq`'s grammar cannot go on, where the grammar engine gave up on it (its limits:
    one line for the client), or None. (A matcher in any other error state lost track of the
    output: an engine bug, which the caller raises.)"""
    m = getattr(seq, "grammar", None)
    if m is None or not m.is_error() or not any(g in m.get_error() for g in _GAVE_UP):
        return None
    err = _one_line(m.get_error())
    err = err.split(" <state>", 1)[0]  # (llguidance appends its state and the grammar: not the client's)
    return (f"structured outputs: the grammar engine gave up on this request's grammar mid-generation ({err}); "
            "simplify the grammar (e.g. smaller repetition counts)")


def renew(seq, grammars: Grammars) -> bool:
    """After the grammar engine gave up on `seq`'s matcher (grammar_failure), possibly on drafts
    the target would never have chosen: a matcher of a fresh compile that has taken the committed
    output in their place (llguidance's copies of one compiled grammar share the state that hit
    the limit), and `error` cleared. True where it follows the output; False where the output
    itself is past the engine's limits (`error` then says why: the request ends, as it would
    without speculation)."""
    spec = seq.params.structured_outputs
    grammars.forget(spec)
    seq.grammar = grammars.matcher(spec)
    seq.error = None
    advance(seq, seq.output_ids)
    return seq.error is None


def allowed_now(matcher, V: int) -> torch.Tensor:
    """The tokens `matcher` allows next, as bools [V]."""
    bits = torch.zeros((V + 31) // 32, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), 4 * bits.numel())
    return allowed_tokens(bits, V)


def advance(seq, tokens: Sequence[int]) -> None:
    """Feed committed tokens to the request's matcher. Every committed token comes from a masked
    row, so one the grammar refuses means the matcher lost track of the output: it raises. A
    matcher that fails taking them (the grammar engine gave up: too complex) sets the request's
    `error` instead (the engine then renews the matcher, and ends that request alone where a
    fresh one fails too)."""
    m = getattr(seq, "grammar", None)
    if m is None or not tokens:
        return
    # (not checked first with validate_tokens: it stops short, without an error, where the grammar
    # engine gives up on a token. The last one alone: an EOS after the grammar stopped is taken by
    # consume_token, refused by consume_tokens; llguidance 1.9)
    tokens = list(tokens)
    ok = (len(tokens) == 1 or m.consume_tokens(tokens[:-1])) and m.consume_token(tokens[-1])
    if (why := grammar_failure(seq)) is not None:  # the grammar engine gave up (too complex): this request ends
        seq.error = why
        return
    if not ok:
        raise RuntimeError(f"committed tokens {tokens} break request {seq.request_id}'s grammar: "
                           f"{_one_line(m.get_error())}")
