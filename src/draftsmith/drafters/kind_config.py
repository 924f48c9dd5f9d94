"""Typed drafter configs from plain data (recipes, checkpoint config.json) and back.

`config_from_dict` checks every field against the config dataclass's type hints, so a
wrong type or an unknown field is a DraftsmithError naming the field, never a traceback
deep inside a model.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from draftsmith.drafters.block import choose_mask_token_id
from draftsmith.errors import DraftsmithError


def config_from_dict(data: Mapping[str, Any], cls: type, kind: str):
    """A typed `cls` config of drafter kind `kind` from plain data (JSON / YAML): unknown
    fields and wrong types are DraftsmithErrors naming the field."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DraftsmithError(f"{kind} config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    values = {}
    for key, raw in data.items():
        values[key] = _coerce(f"{kind} config field {key!r}", hints[key], raw)
    if values.get("kind", kind) != kind:
        raise DraftsmithError(f"config kind {values['kind']!r} does not match {kind!r}")
    return cls(**values)


def config_to_dict(config) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def _coerce(what: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(what, a, value)
            except DraftsmithError as e:
                errors.append(str(e))
        raise DraftsmithError(errors[0] if errors else f"{what}: got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise DraftsmithError(f"{what} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise DraftsmithError(f"{what} must be a list, got {value!r}")
        return tuple(_coerce(what, args[0], v) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise DraftsmithError(f"{what} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DraftsmithError(f"{what} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DraftsmithError(f"{what} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise DraftsmithError(f"{what} must be a string, got {value!r}")
        return value
    return value


def resolve_for_target(config, target) -> Any:
    """Fill tokenizer-dependent defaults from a LoadedTarget before `build` (the trainer's
    step): block drafters get the mask token of `block.choose_mask_token_id(V, tokenizer)`
    instead of the tokenizer-free fallback (the last vocabulary row)."""
    if getattr(config, "mask_token_id", 0) is None:
        v = target.model.config.vocab_size
        return dataclasses.replace(config, mask_token_id=choose_mask_token_id(v, target.tokenizer))
    return config
