"""A target's recommended sampling, as vLLM applies it (its --generation-config).

A model's generation_config.json may carry its maker's sampling (Qwen2.5: temperature 0.7,
top_p 0.8, top_k 20, repetition_penalty 1.05). vLLM uses those as the defaults of every request
that leaves a field unset; so does Draftsmith's server and `LLM.generate` without sampling
params. The fields read are vLLM's: temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens (as the default max_tokens); a value equal to transformers' own default (which
the file need not have written) is no recommendation and is left out, as vLLM's diff is.

source: "auto" (the target's own file), "vllm" (none: the neutral defaults), or a directory
that holds a generation_config.json. `override`: fields that replace the file's (vLLM's
--override-generation-config), any of the six.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import read_json

# transformers' GenerationConfig defaults for the fields vLLM reads (a file's value equal to one is no diff)
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                                "repetition_penalty": 1.0, "max_new_tokens": None}
FIELDS = tuple(_HF_DEFAULTS)
SOURCES = ("auto", "vllm")


def sampling_defaults(model_dir: str | Path, source: str = "auto",
                      override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The request defaults `source` recommends for the target at `model_dir` (see the module
    docstring), under SamplingParams' names (max_new_tokens -> max_tokens); {} where none."""
    where = Path(model_dir) if source == "auto" else Path(source).expanduser()
    path = where / "generation_config.json"
    if source != "vllm" and source != "auto" and not where.is_dir():
        raise DraftsmithError(f"--generation-config {source}: not a directory; give \"auto\" (the target's own "
                              "generation_config.json), \"vllm\" (none) or a directory that holds one")
    if source == "vllm" or source == "auto" and not path.is_file():  # (a target without the file: none)
        found: dict[str, Any] = {}
    else:
        data = read_json(path, "generation config")
        if not isinstance(data, dict):
            raise DraftsmithError(f"generation config {path} is not a JSON object")
        found = {k: data[k] for k in FIELDS if data.get(k) is not None and data[k] != _HF_DEFAULTS[k]}
        found = _checked(found, str(path))
    found.update(_checked(dict(override or {}), "--override-generation-config"))
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    return found


def _checked(fields: dict[str, Any], where: str) -> dict[str, Any]:
    """`fields` (None values dropped) whose names and values SamplingParams can take, else a
    DraftsmithError naming `where`. top_k -1 or 0: all tokens."""
    fields = {k: v for k, v in fields.items() if v is not None}
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise DraftsmithError(f"{where}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a sampling "
                              f"default; the fields read are {', '.join(FIELDS)}")
    for k, v in fields.items():
        integral = k in ("top_k", "max_new_tokens")
        ok = (isinstance(v, int) if integral else isinstance(v, (int, float))) and not isinstance(v, bool)
        if not ok or not math.isfinite(v) or v < {"max_new_tokens": 1, "top_k": -1}.get(k, 0):
            kind = ("a positive integer" if k == "max_new_tokens" else "an integer >= -1" if integral
                    else "a number >= 0")
            raise DraftsmithError(f"{where}: {k} must be {kind}, got {v!r}")
    return {k: (v if k in ("top_k", "max_new_tokens") else float(v)) for k, v in fields.items()}
