"""SGLang's speculative flags (`python -m sglang.launch_server --speculative-algorithm ...`, or the
same names as `sglang.Engine(...)` keyword arguments) read as the speculative config that
`--speculative-config` takes (engine/speculative_config.py), so the speculative part of an SGLang
command runs on `draftsmith generate` / `serve` unchanged and one place decides drafter and K.

    --speculative-algorithm EAGLE3 --speculative-draft-model-path DIR --speculative-num-steps 3 ...
        -> {"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}

How SGLang's numbers become K (the most drafts a round verifies). SGLang counts the verify
window: `--speculative-num-draft-tokens` includes the token the round starts from, so a chain of
K drafts is num_draft_tokens = K + 1, for every algorithm.
- EAGLE3 / STANDALONE: K = `--speculative-num-steps`. SGLang takes the three numbers together or
  none of them: without num_steps it picks (num_steps, eagle_topk, num_draft_tokens) itself,
  (3, 1, 4) for STANDALONE and most targets (a 5-step top-4 tree for Llama and Grok targets),
  and refuses eagle_topk / num_draft_tokens alone (but with --speculative-adaptive); so does
  Draftsmith, with K = 3. A missing
  eagle_topk beside num_steps is 1. With eagle_topk 1, num_draft_tokens other than num_steps + 1
  is corrected to it (as SGLang does), with a warning.
- eagle_topk > 1 is SGLang's tree drafting (top-k candidates per step, num_draft_tokens of them
  verified). Draftsmith drafts one chain: it runs the chain of num_steps drafts and warns. It is
  not an error because outputs do not depend on the draft shape: every draft is verified exactly,
  so only acceptance and speed differ.
- DFLASH: K = num_draft_tokens - 1 (= `--speculative-dflash-block-size` - 1, its alias; they must
  agree); neither: the drafter's block size. num_steps / eagle_topk other than 1 warn (SGLang
  overrides them to 1).
- DSPARK: K = `--speculative-dspark-block-size` (gamma) = num_draft_tokens - 1 (they must agree);
  neither: the drafter's block size.
- NGRAM: K = num_draft_tokens - 1 (SGLang's default 12: K = 11, so Draftsmith's cap of 10 drafts a
  round), run as Draftsmith's prompt lookup (n-grams of the request's own prompt and output), not
  SGLang's trie over every request's tokens: the trie's settings (BFS breadth, match type, trie
  depth, capacity, external corpus) warn and change nothing. SGLang releases before the trie's
  rename had `--speculative-ngram-min/max-match-window-size` (defaults 1 and 12): they are the
  n-gram sizes matched, vLLM's prompt_lookup_min / _max. Without them: Draftsmith's 1..3.
- K above what the drafter drafts a round (a DFlash / DSpark block size, prompt lookup's 10) is
  lowered to it with a warning, as `--speculative-config` does; K is at most 64.

Algorithms (SGLang upper-cases the name; so does this): EAGLE3 -> eagle3, DFLASH -> dflash,
DSPARK -> dspark, STANDALONE -> draft_model (a built-in target alias or an HF-format directory),
NGRAM -> ngram. EAGLE (EAGLE-1/2 heads), NEXTN (MTP layers, which SGLang runs as EAGLE) and
FROZEN_KV_MTP are errors that say what runs instead. The draft model path is whatever
`--speculative-config`'s model is: a Draftsmith checkpoint, an SGLang / speculators EAGLE-3
directory, a z-lab DFlash directory, a built-in drafter's name.

Settings Draftsmith cannot honour are errors: relaxed acceptance
(`--speculative-accept-threshold-single` / `-acc` below 1 accept drafts exact verification
rejects: sampled outputs stop following the target; Draftsmith always verifies exactly),
a quantized draft model, a Hub revision other than SGLang's own default `main`. Settings of
SGLang's GPU runtime (attention / MoE backends, draft KV dtype, load format, CUDA-graph tiers) and
settings that change only what is drafted (token map, draft window, adaptive steps, DSpark cost and
calibration tables, the n-gram trie) warn and change nothing. `--speculative-use-rejection-sampling`
is what Draftsmith always does. The draft-length policy stays `--policy` (default: the prefix
scheduler, with K as its cap), where SGLang drafts num_steps every round.

Facts from SGLang's source: python/sglang/srt/server_args.py (the flags, their defaults and help)
and python/sglang/srt/arg_groups/speculative_hook.py (the algorithm aliases, the per-algorithm
defaults and checks, the auto-choice of num_steps / eagle_topk / num_draft_tokens).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError

# SGLang's algorithm names -> vLLM's method names (what speculative_config reads)
ALGORITHMS = {"EAGLE3": "eagle3", "DFLASH": "dflash", "DSPARK": "dspark", "STANDALONE": "draft_model",
              "NGRAM": "ngram"}
UNSUPPORTED_ALGORITHMS = {
    "EAGLE": "EAGLE-1/2 heads are not supported; EAGLE-3 drafters are (--speculative-algorithm EAGLE3)",
    "NEXTN": "MTP layers ship inside a target's own checkpoint (SGLang runs NEXTN as EAGLE); Draftsmith's targets "
             "have none: use --speculative-algorithm EAGLE3, DFLASH, DSPARK, STANDALONE or NGRAM",
    "FROZEN_KV_MTP": "Gemma-4 assistant drafts (frozen-KV MTP) are not supported",
}
AUTO_NUM_STEPS = 3  # SGLang's auto-choice (3, 1, 4) for STANDALONE and most targets: a chain of 3
NGRAM_NUM_DRAFT_TOKENS = 12  # SGLang's default for NGRAM
NGRAM_WINDOW = (1, 12)  # the match-window defaults of SGLang releases that had the flags
DRAFTSMITH_NGRAM = (1, 3)  # Draftsmith's n-gram sizes without them


@dataclass(frozen=True)
class Flag:
    """One SGLang flag: its ServerArgs field (the argparse dest and the keyword `sglang.Engine`
    takes), value type (None: a switch), help, other spellings and choices."""

    field: str
    type: Callable[[str], Any] | None
    help: str
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


_GPU = "a setting of SGLang's GPU runtime"
_DRAFTS = "changes only what is drafted, never the output"
_TRIE = "a setting of SGLang's n-gram trie; Draftsmith's NGRAM is prompt lookup in the request's own tokens"
# field -> why it is ignored (a warning names it)
IGNORED = {
    "speculative_draft_load_format": _GPU + " (Draftsmith loads the directory's safetensors)",
    "speculative_attention_mode": _GPU, "speculative_draft_attention_backend": _GPU,
    "speculative_moe_runner_backend": _GPU, "speculative_moe_a2a_backend": _GPU,
    "speculative_dsa_topk_backend": _GPU, "speculative_draft_kv_cache_dtype": _GPU,
    "speculative_skip_dp_mlp_sync": _GPU, "enable_multi_layer_eagle": _GPU,
    "speculative_dspark_align_verify_tokens_to_graph_tier": _GPU,
    "speculative_token_map": "the draft's reduced vocabulary table; Draftsmith's drafter drafts from its own "
                             "vocabulary, which " + _DRAFTS,
    "speculative_draft_window_size": "the draft's attention window, which " + _DRAFTS,
    "speculative_adaptive": "Draftsmith's --policy auto (the prefix scheduler) already picks each round's draft "
                            "length, up to K",
    "speculative_adaptive_config": "Draftsmith's --policy picks the draft length",
    "speculative_dspark_sps_table_path": "Draftsmith's prefix scheduler profiles its own step costs "
                                         "(draftsmith profile)",
    "speculative_dspark_confidence_sts_path": "Draftsmith reads the STS temperatures from the drafter "
                                              "directory's calibration.json (draftsmith calibrate)",
    **{f"speculative_ngram_{k}": _TRIE for k in ("min_bfs_breadth", "max_bfs_breadth", "match_type", "max_trie_depth",
                                                 "branch_length", "capacity", "external_corpus_path",
                                                 "external_sam_budget", "external_corpus_max_tokens")},
}

FLAGS: tuple[Flag, ...] = (
    Flag("speculative_algorithm", str, "EAGLE3, DFLASH, DSPARK, STANDALONE or NGRAM (EAGLE, NEXTN: errors)"),
    Flag("speculative_draft_model_path", str, "the draft: a drafter directory or built-in name (STANDALONE: a "
         "target alias or HF-format directory)", aliases=("--speculative-draft-model",)),
    Flag("speculative_draft_model_revision", str, "only SGLang's default, main (drafts load from local directories)"),
    Flag("speculative_num_steps", int, "EAGLE3 / STANDALONE: K, the drafts a round (SGLang picks 3 without it)"),
    Flag("speculative_eagle_topk", int, "1: a chain; above 1 SGLang drafts a tree, Draftsmith the chain of "
         "num-steps drafts (a warning)"),
    Flag("speculative_num_draft_tokens", int, "SGLang's verify window = K + 1 (NGRAM: default 12)"),
    Flag("speculative_dflash_block_size", int, "DFLASH: the verify window, = --speculative-num-draft-tokens"),
    Flag("speculative_dspark_block_size", int, "DSPARK: gamma = K"),
    Flag("speculative_accept_threshold_single", float, "only 1 (exact verification; below 1 is lossy: an error)"),
    Flag("speculative_accept_threshold_acc", float, "only 1 (exact verification; below 1 is lossy: an error)"),
    Flag("speculative_use_rejection_sampling", None, "what Draftsmith always does"),
    Flag("speculative_draft_model_quantization", str, "an error: Draftsmith loads unquantized drafters"),
    Flag("speculative_ngram_min_match_window_size", int, "NGRAM (SGLang before the trie): shortest n-gram matched"),
    Flag("speculative_ngram_max_match_window_size", int, "NGRAM (SGLang before the trie): longest n-gram matched"),
    *(Flag(f, None if f in ("speculative_skip_dp_mlp_sync", "enable_multi_layer_eagle", "speculative_adaptive",
                            "speculative_dspark_align_verify_tokens_to_graph_tier") else str,
           "ignored (a warning): " + why.split(";")[0].split(" (")[0])
      for f, why in IGNORED.items()),
)
FIELDS = {f.field: f for f in FLAGS}


def add_sglang_args(p: argparse.ArgumentParser) -> None:
    """SGLang's speculative flags, in a group of their own (`generate`, `serve`)."""
    g = p.add_argument_group("SGLang's speculative flags", "as `python -m sglang.launch_server` takes them, in "
                             "place of --drafter, -k and --speculative-config (README: SGLang's speculative flags)")
    for f in FLAGS:
        if f.type is None:
            g.add_argument(f.flag, *f.aliases, dest=f.field, action="store_true", help=f.help)
        else:
            g.add_argument(f.flag, *f.aliases, dest=f.field, type=f.type, default=None,
                           metavar=f.field.rpartition("speculative_")[2].upper() or None, help=f.help)


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The SGLang flags given on a command line (field -> value)."""
    return {f: getattr(args, f) for f in FIELDS if getattr(args, f, None) not in (None, False)}


@dataclass(frozen=True)
class Translation:
    """SGLang's flags as a speculative config (speculative_config.py reads it) and what they
    set that Draftsmith does differently (warnings, one line each)."""

    config: dict[str, Any]
    warnings: tuple[str, ...] = ()


def translate(settings: Mapping[str, Any]) -> Translation:
    """SGLang's settings (ServerArgs field names; None / False = not given) -> the speculative
    config. Pure: reads no drafter (sglang_speculative_config checks it against the drafter)."""
    s = {k: v for k, v in settings.items() if v is not None and v is not False}
    for key in s:
        if key not in FIELDS:
            close = difflib.get_close_matches(key, list(FIELDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DraftsmithError(f"unknown SGLang speculative setting {key!r}{hint}")
    algo = s.get("speculative_algorithm")
    if algo is None:
        if s:
            raise DraftsmithError(f"{FIELDS[next(iter(s))].flag} without --speculative-algorithm (SGLang ignores "
                                  "it then); give --speculative-algorithm EAGLE3, DFLASH, DSPARK, STANDALONE or NGRAM")
        raise DraftsmithError("no SGLang speculative setting given")
    if not isinstance(algo, str) or not algo.strip():
        raise DraftsmithError(f"--speculative-algorithm must be a name, got {algo!r}")
    algo = algo.strip().upper()
    where = f"--speculative-algorithm {algo}"
    if algo in UNSUPPORTED_ALGORITHMS:
        raise DraftsmithError(f"{where}: {UNSUPPORTED_ALGORITHMS[algo]}")
    if algo not in ALGORITHMS:
        close = difflib.get_close_matches(algo, [*ALGORITHMS, *UNSUPPORTED_ALGORITHMS], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise DraftsmithError(f"--speculative-algorithm {algo!r} is not one of SGLang's{hint}; Draftsmith runs "
                              f"{', '.join(ALGORITHMS)}")
    for key in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                "speculative_dflash_block_size", "speculative_dspark_block_size",
                "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size"):
        v = s.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise DraftsmithError(f"{FIELDS[key].flag} must be an integer >= 1, got {v!r}")
    _refuse_what_cannot_run(s)
    warnings = [f"{FIELDS[key].flag} has no effect in Draftsmith ({why}); ignored"
                for key, why in IGNORED.items() if key in s]
    method = ALGORITHMS[algo]
    config: dict[str, Any] = {"method": method}
    model = s.get("speculative_draft_model_path")
    if method == "ngram":
        if model is not None:
            raise DraftsmithError(f"{where} takes no --speculative-draft-model-path (got {model!r})")
    else:
        if not isinstance(model, str) or not model:
            what = ("a target alias or HF-format model directory with the target's tokenizer"
                    if method == "draft_model" else "a drafter directory or built-in name")
            raise DraftsmithError(f"{where} needs --speculative-draft-model-path: {what}")
        config["model"] = model
    k, more = _k(algo, s)
    warnings += more
    for key in ("speculative_dflash_block_size", "speculative_dspark_block_size"):
        if key in s and not key.endswith(f"{algo.lower()}_block_size"):
            warnings.append(f"{FIELDS[key].flag} is a setting of {key.split('_')[1].upper()}, not of {algo}; ignored")
    windows = [key for key in ("speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size")
               if key in s]
    if method == "ngram":
        if windows:
            lo = s.get("speculative_ngram_min_match_window_size", NGRAM_WINDOW[0])
            hi = s.get("speculative_ngram_max_match_window_size", NGRAM_WINDOW[1])
            if lo > hi:
                raise DraftsmithError(f"--speculative-ngram-min-match-window-size {lo} is above "
                                      f"--speculative-ngram-max-match-window-size {hi}")
        else:
            lo, hi = DRAFTSMITH_NGRAM
        config.update(prompt_lookup_min=lo, prompt_lookup_max=hi)
        warnings.append(f"{where} runs as Draftsmith's prompt lookup: the request's last {lo}..{hi} tokens looked "
                        "up in its own prompt and output, not SGLang's n-gram trie over every request's tokens; "
                        "outputs are the same, acceptance differs")
    elif windows:
        warnings.append(f"{FIELDS[windows[0]].flag} is a setting of NGRAM, not of {algo}; ignored")
    if k is not None:
        config["num_speculative_tokens"] = k
    return Translation(config, tuple(warnings))


def _refuse_what_cannot_run(s: Mapping[str, Any]) -> None:
    for key in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        v = s.get(key)
        if v is not None and v != 1.0:
            raise DraftsmithError(f"{FIELDS[key].flag} {v}: relaxed acceptance accepts drafts that exact verification "
                                  "rejects, so sampled outputs stop following the target; Draftsmith always "
                                  "verifies exactly (leave it out or give 1.0)")
    revision = s.get("speculative_draft_model_revision")
    if revision is not None and revision != "main":
        raise DraftsmithError(f"--speculative-draft-model-revision {revision!r}: Draftsmith loads drafters from local "
                              "directories and built-in names, not Hub revisions (leave it out or give main)")
    quant = s.get("speculative_draft_model_quantization")
    if quant is not None and quant != "unquant":
        raise DraftsmithError(f"--speculative-draft-model-quantization {quant!r}: Draftsmith does not load quantized "
                              "drafters; give the unquantized one (--drafter-dtype picks what it computes in)")


def _k(algo: str, s: Mapping[str, Any]) -> tuple[int | None, list[str]]:
    """K from SGLang's num_steps / eagle_topk / num_draft_tokens / block sizes (module doc);
    None: the drafter's own (its block size)."""
    steps, topk = s.get("speculative_num_steps"), s.get("speculative_eagle_topk")
    ndt = s.get("speculative_num_draft_tokens")
    warnings: list[str] = []
    if algo in ("EAGLE3", "STANDALONE"):
        if steps is None:
            if (topk is not None or ndt is not None) and not s.get("speculative_adaptive"):
                given_ = " / ".join(FIELDS[k].flag for k in ("speculative_eagle_topk", "speculative_num_draft_tokens")
                                    if k in s)
                raise DraftsmithError(f"{given_} without --speculative-num-steps: SGLang sets num-steps, eagle-topk "
                                      "and num-draft-tokens together or picks all three itself (and refuses this "
                                      "too); add --speculative-num-steps N for a chain of N drafts")
            return AUTO_NUM_STEPS, warnings
        topk = 1 if topk is None else topk
        if topk > 1:
            tree = f", {ndt} draft tokens verified" if ndt is not None else ""
            warnings.append(f"--speculative-eagle-topk {topk}: SGLang drafts a tree ({topk} candidates a step{tree}); "
                            f"Draftsmith drafts one chain of --speculative-num-steps {steps} (K = {steps}). Outputs "
                            "are the same (every draft is verified exactly); acceptance and speed differ")
        elif ndt is not None and ndt != steps + 1:
            warnings.append(f"--speculative-num-draft-tokens {ndt} with --speculative-eagle-topk 1 is corrected to "
                            f"--speculative-num-steps + 1 = {steps + 1} (as SGLang does); K = {steps}")
        return _in_range(steps, "--speculative-num-steps"), warnings
    if algo == "NGRAM":
        for key, v in (("speculative_num_steps", steps), ("speculative_eagle_topk", topk)):
            if v is not None:
                warnings.append(f"{FIELDS[key].flag} has no effect on NGRAM (SGLang derives it from the n-gram "
                                "trie's settings); ignored")
        if ndt is None:
            return NGRAM_NUM_DRAFT_TOKENS - 1, warnings  # (lowered to prompt lookup's cap without a word)
        return _drafts(ndt, "--speculative-num-draft-tokens"), warnings
    for key, v in (("speculative_num_steps", steps), ("speculative_eagle_topk", topk)):  # DFLASH, DSPARK
        if v is not None and v != 1:
            warnings.append(f"{FIELDS[key].flag} {v}: {algo} drafts one block a round (SGLang overrides it to 1); "
                            "ignored")
    if algo == "DFLASH":
        block = s.get("speculative_dflash_block_size")
        if block is not None and ndt is not None and block != ndt:
            raise DraftsmithError(f"--speculative-dflash-block-size {block} and --speculative-num-draft-tokens {ndt} "
                                  "differ; for DFLASH they are one number (the verify window), as in SGLang")
        window = ndt if ndt is not None else block
        return (None if window is None else _drafts(window, "--speculative-num-draft-tokens")), warnings
    gamma = s.get("speculative_dspark_block_size")  # DSPARK
    if gamma is not None and ndt is not None and ndt != gamma + 1:
        raise DraftsmithError(f"--speculative-num-draft-tokens {ndt} must be --speculative-dspark-block-size + 1 = "
                              f"{gamma + 1} (the verify window), as SGLang requires")
    if gamma is not None:
        return _in_range(gamma, "--speculative-dspark-block-size"), warnings
    return (None if ndt is None else _drafts(ndt, "--speculative-num-draft-tokens")), warnings


def _drafts(window: int, flag: str) -> int:
    """K of a verify window of `window` tokens (the one the round starts from + K drafts)."""
    if window < 2:
        raise DraftsmithError(f"{flag} {window}: the verify window holds the token a round starts from and at least "
                              "one draft, so it must be >= 2")
    return _in_range(window - 1, flag)


def _in_range(k: int, flag: str) -> int:
    from draftsmith.engine.speculative_config import MAX_SPECULATIVE_TOKENS

    if k > MAX_SPECULATIVE_TOKENS:
        raise DraftsmithError(f"{flag}: K = {k} drafts a round is above Draftsmith's {MAX_SPECULATIVE_TOKENS}")
    return k


def sglang_speculative_config(settings: Mapping[str, Any] | None = None, *,
                              checkpoint_config: Callable[[str], Mapping[str, Any]] | None = None,
                              warn: Callable[[str], None] | None = None, **kwargs: Any) -> dict[str, Any]:
    """SGLang's speculative settings -> the speculative config `LLM(speculative_config=...)` and
    `--speculative-config` take, checked against the drafter (its kind, its block size); every
    warning goes to `warn` (default: stderr, as LLM prints the config's warnings). Settings as
    `sglang.Engine(...)` takes them:

        LLM("smollm2-135m", speculative_config=sglang_speculative_config(
            speculative_algorithm="DSPARK", speculative_draft_model_path="smollm2-135m"))
    """
    from draftsmith.drafters.checkpoint import read_checkpoint_config
    from draftsmith.drafters.ngram import NgramConfig
    from draftsmith.engine.speculative_config import drafter_kind, speculative_setup

    read = checkpoint_config or read_checkpoint_config
    t = translate({**(settings or {}), **kwargs})
    config, warnings = dict(t.config), list(t.warnings)
    method, model = config["method"], config.get("model")
    algo = next(a for a, m in ALGORITHMS.items() if m == method)
    if method != "ngram":
        found = drafter_kind(model, read) if method != "draft_model" or Path(model).expanduser().is_dir() else None
        if found is not None and found != method:
            right = next((a for a, m in ALGORITHMS.items() if m == found), found)
            raise DraftsmithError(f"--speculative-algorithm {algo}, but --speculative-draft-model-path {model} holds a "
                                  f"{found} drafter; give --speculative-algorithm {right}")
    try:  # the drafter's own K: the cap of a DFlash / DSpark block, K where SGLang's flags give none
        own = speculative_setup({k: v for k, v in config.items() if k != "num_speculative_tokens"}
                                if method in ("dflash", "dspark") else config, read)
    except DraftsmithError as e:
        raise DraftsmithError(f"--speculative-algorithm {algo}: {str(e).removeprefix('speculative config: ')}") \
            from None
    k = config.get("num_speculative_tokens")
    cap = own.num_speculative_tokens if method in ("dflash", "dspark") else \
        NgramConfig().max_draft if method == "ngram" else None
    if k is not None and cap is not None and k > cap:
        if not (method == "ngram" and "speculative_num_draft_tokens" not in {**(settings or {}), **kwargs}):
            warnings.append(f"K = {k} (from SGLang's flags) is above the {cap} drafts {own.drafter} makes a round; "
                            f"K = {cap}")
        config["num_speculative_tokens"] = cap
    out = warn or (lambda w: print(f"draftsmith: warning: {w}", file=sys.stderr, flush=True))
    for w in warnings:
        out(w)
    return config
