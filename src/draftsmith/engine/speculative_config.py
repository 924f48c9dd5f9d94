"""vLLM's `--speculative-config` (and `LLM(speculative_config=...)`) read as Draftsmith's drafter
spec, K and draft-length policy, so a vLLM command line or Python call runs here unchanged.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    {"method": "eagle3", "model": "exports/eagle3", "num_speculative_tokens": 3}
    {"model": "runs/my-dspark"}                     (method read from the directory, K its block size)
    {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "method": "draft_model", "num_speculative_tokens": 4}

Methods: ngram (and ngram_gpu, "[ngram]"), eagle3, dflash, dspark, draft_model. `model` is what
`--drafter KIND:ARG` takes: a Draftsmith checkpoint, a speculators / DeepSpec / z-lab directory
(imported in memory), a built-in drafter's name (dspark + smollm2-135m), or for draft_model a
built-in target alias or an HF-format directory. Without `method`, a drafter directory's own
config.json names its kind (vLLM guesses from the model's name); anything else is a draft model,
as in vLLM.

Where vLLM and Draftsmith differ (README, `--speculative-config`):
- the draft-length policy stays Draftsmith's `--policy` (default: the prefix scheduler, which
  verifies drafts only where they pay on this machine); `num_speculative_tokens` is its cap.
  `num_speculative_tokens_per_batch_size` is vLLM's batch-size schedule (the batch-schedule
  policy; gaps and the sizes past the last range take the K before them, as vLLM's lookup does).
- ngram without prompt_lookup_min/max keeps Draftsmith's 1..3 (vLLM's default is 5..5; a
  warning says so); with one of them, the other equals it, as in vLLM.
- K above what the drafter drafts in a round (a DFlash / DSpark block size, prompt lookup's 10)
  is lowered to it, with a warning; K is at most 64.
- settings of vLLM's GPU runtime (enforce_eager, attention_backend, kv_cache_dtype, ...) change
  nothing here: a warning names them. Settings Draftsmith cannot honour (tensor parallel drafts,
  quantized or revisioned drafters, lossy or block verification, heterogeneous vocabularies) are
  errors that say so: a config must never run as something else without a word.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from draftsmith.drafters import registry
from draftsmith.drafters.checkpoint import read_checkpoint_config
from draftsmith.drafters.ngram import NgramConfig
from draftsmith.errors import DraftsmithError
from draftsmith.export.detect import config_path, markers
from draftsmith.fileio import read_json
from draftsmith.policy.batch_schedule import BatchSizeSchedule

# vLLM's method names -> Draftsmith's drafter kinds
METHODS = {"ngram": "ngram", "[ngram]": "ngram", "ngram_gpu": "ngram", "eagle3": "eagle3", "dflash": "dflash",
           "dspark": "dspark", "draft_model": "draft-model"}
# methods vLLM has and Draftsmith does not, with what to do instead
UNSUPPORTED_METHODS = {
    "eagle": "EAGLE-1 heads are not supported; EAGLE-3 is (method eagle3)",
    "mtp": "MTP layers ship inside a target's own checkpoint; Draftsmith's targets have none",
    "medusa": "Medusa heads are not supported",
    "mlp_speculator": "MLP speculators are not supported",
    "suffix": "suffix decoding is not supported; prompt lookup is (method ngram)",
    "custom_class": "custom proposer classes are not loaded; register a drafter kind in Python "
                    "(draftsmith.drafters.registry.register) and pass --drafter KIND:ARG",
    "extract_hidden_states": "hidden-state extraction is not a drafter; `draftsmith regen --features-out` records "
                             "the target's features",
}
# vLLM GPU-runtime settings that have no meaning here: accepted with a warning
NO_EFFECT = ("enforce_eager", "attention_backend", "kv_cache_dtype", "moe_backend", "disable_padded_drafter_batch",
             "disable_eagle_block_drop", "use_local_argmax_reduction", "draft_load_config", "code_revision",
             "max_model_len", "dspark_draft_topk", "parallel_drafting", "index_share_for_mtp_iteration")
MAX_SPECULATIVE_TOKENS = 64  # K above it is a mistake (and would profile verify forwards that long)
HONOURED = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
            "num_speculative_tokens_per_batch_size", "enable_adaptive_verification", "draft_tensor_parallel_size",
            "tensor_parallel_size", "quantization", "revision", "rejection_sample_method", "draft_sample_method",
            "use_heterogeneous_vocab", "synthetic_acceptance_rates", "synthetic_acceptance_length",
            "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
            "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
KNOWN = HONOURED + NO_EFFECT
_WHERE = "speculative config"  # (vLLM's --speculative-config and LLM(speculative_config=...) alike)


@dataclass(frozen=True)
class SpeculativeSetup:
    """What a speculative config means here: the drafter spec (drafters/registry.py), K (its
    checkpoint's block size / TTT depth where the config gives none) and the draft-length policy
    the config asks for (None: the caller's own)."""

    drafter: str
    num_speculative_tokens: int
    policy: str | BatchSizeSchedule | None = None
    warnings: tuple[str, ...] = ()


def parse_speculative_config(config: str | Mapping[str, Any]) -> dict[str, Any]:
    """A JSON object's text (as `--speculative-config` takes it) or a mapping -> a plain dict."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            # (the line too: a --speculative-config file has several)
            raise DraftsmithError(f"{_WHERE}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); give a "
                                  """JSON object such as '{"method": "ngram", "num_speculative_tokens": 5}'""") from None
        except RecursionError:
            raise DraftsmithError(f"{_WHERE}: JSON nested too deeply; its settings are numbers, strings and "
                                  "one list of [bs_lo, bs_hi, K] entries") from None
    if not isinstance(config, Mapping):
        raise DraftsmithError(f"{_WHERE} must be a JSON object, got {type(config).__name__}")
    bad = [k for k in config if not isinstance(k, str)]
    if bad:
        raise DraftsmithError(f"{_WHERE}: setting names are strings, got {bad[0]!r}")
    return dict(config)


def speculative_setup(config: str | Mapping[str, Any], checkpoint_config: Callable[[str], Mapping[str, Any]]
                      = read_checkpoint_config) -> SpeculativeSetup:
    """Read vLLM's speculative config (module doc). Every problem is a DraftsmithError that names
    the setting; settings without meaning here come back as `warnings` (the caller prints them)."""
    c = parse_speculative_config(config)
    for key in c:
        if key not in KNOWN:
            close = difflib.get_close_matches(key, KNOWN, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DraftsmithError(f"{_WHERE}: unknown setting {key!r}{hint}; vLLM's settings that Draftsmith reads: "
                                  f"{', '.join(HONOURED)}")
    warnings = [f"{_WHERE}: {key} has no effect in Draftsmith (a setting of vLLM's GPU runtime); ignored"
                for key in NO_EFFECT if c.get(key) not in (None, False)]
    _refuse_what_cannot_run(c)
    if c.get("draft_sample_method") == "greedy":
        warnings.append(f"{_WHERE}: draft_sample_method greedy: Draftsmith's drafters sample their drafts from their "
                        "own distribution at temperature > 0 (vLLM's probabilistic) and verify them exactly; "
                        "outputs follow the target either way")
    kind, arg = _method_and_model(c, checkpoint_config)
    k = c.get("num_speculative_tokens")
    if k is not None and not (_positive_int(k) and k <= MAX_SPECULATIVE_TOKENS):
        raise DraftsmithError(f"{_WHERE}: num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
                              f"got {k!r}")
    if c.get("enable_adaptive_verification") and kind != "dspark":
        raise DraftsmithError(f"{_WHERE}: enable_adaptive_verification needs method dspark (its confidence head), as "
                              "in vLLM; Draftsmith's --policy prefix-scheduler (the default) adapts K for every drafter")
    if kind == "ngram":
        arg = _ngram_settings(c)
        if not arg:
            warnings.append(f"{_WHERE}: ngram without prompt_lookup_min / prompt_lookup_max matches 1..3 tokens "
                            "(Draftsmith's default; vLLM's is 5..5)")
    elif any(c.get(key) is not None for key in ("prompt_lookup_min", "prompt_lookup_max")):
        raise DraftsmithError(f"{_WHERE}: prompt_lookup_min / prompt_lookup_max are settings of method ngram, "
                              f"not of {c.get('method') or kind}")
    spec = f"{kind}:{arg}" if arg else kind
    entry = registry.get(kind)
    cap = None  # the most drafts the drafter makes a round
    if kind == "ngram":
        cap = NgramConfig().max_draft
    elif entry.trainable:
        _, path = registry.parse_spec(spec)
        default = entry.default_k(checkpoint_config(path))
        cap = default if kind in ("dflash", "dspark") else None  # (EAGLE-3 drafts past its TTT depth)
        k = default if k is None else k
    if k is None:
        raise DraftsmithError(f"{_WHERE}: method {c.get('method') or kind} needs num_speculative_tokens "
                              "(the most drafts a round verifies)")
    if cap is not None and k > cap:
        warnings.append(f"{_WHERE}: num_speculative_tokens {k} is above the {cap} drafts {spec} makes a round; "
                        f"K = {cap}")
        k = cap
    return SpeculativeSetup(spec, int(k), _policy(c, int(k)), tuple(warnings))


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _refuse_what_cannot_run(c: Mapping[str, Any]) -> None:
    tp = c.get("draft_tensor_parallel_size")
    if tp is not None and not (_positive_int(tp) and tp == 1):
        raise DraftsmithError(f"{_WHERE}: draft_tensor_parallel_size {tp!r}: Draftsmith runs the drafter on the "
                              "target's one device; leave it out or give 1")
    if "tensor_parallel_size" in c:
        raise DraftsmithError(f"{_WHERE}: tensor_parallel_size is not a speculative setting (vLLM refuses it too: "
                              "draft_tensor_parallel_size is); leave it out")
    for key, why in (("quantization", "Draftsmith does not load quantized drafters; give the unquantized one "
                                      "(--drafter-dtype picks what it computes in)"),
                     ("revision", "Draftsmith loads drafters from local directories and built-in names, not "
                                  "Hub revisions")):
        if c.get(key) is not None:
            raise DraftsmithError(f"{_WHERE}: {key} {c[key]!r}: {why}")
    method = c.get("rejection_sample_method", "standard")
    if method != "standard":
        raise DraftsmithError(f"{_WHERE}: rejection_sample_method {method!r}: Draftsmith verifies drafts by exact "
                              "rejection sampling only (standard), so outputs follow the target's distribution")
    for key in ("synthetic_acceptance_rates", "synthetic_acceptance_length"):
        if c.get(key) is not None:
            raise DraftsmithError(f"{_WHERE}: {key} belongs to synthetic (lossy) verification, which Draftsmith "
                                  "does not do")
    if c.get("draft_sample_method", "greedy") not in ("greedy", "probabilistic"):
        raise DraftsmithError(f"{_WHERE}: draft_sample_method must be greedy or probabilistic, "
                              f"got {c['draft_sample_method']!r}")
    if c.get("use_heterogeneous_vocab"):
        raise DraftsmithError(f"{_WHERE}: use_heterogeneous_vocab: a Draftsmith draft model must share the target's "
                              "tokenizer")
    suffix = [key for key in c if key.startswith("suffix_decoding_")]
    if suffix:
        raise DraftsmithError(f"{_WHERE}: {', '.join(suffix)}: {UNSUPPORTED_METHODS['suffix']}")
    if not isinstance(c.get("enable_adaptive_verification", False), bool):
        raise DraftsmithError(f"{_WHERE}: enable_adaptive_verification must be true or false")


def _method_and_model(c: Mapping[str, Any], checkpoint_config) -> tuple[str, str]:
    """(drafter kind, its ARG) of `method` and `model`, vLLM's inference where `method` is absent."""
    method, model = c.get("method"), c.get("model")
    for key, v in (("method", method), ("model", model)):
        if v is not None and (not isinstance(v, str) or not v):
            raise DraftsmithError(f"{_WHERE}: {key} must be a non-empty string, got {v!r}")
    if method is None:
        if model is None:
            raise DraftsmithError(f"{_WHERE} needs a method or a model, e.g. "
                                  """'{"method": "ngram", "num_speculative_tokens": 5}'""")
        if model in ("ngram", "[ngram]"):
            return "ngram", ""
        parts = model.split(".")
        if "/" not in model and len(parts) >= 2 and all(p.isidentifier() for p in parts):  # vLLM: a class path
            raise DraftsmithError(f"{_WHERE}: model {model!r} reads as a proposer class (vLLM's custom_class): "
                                  f"{UNSUPPORTED_METHODS['custom_class']}")
        kind = drafter_kind(model, checkpoint_config)
        if kind is None and not _a_model(model):
            raise DraftsmithError(f"{_WHERE}: model {model!r} is no directory, built-in drafter or built-in target; "
                                  "give a drafter directory, a model directory or an alias")
        return (kind, model) if kind else ("draft-model", model)
    if method in UNSUPPORTED_METHODS or method.endswith("_mtp"):  # (vLLM's deprecated names of mtp: deepseek_mtp ...)
        why = UNSUPPORTED_METHODS.get(method, UNSUPPORTED_METHODS["mtp"])
        raise DraftsmithError(f"{_WHERE}: method {method!r}: {why}")
    if method not in METHODS:
        close = difflib.get_close_matches(method, list(METHODS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DraftsmithError(f"{_WHERE}: unknown method {method!r}{hint}; Draftsmith runs "
                              f"{', '.join(m for m in METHODS if not m.startswith('['))}")
    kind = METHODS[method]
    if kind == "ngram":
        if model not in (None, "ngram", "[ngram]", "ngram_gpu"):
            raise DraftsmithError(f"{_WHERE}: method ngram takes no model (got {model!r})")
        return kind, ""
    if model is None:
        raise DraftsmithError(f"{_WHERE}: method {method} needs a model: "
                              + ("a model directory or alias with the target's tokenizer" if kind == "draft-model"
                                 else f"a drafter directory or built-in name (--drafter {kind}:ARG takes the same)"))
    if kind != "draft-model":
        found = drafter_kind(model, checkpoint_config)
        if found and found != kind:
            raise DraftsmithError(f"{_WHERE}: method {method}, but {model} holds a {found} drafter; "
                                  f"give method {_vllm_name(found)} or leave method out")
    return kind, model


def _a_model(model: str) -> bool:
    """`model` can be a draft model: a directory, or a built-in target's alias."""
    from pathlib import Path

    from draftsmith.models.registry import BUILTIN_TARGETS

    return Path(model).expanduser().is_dir() or model in BUILTIN_TARGETS


def drafter_kind(model: str,
                 checkpoint_config: Callable[[str], Mapping[str, Any]] = read_checkpoint_config) -> str | None:
    """The trained drafter kind in directory or built-in name `model` (what `model` without
    `method` is read as); None where it is no drafter (no config.json, or one without a drafter
    layout's markers: a model directory). A drafter directory that fails its own checks is that
    error, not a draft model."""
    for kind in registry.trainable_kinds():
        try:
            _, path = registry.parse_spec(f"{kind}:{model}")
        except DraftsmithError:
            continue  # neither a directory nor this kind's built-in name
        f = config_path(path)
        if not f.is_file():
            return None
        cfg = read_json(f, "drafter config")  # (an unreadable one: its error, not a draft model)
        if not isinstance(cfg, dict) or not markers(cfg) and "kind" not in cfg:
            return None
        return str(checkpoint_config(path)["kind"])
    return None


def _vllm_name(kind: str) -> str:
    return next(m for m, k in METHODS.items() if k == kind)


def _ngram_settings(c: Mapping[str, Any]) -> str:
    """ngram's ARG from prompt_lookup_min / _max (one given sets both: vLLM's rule, which the
    ngram spec applies too); neither, Draftsmith's defaults (empty ARG)."""
    lo, hi = c.get("prompt_lookup_min"), c.get("prompt_lookup_max")
    for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if v is not None and not _positive_int(v):
            raise DraftsmithError(f"{_WHERE}: {key} must be an integer >= 1, got {v!r}")
    if lo is not None and hi is not None and lo > hi:
        raise DraftsmithError(f"{_WHERE}: prompt_lookup_min {lo} must be <= prompt_lookup_max {hi}")
    return ",".join(f"{key}={v}" for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)) if v is not None)


def _policy(c: Mapping[str, Any], k: int) -> str | BatchSizeSchedule | None:
    schedule = c.get("num_speculative_tokens_per_batch_size")
    if schedule is not None and c.get("enable_adaptive_verification"):
        raise DraftsmithError(f"{_WHERE}: num_speculative_tokens_per_batch_size and enable_adaptive_verification "
                              "choose two draft-length policies; give one")
    if schedule is not None:
        return batch_schedule(schedule, k)
    if c.get("enable_adaptive_verification"):
        return "prefix-scheduler"
    return None


def batch_schedule(entries: Any, k: int) -> BatchSizeSchedule:
    """vLLM's num_speculative_tokens_per_batch_size, [[bs_lo, bs_hi, K], ...] with inclusive,
    sorted, non-overlapping ranges from batch size 1, as a BatchSizeSchedule: a gap takes the K of
    the range before it and batch sizes past the last range its K (vLLM's lookup); every K is
    capped at num_speculative_tokens `k`. (vLLM's 5-item rows, per context length, are refused.)"""
    what = f"{_WHERE}: num_speculative_tokens_per_batch_size"
    if not isinstance(entries, list) or not entries:
        raise DraftsmithError(f"{what} must be a non-empty list of [bs_lo, bs_hi, K] entries")
    rows: list[tuple[int, int, int]] = []
    for e in entries:
        if not isinstance(e, (list, tuple)) or len(e) not in (3, 5):
            raise DraftsmithError(f"{what}: each entry is [bs_lo, bs_hi, K], got {e!r}")
        if len(e) == 5:
            raise DraftsmithError(f"{what}: entries by context length ([bs_lo, bs_hi, ctx_lo, ctx_hi, K]) are not "
                                  "supported; give [bs_lo, bs_hi, K]")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in e):
            raise DraftsmithError(f"{what}: entries hold integers, got {e!r}")
        lo, hi, kk = e
        if lo < 1 or hi < lo or kk < 0:
            raise DraftsmithError(f"{what}: {e!r} needs 1 <= bs_lo <= bs_hi and K >= 0")
        rows.append((lo, hi, kk))
    rows.sort()
    if rows[0][0] != 1:
        raise DraftsmithError(f"{what}: the first range must start at batch size 1, got {list(rows[0])}")
    for (_, hi, _), (lo, _, _) in zip(rows, rows[1:]):
        if lo <= hi:
            raise DraftsmithError(f"{what}: ranges overlap at batch size {lo}")
    # (max batch, K): a range reaches up to the next range's start (a gap takes its K); the last has no end
    table = [(nxt[0] - 1, min(kk, k)) for (_, _, kk), nxt in zip(rows, rows[1:])]
    table.append((2**31 - 1, min(rows[-1][2], k)))
    return BatchSizeSchedule(tuple(table))


def default_k(drafter: Any) -> int:
    """K where none is given: a trained drafter's block size (EAGLE-3: its TTT depth), inside
    `lookup:SPEC` too, as with a speculative config and in `bench`; else 5."""
    if not isinstance(drafter, str):
        return 5
    kind, arg = registry.parse_spec(drafter)
    if kind.wrap is not None:
        return default_k(arg)
    return kind.default_k(read_checkpoint_config(arg), 5) if kind.trainable else 5


def with_speculative_config(config: str | Mapping[str, Any] | None, drafter: Any, num_speculative_tokens: int | None,
                            policy: Any) -> tuple[Any, int, Any, tuple[str, ...]]:
    """`LLM`'s (drafter, K, policy) with vLLM's speculative config applied: the config names the
    drafter and K, so a drafter or K given beside it (other than the defaults "none" / None) is
    an error, and a policy the config asks for (a batch schedule, adaptive verification) beside
    another policy than "auto" too. Returns (drafter, K, policy, warnings)."""
    if num_speculative_tokens is not None and not 0 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise DraftsmithError(f"num_speculative_tokens (K) must be in 0..{MAX_SPECULATIVE_TOKENS}, "
                              f"got {num_speculative_tokens}")
    if config is None:
        return drafter, default_k(drafter) if num_speculative_tokens is None else num_speculative_tokens, policy, ()
    setup = speculative_setup(config)
    if not (isinstance(drafter, str) and drafter == "none"):
        raise DraftsmithError(f"a drafter is given twice: {drafter!r} and {_WHERE} (drafter {setup.drafter}); give one")
    if num_speculative_tokens is not None and num_speculative_tokens != setup.num_speculative_tokens:
        raise DraftsmithError(f"K is given twice: num_speculative_tokens {num_speculative_tokens} and {_WHERE}'s "
                              f"{setup.num_speculative_tokens}; give it in one place")
    if setup.policy is not None:
        wanted = setup.policy if isinstance(setup.policy, str) else setup.policy.name
        given = policy.partition(":")[0] if isinstance(policy, str) else None
        if given not in ("auto", wanted):
            raise DraftsmithError(f"two draft-length policies: {policy!r} and {_WHERE}'s {wanted}; give one")
        if given == "auto" or not isinstance(setup.policy, str):  # (a policy spec with settings stays)
            policy = setup.policy
    return setup.drafter, setup.num_speculative_tokens, policy, setup.warnings
