"""What a regen run is configured with: `RegenConfig` (the job's options) and the sampling
they resolve to (`RegenSampling`: the target's recommended settings unless overridden, with a
per-answer seed from `turn_seed`)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftsmith.core.sampling import SamplingParams
from draftsmith.data.features import spelled_layer_ids
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import read_json

FALLBACK_TEMPERATURE = 0.7
FALLBACK_TOP_P = 0.8


@dataclass
class RegenConfig:
    target: str = "smollm2-135m"
    mix: str = "code:0.4,chat:0.6"
    out: Path = Path("data/regen.jsonl")
    split: str = "train"
    max_samples: int | None = None
    mix_seed: int | None = None  # sample selection seed (default: the sampling seed)
    # Ids to leave out of the selected list (regen JSONLs or id lists): extend a data set made
    # elsewhere (--max-samples picks the list first, then these are dropped).
    exclude: tuple[Path, ...] = ()
    seed: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int = 256
    max_len: int | None = None  # context limit per turn (prompt + answer); engine default 2048,
    # endpoint default: no local check (the server answers 400 and the sample goes to errors)
    batch_size: int = 8  # built-in engine: conversations in flight
    enable_prefix_caching: bool | None = None  # built-in engine: a turn reuses the KV of the conversation so far
    adaptive_threads: bool = True  # built-in engine: fewer threads while other processes keep cores busy
    endpoint: str | None = None
    endpoint_model: str | None = None
    concurrency: int = 8
    retries: int = 3
    request_timeout: float = 120.0
    retry_backoff: float = 0.5
    resume: bool = False
    overwrite: bool = False
    device: str | None = None
    dtype: str | None = None
    progress: bool | None = None  # None = only on a terminal
    # Built-in engine: record the target's features while it answers and write the feature cache
    # `draftsmith cache` would (data/feature_recorder.py) to this directory: no second pass.
    features_out: Path | None = None
    feature_layers: str | None = None  # 0-based layer ids, e.g. "1,14,27" (None: low/mid/high)
    feature_dtype: str = "fp16"  # storage dtype of the features

    def __post_init__(self) -> None:
        """What is wrong before anything loads, in the flags' own names."""
        if self.endpoint is not None and not self.endpoint.strip():  # ('' ran the built-in engine instead)
            raise DraftsmithError("--endpoint is empty; give an OpenAI-compatible server's URL, e.g. "
                                  "http://host:8000/v1, or leave --endpoint out to regenerate with the built-in engine")
        for path in self.exclude:  # before the mix is read: a wrong path fails at once
            path = Path(path)
            if not path.is_file():
                from draftsmith.data.regen_records import missing_exclude  # (it imports this module)

                raise missing_exclude(path)
            if Path(self.out).is_file() and os.path.samefile(path, self.out):
                raise DraftsmithError(f"--exclude {path} is --out: --resume alone skips what --out holds (and "
                                      "--overwrite would delete what --exclude reads)")
        if isinstance(self.feature_layers, str):  # the spelling; the depth is checked once the target loads
            spelled_layer_ids(self.feature_layers, "--feature-layers")


@dataclass(frozen=True)
class RegenSampling:
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int
    origin: str  # where temperature/top_p came from: "generation_config", "fallback", "cli" or a mix

    def to_dict(self) -> dict:
        return asdict(self)


def recommended_sampling(model_dir: Path | None) -> dict[str, Any]:
    """The target's recommended sampling (generation_config.json), else T=0.7, top-p 0.8."""
    gen: dict[str, Any] = {}
    f = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if f is not None and f.is_file():
        try:
            gen = read_json(f, "generation config")
        except DraftsmithError:  # not JSON / not UTF-8: the fallback, as before
            gen = {}
    out: dict[str, Any] = {}
    if gen.get("do_sample") is False:
        out.update(temperature=0.0, top_p=1.0, origin="generation_config")
        return out
    has_t, has_p = isinstance(gen.get("temperature"), (int, float)), isinstance(gen.get("top_p"), (int, float))
    out["temperature"] = float(gen["temperature"]) if has_t else FALLBACK_TEMPERATURE
    out["top_p"] = float(gen["top_p"]) if has_p else FALLBACK_TOP_P
    if isinstance(gen.get("top_k"), int):
        out["top_k"] = int(gen["top_k"])
    out["origin"] = "generation_config" if (has_t or has_p) else "fallback"
    return out


def resolve_sampling(model_dir: Path | None, temperature: float | None, top_p: float | None,
                     top_k: int | None, max_new_tokens: int, seed: int) -> RegenSampling:
    rec = recommended_sampling(model_dir)
    origin = rec["origin"]
    if temperature is not None or top_p is not None or top_k is not None:
        origin = "cli" if (temperature is not None and top_p is not None) else f"cli+{origin}"
    t = rec["temperature"] if temperature is None else float(temperature)
    p = rec["top_p"] if top_p is None else float(top_p)
    k = rec.get("top_k", 0) if top_k is None else int(top_k)
    SamplingParams(max_tokens=max_new_tokens, temperature=t, top_p=p, top_k=k)  # validates
    return RegenSampling(temperature=t, top_p=p, top_k=k, max_new_tokens=int(max_new_tokens),
                         seed=int(seed), origin=origin)


def turn_seed(seed: int, conversation_id: str, turn: int) -> int:
    """Per-answer seed from (run seed, id, turn): a resumed or re-batched run reproduces."""
    d = hashlib.sha256(f"{seed}\0{conversation_id}\0{turn}".encode()).digest()
    return int.from_bytes(d[:8], "big") & ((1 << 63) - 1)
