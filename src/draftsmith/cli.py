"""One entry point: `draftsmith <job> ...`.

User errors (DraftsmithError, bad flags) print one line and exit 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.drafters import registry
from draftsmith.errors import DraftsmithError
from draftsmith.policy.registry import policies


def _positive_int(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="built-in alias or HF-format model dir")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")


def _policy_help() -> str:
    return "draft-length policy: " + "; ".join(f"{p.name} = {p.summary}" for p in policies().values())


def _add_speculation_args(p: argparse.ArgumentParser) -> None:
    """--drafter / --num-speculative-tokens / --policy, from the registries (generate, serve)."""
    p.add_argument("--drafter", default="none", help=f"{registry.usage()} (default: none)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=5, help="draft length K (default: 5)")
    p.add_argument("--policy", default="fixed", choices=list(policies()), help=_policy_help() + " (default: fixed)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftsmith", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="job", required=True, metavar="JOB")

    g = sub.add_parser("generate", help="generate text, optionally with speculative decoding")
    _add_target_args(g)
    _add_speculation_args(g)
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument("--prompt-file", type=Path, help="one prompt per line (.txt) or JSONL with prompt/messages")
    g.add_argument("--chat", action="store_true", help="apply the target's chat template")
    g.add_argument("--max-batch", type=_positive_int, default=8)
    g.add_argument("--max-len", type=_positive_int, default=2048, help="context limit per prompt (prompt + output)")
    _add_sampling_args(g)
    g.add_argument("--json", action="store_true", help="print results and stats as JSON")
    g.set_defaults(func=cmd_generate)
    _add_serve_parser(sub)
    _add_data_parsers(sub)  # regen, cache
    _add_mint_verify_parsers(sub)  # train, calibrate, eval
    _add_bench_parser(sub)  # bench
    _add_profile_parser(sub)  # profile
    for cmd in sub.choices.values():  # one CPU-threads option, the same on every job
        cmd.add_argument("--threads", type=_positive_int, default=None,
                         help="CPU threads for the model's kernels (default: the physical cores)")
    return ap


def _read_prompts(args) -> list:
    prompts: list = list(args.prompt)
    f: Path | None = args.prompt_file
    if f is not None:
        if not f.is_file():
            raise DraftsmithError(f"prompt file {f} does not exist")
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DraftsmithError(f"prompt file {f} is not valid UTF-8 (byte {e.start}); save it as UTF-8") from None
        if f.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DraftsmithError(f"{f}:{n}: not valid JSON ({e.msg})") from None
                if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                    prompts.append(rec["prompt"])
                elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                    prompts.append(rec["messages"])
                else:
                    raise DraftsmithError(f"{f}:{n}: expected an object with a 'prompt' string or 'messages' list")
        else:
            prompts.extend(line for line in text.splitlines() if line.strip())
    if not prompts:
        raise DraftsmithError("no prompt given: use --prompt TEXT or --prompt-file FILE")
    return prompts


def cmd_generate(args) -> int:
    from draftsmith.api import LLM
    from draftsmith.core.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
    )
    if args.num_speculative_tokens < 0:
        raise DraftsmithError("--num-speculative-tokens must be >= 0")
    prompts = _read_prompts(args)
    llm = LLM(
        args.target, drafter=args.drafter, num_speculative_tokens=args.num_speculative_tokens,
        policy=args.policy, max_batch=args.max_batch, max_len=args.max_len, device=args.device, dtype=args.dtype,
    )
    ids = []
    for p in prompts:
        if isinstance(p, list):
            ids.append(llm.apply_chat_template(p))
        elif args.chat:
            ids.append(llm.apply_chat_template([{"role": "user", "content": p}]))
        else:
            ids.append(llm.encode(p))
    outs = llm.generate(ids, params)
    stats = llm.last_stats
    if args.json:
        print(json.dumps({
            "target": llm.target.target_id, "drafter": args.drafter,
            "results": [
                {"prompt": p if isinstance(p, str) else None, "text": o.text, "token_ids": o.token_ids,
                 "finish_reason": o.finish_reason, "stats": o.stats}
                for p, o in zip(prompts, outs)
            ],
            "stats": stats.to_dict() if stats else {},
        }))
        return 0
    for o in outs:
        print(o.text)
        if len(outs) > 1:
            print("-" * 40)
    if stats:
        print(
            f"\n[{args.drafter}] {stats.output_tokens} tokens in {stats.wall_time_s:.2f}s "
            f"({stats.tokens_per_s:.1f} tok/s) | target forwards/token {stats.forwards_per_token:.3f} | "
            f"τ {stats.tau:.2f} | acceptance {stats.acceptance_rate:.2f} "
            f"({stats.draft_accepted}/{stats.draft_proposed}) | prefix survival "
            + " ".join(f"{x:.2f}" for x in stats.prefix_survival[:8]),
            file=sys.stderr,
        )
    return 0


# ---- serve (OpenAI-compatible HTTP server) -------------------------------------------


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)")
    _add_target_args(s)
    _add_speculation_args(s)
    s.add_argument("--max-batch", type=_positive_int, default=8, help="KV rows = requests running at once")
    s.add_argument("--max-len", type=_positive_int, default=2048, help="context limit per request (prompt + output)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: the target id)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $DRAFTSMITH_API_KEY, else none)")
    s.add_argument("--max-choices-per-request", type=_positive_int, default=None,
                   help="prompts x n one request may ask for (default 256)")
    s.add_argument("--max-prompt-bytes", type=_positive_int, default=None,
                   help="UTF-8 bytes of prompt text per request (default 1 MiB)")
    s.add_argument("--max-queued-tokens", type=_positive_int, default=None,
                   help="prompt + max_tokens of all unfinished requests; past it, 429 (default 32 x max-batch x max-len)")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import os

    from draftsmith.api import LLM

    if args.num_speculative_tokens < 0:
        raise DraftsmithError("--num-speculative-tokens must be >= 0")
    if not 0 <= args.port <= 65535:
        raise DraftsmithError(f"--port must be in 0..65535, got {args.port}")
    llm = LLM(
        args.target, drafter=args.drafter, num_speculative_tokens=args.num_speculative_tokens,
        policy=args.policy, max_batch=args.max_batch, max_len=args.max_len, device=args.device, dtype=args.dtype,
    )
    from draftsmith.server.app import Limits, serve

    given = {"max_choices": args.max_choices_per_request, "max_prompt_bytes": args.max_prompt_bytes,
             "max_queued_tokens": args.max_queued_tokens}
    limits = Limits(**{k: v for k, v in given.items() if v is not None})
    api_key = args.api_key or os.environ.get("DRAFTSMITH_API_KEY") or None
    print(
        f"draftsmith: serving {args.served_model_name or llm.target.target_id} (drafter {args.drafter}, "
        f"max batch {args.max_batch}, context {llm.engine.max_len}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr, flush=True,
    )
    serve(llm, host=args.host, port=args.port, log_level=args.log_level, model_name=args.served_model_name,
          api_key=api_key, limits=limits)
    return 0


# ---- end serve ----------------------------------------------------------------------


# ---- data: regen, cache (Mint stages 1-2) ---------------------------------------------


def _add_data_parsers(sub) -> None:
    p = sub.add_parser("regen", help="regenerate every assistant turn of a prompt mix with the target")
    _add_target_args(p)
    p.add_argument("--mix", default="code:0.4,chat:0.6",
                   help="weighted prompt sources, e.g. code:0.4,chat:0.6 or a .jsonl/.parquet file")
    p.add_argument("--split", default="train", choices=["train", "heldout"])
    p.add_argument("--max-samples", type=_positive_int, default=None, help="number of conversations")
    p.add_argument("--out", type=Path, default=Path("data/regen.jsonl"), help="output JSONL")
    p.add_argument("--resume", action="store_true", help="skip ids already in --out, continue the rest")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--temperature", type=float, default=None, help="default: target's recommended, else 0.7")
    p.add_argument("--top-p", type=float, default=None, help="default: target's recommended, else 0.8")
    p.add_argument("--top-k", type=int, default=None, help="default: target's recommended, else 0 (off)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=256, help="per assistant turn")
    p.add_argument("--max-len", type=_positive_int, default=None,
                   help="context limit per turn, prompt + answer (engine default 2048; with --endpoint "
                        "no local check unless given)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per answer: derived from seed, id, turn)")
    p.add_argument("--mix-seed", type=int, default=None, help="sample-selection seed (default: --seed)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="built-in engine: conversations in flight")
    p.add_argument("--endpoint", default=None, help="OpenAI-compatible server URL (e.g. http://host:8000/v1)")
    p.add_argument("--endpoint-model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--concurrency", type=_positive_int, default=8, help="--endpoint: requests in flight")
    p.add_argument("--retries", type=int, default=3, help="--endpoint: retries on 5xx/429/timeouts")
    p.add_argument("--request-timeout", type=float, default=120.0, help="--endpoint: seconds per request")
    p.add_argument("--retry-backoff", type=float, default=0.5, help="--endpoint: first retry delay (doubles)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: only on a terminal)")
    p.set_defaults(func=cmd_regen)

    c = sub.add_parser("cache", help="store target hidden states of regenerated data (sharded safetensors)")
    c.add_argument("--target", default="smollm2-135m", help="built-in alias or HF-format model dir")
    c.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    c.add_argument("--model-dtype", default="auto", help="dtype to run the target in (float32, bfloat16, ...)")
    c.add_argument("--data", type=Path, default=Path("data/regen.jsonl"), help="regen JSONL")
    c.add_argument("--layers", default="default", help="0-based decoder layer ids, e.g. 1,14,27 (default: low/mid/high)")
    c.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"], help="storage dtype of features")
    c.add_argument("--out", type=Path, default=Path("cache"), help="cache directory")
    c.add_argument("--shard-tokens", type=_positive_int, default=8192, help="tokens per shard (whole samples)")
    c.add_argument("--split", default=None, choices=["train", "heldout"], help="cache only this split")
    c.add_argument("--estimate", action="store_true", help="print the size it would take, write nothing")
    c.add_argument("--resume", action="store_true", help="continue after the last complete shard")
    c.add_argument("--overwrite", action="store_true", help="replace an existing cache in --out")
    c.add_argument("--allow-target-mismatch", action="store_true",
                   help="cache data regenerated by a different target")
    c.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    c.set_defaults(func=cmd_cache)


def cmd_regen(args) -> int:
    from draftsmith.data.regen import RegenConfig, errors_path, run_regen

    if args.resume and args.overwrite:
        raise DraftsmithError("--resume and --overwrite exclude each other")
    cfg = RegenConfig(
        target=args.target, mix=args.mix, out=args.out, split=args.split, max_samples=args.max_samples,
        mix_seed=args.mix_seed, seed=args.seed, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, max_new_tokens=args.max_new_tokens, max_len=args.max_len, batch_size=args.batch_size,
        endpoint=args.endpoint, endpoint_model=args.endpoint_model, concurrency=args.concurrency,
        retries=max(0, args.retries), request_timeout=args.request_timeout, retry_backoff=args.retry_backoff,
        resume=args.resume, overwrite=args.overwrite,
        device=None if args.device == "auto" else args.device, dtype=None if args.dtype == "auto" else args.dtype,
        progress=args.progress,
    )
    s = run_regen(cfg)
    print(f"regen: {s.written} written, {s.errors} errors, {s.skipped_done} already done; "
          f"{s.generated_tokens} tokens in {s.wall_s:.1f}s ({s.tokens_per_s:.1f} tok/s) -> {args.out}"
          + (f" (errors: {errors_path(args.out)})" if s.errors else ""), file=sys.stderr)
    return 0


def cmd_cache(args) -> int:
    from draftsmith.data.cache import CacheConfig, run_cache

    if args.resume and args.overwrite:
        raise DraftsmithError("--resume and --overwrite exclude each other")
    run_cache(CacheConfig(
        target=args.target, data=args.data, out=args.out, layers=args.layers, dtype=args.dtype,
        shard_tokens=args.shard_tokens, estimate=args.estimate, resume=args.resume, overwrite=args.overwrite,
        split=args.split, device=None if args.device == "auto" else args.device,
        model_dtype=None if args.model_dtype == "auto" else args.model_dtype,
        allow_target_mismatch=args.allow_target_mismatch, progress=args.progress,
    ))
    return 0


# ---- end data ---------------------------------------------------------------------------


# ---- mint + verify: train, calibrate, eval (Mint stage 3, Verify) ---------------------------


def _add_mint_verify_parsers(sub) -> None:
    t = sub.add_parser("train", help="train a drafter from a recipe (torchrun-ready: DDP over gloo / nccl)")
    t.add_argument("--config", type=Path, required=True, help="recipe YAML, e.g. recipes/smollm2-135m-dspark.yaml")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides parsed as YAML, e.g. train.lr=3e-4 data.cache=cache/ drafter.num_layers=2")
    t.add_argument("--budget", type=float, default=None, metavar="MINUTES",
                   help="wall-clock budget: size the run from a timing probe and stop at the deadline")
    t.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                   help="continue exactly from the newest checkpoint of the run dir (or the one given)")
    t.add_argument("--overwrite", action="store_true", help="discard the run dir's checkpoints and start again")
    t.add_argument("--json", action="store_true", help="print the result as JSON (rank 0)")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("calibrate", help="fit Sequential Temperature Scaling on held-out data; store calibration.json")
    c.add_argument("--target", default="smollm2-135m", help="built-in alias or HF-format model dir")
    c.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    c.add_argument("--drafter", required=True,
                   help=f"KIND:CHECKPOINT of a trainable kind ({', '.join(registry.trainable_kinds())}), "
                        "e.g. dspark:runs/smollm2-135m-dspark")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=Path, help="held-out regen JSONL (draftsmith regen --split heldout)")
    src.add_argument("--tasks", help="held-out prompts of these sources, e.g. humaneval,mtbench")
    _add_eval_run_args(c, max_prompts=16, seed=1)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_calibrate)

    e = sub.add_parser("eval", help="τ, per-position acceptance and calibration of drafters on held-out prompts")
    e.add_argument("--target", default="smollm2-135m", help="built-in alias or HF-format model dir")
    e.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    e.add_argument("--drafter", action="append", required=True,
                   help=f"{registry.usage()}; repeat to compare")
    e.add_argument("--tasks", default="humaneval,mtbench", help="comma-separated sources (held-out split only)")
    e.add_argument("--confidence-threshold", type=float, default=None,
                   help="verify only the prefix whose cumulative confidence stays >= this")
    e.add_argument("--out", type=Path, default=Path("runs/eval"), help="report.json, report.md, PNG plots")
    _add_eval_run_args(e, max_prompts=8, seed=0)
    e.add_argument("--json", action="store_true", help="print report.json to stdout")
    e.set_defaults(func=cmd_eval)


def _add_eval_run_args(p: argparse.ArgumentParser, max_prompts: int, seed: int) -> None:
    p.add_argument("--temperature", type=float, default=1.0, help="target sampling temperature (0 = greedy)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="draft tokens per round γ (default: the checkpoint's block size)")
    p.add_argument("--max-prompts", type=_positive_int, default=max_prompts, help="per task")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="per turn")
    p.add_argument("--max-turns", type=_positive_int, default=2, help="user turns replayed per conversation")
    p.add_argument("--max-batch", type=_positive_int, default=4, help="requests decoded together")
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--bins", type=_positive_int, default=10, help="calibration bins")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)


def _tasks(spec: str) -> tuple[str, ...]:
    tasks = tuple(t.strip() for t in spec.split(",") if t.strip())
    if not tasks:
        raise DraftsmithError("--tasks is empty; e.g. --tasks humaneval,mtbench")
    return tasks


def cmd_train(args) -> int:
    from draftsmith.train.config import load_train_config
    from draftsmith.train.trainer import Trainer

    overrides = list(args.overrides)
    if isinstance(args.resume, str) and "=" in args.resume and not Path(args.resume).exists():
        overrides.insert(0, args.resume)  # `--resume key=value`: argparse took an override as the path
        args.resume = True
    if args.resume and args.overwrite:
        raise DraftsmithError("--resume and --overwrite exclude each other")
    if args.budget is not None and args.budget <= 0:
        raise DraftsmithError(f"--budget must be a positive number of minutes, got {args.budget}")
    cfg = load_train_config(args.config, overrides, budget_minutes=args.budget)
    trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite)
    res = trainer.fit()
    if trainer.info is not None and trainer.info.is_main:
        summary = {"out": str(cfg.out), "checkpoint": str(res.checkpoint) if res.checkpoint else None,
                   "step": res.step, "total_steps": res.total_steps, "final_loss": res.final_loss,
                   "stopped_at_deadline": res.stopped_at_deadline}
        if args.json:
            print(json.dumps(summary))
        else:
            print(f"train: {cfg.kind} {res.step}/{res.total_steps} steps, final loss "
                  f"{res.final_loss if res.final_loss is None else round(res.final_loss, 4)} -> {cfg.out}",
                  file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    from draftsmith.eval.jobs import CalibrateOptions, run_calibrate

    res = run_calibrate(CalibrateOptions(
        target=args.target, drafter=args.drafter, data=args.data, tasks=_tasks(args.tasks) if args.tasks else (),
        temperature=args.temperature, block_size=args.block_size, max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens, max_batch=args.max_batch, max_turns=args.max_turns, seed=args.seed,
        n_bins=args.bins, device=None if args.device == "auto" else args.device, progress=args.progress))
    if args.json:
        print(json.dumps(res))
    else:
        fmt = lambda xs: " ".join("–" if x is None else f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"calibrate: {res['rounds']} held-out rounds ({res['requests']} requests); temperatures "
              f"{fmt(res['temperatures'])}; cumulative ECE per position {fmt(res['ece_before'])} -> "
              f"{fmt(res['ece_after'])} (in-sample) -> {res['calibration']}", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from draftsmith.eval.jobs import EvalOptions, print_summary, run_eval

    if args.temperature < 0:
        raise DraftsmithError(f"--temperature must be >= 0, got {args.temperature}")
    report = run_eval(EvalOptions(
        target=args.target, drafters=tuple(args.drafter), tasks=_tasks(args.tasks), temperature=args.temperature,
        block_size=args.block_size, confidence_threshold=args.confidence_threshold, max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens, max_batch=args.max_batch, max_turns=args.max_turns, seed=args.seed,
        n_bins=args.bins, out=args.out, device=None if args.device == "auto" else args.device,
        progress=args.progress))
    if args.json:
        print(json.dumps(report))
    print_summary(report)
    print(f"eval: report -> {args.out / 'report.json'}, {args.out / 'report.md'}", file=sys.stderr)
    return 0


# ---- end mint + verify ------------------------------------------------------------------


# ---- bench (Decide) -----------------------------------------------------------------------


def _add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="speedup / latency / cost report across concurrency tiers, go/no-go per tier")
    _add_target_args(b)
    b.add_argument("--drafter", action="append", default=[],
                   help=f"{registry.usage()}; repeatable. The no-speculation baseline (none) is always measured")
    b.add_argument("--workload", default="humaneval",
                   help="humaneval | mtbench | sharegpt | code | chat | a .jsonl/.parquet prompt file")
    b.add_argument("--split", default=None, choices=["heldout", "train", "all"],
                   help="prompt split (default: heldout for built-in sources, all for a file)")
    b.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated tiers, e.g. 1,4,16")
    b.add_argument("--requests", type=_positive_int, default=16, help="measured requests per tier and configuration")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked against the baseline)")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--max-tokens", type=_positive_int, default=64, help="new tokens per request")
    b.add_argument("--arrival", default="closed", help="closed (a user per concurrency slot) or poisson:RATE (req/s)")
    b.add_argument("--warmup", type=int, default=2, help="unmeasured requests per configuration at each tier's start")
    b.add_argument("--repeats", type=_positive_int, default=1, help="interleaved repetitions per tier")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--num-speculative-tokens", "-k", type=_positive_int, default=None,
                   help="draft length K (default: the checkpoint's block size, else 5)")
    b.add_argument("--policy", default="fixed", choices=list(policies()), help=_policy_help())
    b.add_argument("--endpoint", action="append", default=[], metavar="[LABEL=]URL",
                   help="benchmark an OpenAI-compatible server instead (repeatable; label `none` = the baseline)")
    b.add_argument("--endpoint-model", default=None, help="model name to send (default: the server's first)")
    b.add_argument("--request-timeout", type=float, default=600.0, help="--endpoint: seconds per request")
    b.add_argument("--peers", default=None, choices=["hf"], help="also run HF transformers at batch 1 on the same prompts")
    b.add_argument("--peer-assistant", default=None, metavar="PATH",
                   help="--peers hf: a draft model for HF assisted generation (assistant_model)")
    b.add_argument("--peer-lookup-tokens", type=_positive_int, default=10, help="--peers hf: prompt_lookup_num_tokens")
    b.add_argument("--dollars-per-hour", type=float, default=None, help="machine price, for cost per 1M output tokens")
    b.add_argument("--mem-bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth for the physical-limit column (default: measured after the run)")
    b.add_argument("--max-prompt-tokens", type=_positive_int, default=None,
                   help="skip longer prompts (default: what fits the context with --max-tokens)")
    b.add_argument("--out", type=Path, default=Path("runs/bench"), help="report.json, report.md, PNGs, results.jsonl")
    b.add_argument("--resume", action="store_true", help="keep finished tiers in --out and run the rest")
    b.add_argument("--overwrite", action="store_true", help="discard earlier results in --out")
    b.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: only on a terminal)")
    b.add_argument("--json", action="store_true", help="print report.json to stdout")
    b.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from draftsmith.bench import BenchConfig, headline_table, run_bench
    from draftsmith.bench.config import parse_arrival, parse_concurrency, parse_endpoint

    cfg = BenchConfig(
        target=args.target, drafters=tuple(args.drafter), workload=args.workload, split=args.split,
        concurrency=parse_concurrency(args.concurrency), requests=args.requests, temperature=args.temperature,
        top_p=args.top_p, max_tokens=args.max_tokens, arrival=parse_arrival(args.arrival), warmup=args.warmup,
        repeats=args.repeats, seed=args.seed, num_speculative_tokens=args.num_speculative_tokens,
        policy=args.policy, endpoints=tuple(parse_endpoint(e, i) for i, e in enumerate(args.endpoint)),
        endpoint_model=args.endpoint_model, request_timeout=args.request_timeout,
        peers=(args.peers,) if args.peers else (), peer_assistant=args.peer_assistant,
        peer_lookup_tokens=args.peer_lookup_tokens, dollars_per_hour=args.dollars_per_hour,
        mem_bandwidth_gbs=args.mem_bandwidth_gbs, max_prompt_tokens=args.max_prompt_tokens, out=args.out,
        resume=args.resume, overwrite=args.overwrite, device=None if args.device == "auto" else args.device,
        dtype=None if args.dtype == "auto" else args.dtype, progress=args.progress,
    )
    path = run_bench(cfg)
    if args.json:
        print(path.read_text())
    print(headline_table(path), file=sys.stderr)
    print(f"bench: report -> {path}, {path.with_name('report.md')}", file=sys.stderr)
    return 0


# ---- end bench ------------------------------------------------------------------------------


# ---- profile (what verification costs on this hardware) --------------------------------------


def _add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="what a target forward of 1..64 tokens costs here, against the "
                       "memory-bandwidth floor; stores the SPS(B) table the prefix scheduler uses")
    _add_target_args(p)
    p.add_argument("--max-batch", type=_positive_int, default=8, help="rows of the SPS(B) table (as generate / serve)")
    p.add_argument("--num-speculative-tokens", "-k", type=_positive_int, default=7,
                   help="longest verify block of the SPS(B) table (max-batch x (k + 1) tokens)")
    p.add_argument("--context-len", type=int, default=200, help="cached tokens per row while timing")
    p.add_argument("--repeats", type=_positive_int, default=7, help="timed forwards per point (median)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    from draftsmith.models.target import load_target
    from draftsmith.policy.profile import ProfileConfig, load_or_profile
    from draftsmith.policy.roofline import runtime_profile

    if args.context_len < 0:
        raise DraftsmithError(f"--context-len must be >= 0, got {args.context_len}")
    target = load_target(args.target, device=args.device, dtype=args.dtype, threads=args.threads)
    doc = {"target": target.target_id, **runtime_profile(target.model, context_len=args.context_len,
                                                          repeats=args.repeats)}
    cfg = ProfileConfig(max_batch=args.max_batch, max_k=args.num_speculative_tokens,
                        repeats=args.repeats, context_len=args.context_len)
    sps = load_or_profile(target.model, weights_hash=target.weights_hash, name=target.target_id,
                          config=cfg, refresh=True)
    doc["sps"] = sps.to_dict()
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"{doc['target']} on {doc['device']} ({doc['dtype']}, {doc['threads']} threads, "
          f"{doc['linear_backend']} linears): {doc['weight_bytes'] / 1e6:.0f} MB of weights per step, "
          f"read bandwidth {doc['bandwidth_gbs']:.1f} GB/s -> floor {doc['floor_ms']:.2f} ms/token")
    print(f"decode {doc['decode_ms']:.2f} ms/token = {doc['decode_over_floor']:.2f}x the floor")
    print("tokens per forward  " + " ".join(f"{t:>6d}" for t in doc["tokens"]))
    print("step ms             " + " ".join(f"{t:6.2f}" for t in doc["step_ms"]))
    print("in decode steps     " + " ".join(f"{t:6.2f}" for t in doc["verify_in_decode_steps"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from draftsmith.models.threads import configure_threads

        configure_threads(args.threads)
        return int(args.func(args) or 0)
    except DraftsmithError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
