"""`draftsmith generate`: text from the target, optionally with speculative decoding."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.cli.options import (add_job, json_text_or_file, add_prefix_caching, add_sampling_args, add_speculation_args,
                                    add_target_args, positive_int, speculative_config)
from draftsmith.errors import DraftsmithError

HELP = "generate text, optionally with speculative decoding"
EXAMPLE = ('draftsmith generate --drafter ngram --prompt "Write a Python function that reverses a string." '
           "--chat --max-tokens 128")


def add_parser(sub) -> None:
    g = add_job(sub, "generate", HELP, EXAMPLE)
    add_target_args(g)
    add_speculation_args(g)
    add_prefix_caching(g, "prompts that share a prefix with an earlier one", on=False)
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument("--prompt-file", type=Path, help="one prompt per line (.txt) or JSONL with prompt/messages")
    g.add_argument("--chat", action="store_true", help="apply the target's chat template")
    g.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=positive_int, default=8,
                   help="prompts decoded together (KV rows)")
    g.add_argument("--max-len", "--max-model-len", dest="max_len", type=positive_int, default=2048,
                   help="context limit per prompt (prompt + output)")
    add_sampling_args(g)
    so = g.add_mutually_exclusive_group()  # structured outputs (core/structured.py), vLLM's kinds
    so.add_argument("--json-schema", metavar="FILE|JSON", help="every output is JSON that keeps to this schema "
                    "(a file, or the schema itself)")
    so.add_argument("--json-object", action="store_true", help="every output is a JSON object")
    so.add_argument("--regex", help="every output matches this regular expression")
    so.add_argument("--choice", action="append", help="every output is one of these strings (repeatable)")
    so.add_argument("--grammar", type=Path, metavar="FILE",
                    help="every output keeps to this grammar (GBNF as in vLLM's docs, or Lark)")
    g.add_argument("--json-whitespace", action=argparse.BooleanOptionalAction, default=True,
                   help="--json-schema / --json-object: allow any whitespace between JSON tokens (vLLM's default); "
                        "--no-json-whitespace: compact JSON")
    g.add_argument("--json", action="store_true", help="print results and stats as JSON")
    g.set_defaults(func=cmd_generate)


def read_prompts(args) -> list:
    prompts: list = list(args.prompt)
    f: Path | None = args.prompt_file
    if f is not None:
        if f.is_dir():
            raise DraftsmithError(f"prompt file {f} is a directory; give a .txt file (one prompt per line) or a "
                                  ".jsonl file")
        if not f.is_file():
            raise DraftsmithError(f"prompt file {f} does not exist")
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DraftsmithError(f"prompt file {f} is not valid UTF-8 (byte {e.start}); save it as UTF-8") from None
        if f.suffix.lower() == ".jsonl":  # (as eval's and regen's prompt files: PROMPTS.JSONL too)
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DraftsmithError(f"{f}:{n}: not valid JSON ({e.msg})") from None
                except RecursionError:
                    raise DraftsmithError(f"{f}:{n}: JSON nested too deeply") from None
                if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                    prompts.append(rec["prompt"])
                elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                    if not rec["messages"] or not all(  # (content null: an assistant message with tool_calls)
                            isinstance(m, dict) and isinstance(m.get("role"), str)
                            and (isinstance(m.get("content"), (str, list))
                                 or m.get("content") is None and isinstance(m.get("tool_calls"), list))
                            for m in rec["messages"]):
                        raise DraftsmithError(f"{f}:{n}: 'messages' must be a non-empty list of "
                                              '{"role": ..., "content": "..."} objects')
                    prompts.append(rec["messages"])
                else:
                    raise DraftsmithError(f"{f}:{n}: expected an object with a 'prompt' string or 'messages' list")
        else:
            prompts.extend(line for line in text.splitlines() if line.strip())
    if not prompts:
        raise DraftsmithError("no prompt given: use --prompt TEXT or --prompt-file FILE")
    return prompts


def structured_outputs(args):
    """The StructuredOutputsParams that --json-schema / --json-object / --regex / --choice /
    --grammar ask for, or None."""
    from draftsmith.core.structured import StructuredOutputsParams

    if args.json_schema is not None:
        return StructuredOutputsParams(json=json_text_or_file(args.json_schema, "--json-schema"),
                                       disable_any_whitespace=not args.json_whitespace)
    if args.grammar is not None:
        if not args.grammar.is_file():
            raise DraftsmithError(f"--grammar {args.grammar}: no such file")
        try:
            text = args.grammar.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DraftsmithError(f"--grammar {args.grammar} is not UTF-8 text (byte {e.start}); give a GBNF or "
                                  "Lark grammar file") from None
        return StructuredOutputsParams(grammar=text)
    if args.json_object or args.regex is not None or args.choice:
        return StructuredOutputsParams(json_object=args.json_object, regex=args.regex, choice=args.choice,
                                       disable_any_whitespace=not args.json_whitespace)
    return None


def cmd_generate(args) -> int:
    from draftsmith.api import LLM
    from draftsmith.core.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, structured_outputs=structured_outputs(args),
    )
    prompts = read_prompts(args)
    llm = LLM(
        args.target, drafter=args.drafter, speculative_config=speculative_config(args),
        drafter_dtype=args.drafter_dtype,
        enable_prefix_caching=args.enable_prefix_caching, threads=args.threads,
        num_speculative_tokens=args.num_speculative_tokens,
        policy=args.policy, max_batch=args.max_batch, max_len=args.max_len, device=args.device, dtype=args.dtype,
        reproducible_seeds=args.reproducible_seeds, forced_drafts=args.forced_drafts,
    )
    ids = []
    for i, p in enumerate(prompts):
        if isinstance(p, list):
            try:
                ids.append(llm.apply_chat_template(p))
            except DraftsmithError:
                raise
            except Exception as e:  # (the template's own errors: a role order or a content it cannot render)
                raise DraftsmithError(f"prompt {i + 1}: the chat template rejected its messages: {e}") from None
        elif args.chat:
            ids.append(llm.apply_chat_template([{"role": "user", "content": p}]))
        else:
            ids.append(llm.encode(p))
    outs = llm.generate(ids, params)
    stats = llm.last_stats
    if args.json:
        print(json.dumps({
            "target": llm.target.target_id, "drafter": llm.drafter_spec,
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
            f"\n[{llm.drafter_spec}] {stats.output_tokens} tokens in {stats.wall_time_s:.2f}s "
            f"({stats.tokens_per_s:.1f} tok/s) | target forwards/token {stats.forwards_per_token:.3f} | "
            f"τ {stats.tau:.2f} | acceptance {stats.acceptance_rate:.2f} "
            f"({stats.draft_accepted}/{stats.draft_proposed}) | prefix survival "
            + " ".join(f"{x:.2f}" for x in stats.prefix_survival[:8])
            + (f" | grammar's forced drafts {stats.forced_accepted}/{stats.forced_proposed}" if stats.forced_proposed else ""),
            file=sys.stderr,
        )
    return 0
