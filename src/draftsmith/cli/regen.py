"""`draftsmith regen` (Mint stage 1): regenerate every assistant turn of a prompt mix with the target."""

from __future__ import annotations

import sys
from pathlib import Path

from draftsmith.cli.options import (add_job, add_max_tokens, add_prefix_caching, add_progress, add_target_args, opt_auto,
                                    positive_int)
from draftsmith.errors import DraftsmithError

HELP = "regenerate every assistant turn of a prompt mix with the target"
EXAMPLE = "draftsmith regen --mix code:0.4,chat:0.6 --max-samples 200 --max-tokens 128 --out data/regen.jsonl"


def add_parser(sub) -> None:
    p = add_job(sub, "regen", HELP, EXAMPLE)
    add_target_args(p)
    p.add_argument("--mix", default="code:0.4,chat:0.6",
                   help="weighted prompt sources, e.g. code:0.4,chat:0.6 or a .jsonl/.parquet file")
    p.add_argument("--split", default="train", choices=["train", "heldout"], help="prompt split")
    p.add_argument("--max-samples", type=positive_int, default=None, help="number of conversations (default: all)")
    p.add_argument("--out", type=Path, default=Path("data/regen.jsonl"), help="output JSONL")
    p.add_argument("--resume", action="store_true", help="skip ids already in --out, continue the rest")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--temperature", type=float, default=None, help="default: target's recommended, else 0.7")
    p.add_argument("--top-p", type=float, default=None, help="default: target's recommended, else 0.8")
    p.add_argument("--top-k", type=int, default=None, help="default: target's recommended, else 0 (off)")
    add_max_tokens(p, 256, "new tokens per assistant turn")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="context limit per turn, prompt + answer (default: the engine's 2048; with --endpoint "
                        "no local check unless given)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per answer: derived from seed, id, turn)")
    p.add_argument("--mix-seed", type=int, default=None, help="sample-selection seed (default: --seed)")
    p.add_argument("--exclude", type=Path, action="append", default=[], metavar="FILE",
                   help="leave out the conversation ids in FILE (a regen JSONL, or one id a line); repeatable. "
                        "Extends a data set made elsewhere: --max-samples picks the list first, then these go")
    p.add_argument("--batch-size", type=positive_int, default=8, help="built-in engine: conversations in flight")
    add_prefix_caching(p, "built-in engine: a turn's prompt starts with the conversation so far", on=True)
    p.add_argument("--features-out", type=Path, default=None, metavar="DIR",
                   help="built-in engine: also write the feature cache `draftsmith cache` would build from --out "
                        "to DIR, recorded while the target answers (no second pass over the tokens)")
    p.add_argument("--feature-layers", default="default",
                   help="--features-out: 0-based decoder layer ids, e.g. 1,14,27 (default: low/mid/high)")
    p.add_argument("--feature-dtype", default="fp16", choices=["fp16", "bf16", "fp32"],
                   help="--features-out: storage dtype of the features")
    p.add_argument("--endpoint", default=None,
                   help="OpenAI-compatible server URL, e.g. http://host:8000/v1 (default: the built-in engine)")
    p.add_argument("--endpoint-model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--concurrency", type=positive_int, default=8, help="--endpoint: requests in flight")
    p.add_argument("--retries", type=int, default=3, help="--endpoint: retries on 5xx/429/timeouts")
    p.add_argument("--request-timeout", type=float, default=120.0, help="--endpoint: seconds per request")
    p.add_argument("--retry-backoff", type=float, default=0.5, help="--endpoint: first retry delay (doubles)")
    add_progress(p)
    p.set_defaults(func=cmd_regen)


def cmd_regen(args) -> int:
    from draftsmith.data.regen import RegenConfig, errors_path, run_regen

    if args.resume and args.overwrite:
        raise DraftsmithError("--resume and --overwrite exclude each other")
    cfg = RegenConfig(
        target=args.target, mix=args.mix, out=args.out, split=args.split, max_samples=args.max_samples,
        exclude=tuple(args.exclude), mix_seed=args.mix_seed, seed=args.seed, temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k, max_new_tokens=args.max_new_tokens, max_len=args.max_len, batch_size=args.batch_size,
        endpoint=args.endpoint, endpoint_model=args.endpoint_model, concurrency=args.concurrency,
        retries=max(0, args.retries), request_timeout=args.request_timeout, retry_backoff=args.retry_backoff,
        resume=args.resume, overwrite=args.overwrite, device=opt_auto(args.device), dtype=opt_auto(args.dtype),
        progress=args.progress, enable_prefix_caching=args.enable_prefix_caching, adaptive_threads=args.threads is None,
        features_out=args.features_out, feature_layers=args.feature_layers, feature_dtype=args.feature_dtype,
    )
    s = run_regen(cfg)
    print(f"regen: {s.written} written, {s.errors} errors, {s.skipped_done} already done; "
          f"{s.generated_tokens} tokens in {s.wall_s:.1f}s ({s.tokens_per_s:.1f} tok/s) -> {args.out}"
          + (f"; prefix caching reused {s.cached_prompt_tokens} of {s.prompt_tokens} prompt tokens"
             if s.cached_prompt_tokens else "")
          + (f" (errors: {errors_path(args.out)})" if s.errors else "")
          + (f"; features of {s.recorded_features} conversations recorded, {s.computed_features} computed after "
             f"-> {args.features_out}" if args.features_out else ""), file=sys.stderr)
    if s.errors and not s.written and not s.skipped_done:  # (exit 0 here let `regen && cache` go on with nothing)
        errors = errors_path(args.out)
        raise DraftsmithError(f"every conversation failed ({s.errors}); the first: {s.first_error} "
                              f"(all in {errors})")
    return 0
