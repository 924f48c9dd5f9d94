"""Option groups and helpers shared by the job modules of `draftsmith`.

One name per option across jobs: the new-token limit is `--max-tokens` everywhere (as the
OpenAI API and vLLM say it), with `--max-new-tokens` kept as an alias.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from draftsmith.drafters import registry
from draftsmith.drafters.precision import DRAFTER_DTYPES
from draftsmith.engine.sglang_args import FLAGS, add_sglang_args, given, sglang_speculative_config
from draftsmith.engine.speculative_config import MAX_SPECULATIVE_TOKENS
from draftsmith.errors import DraftsmithError
from draftsmith.policy.registry import parse_policy_spec, policies

_SAYS_DEFAULT = re.compile(r"\(default|default:", re.IGNORECASE)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Epilogs keep their line breaks; every option shows its default.

    A help text that already explains its default ("default: the checkpoint's block size") is
    left alone; defaults that say nothing (None, False, an empty list) are not printed.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (not action.option_strings or "%(default)" in text or _SAYS_DEFAULT.search(text)
                or d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, list) and not d)):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def add_job(sub, name: str, help: str, example: str) -> argparse.ArgumentParser:
    """One job's parser: its one-line help, defaults in --help, and an example command."""
    return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter,
                          epilog=f"example:\n  {example}")


def json_text_or_file(src: str, flag: str) -> str:
    """`src` itself where it is a JSON object's text, else the text of the file it names."""
    if src.lstrip().startswith("{"):
        return src
    f = Path(src)
    try:
        found = f.is_file()
    except OSError:  # (text too long to be a file name: JSON that does not start with "{")
        found = False
    if not found:
        raise DraftsmithError(f"{flag} {src[:60]}: no such file (give a file or the JSON object's text)")
    try:
        return f.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DraftsmithError(f"{flag} {src} is not UTF-8 text (byte {e.start}); give a JSON file") from None


def nonnegative_int(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {n}")
    return n


def int_in(lo: int, hi: int):
    """An argparse type: an integer in lo..hi."""
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in {lo}..{hi}, got {n}")
        return n
    return parse


def positive_int(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def add_target_args(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    """--target / --device / --dtype (cache and eval take the target's dtype elsewhere, or not at all)."""
    p.add_argument("--target", default="smollm2-135m", help="built-in alias or HF-format model dir")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    if dtype:
        p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")


def policy_help() -> str:
    return "draft-length policy: " + "; ".join(f"{p.name} = {p.summary}" for p in policies().values())


def policy_arg(text: str) -> str:
    """argparse type of --policy: a name, or NAME:KEY=VALUE,... (policy/registry.py), checked
    before anything loads; a bad one is a usage error that says what is wrong."""
    try:
        parse_policy_spec(text)
    except DraftsmithError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """--drafter / --speculative-config / --drafter-dtype / --num-speculative-tokens / --policy (from the registries),
    --reproducible-seeds, --forced-drafts (generate, serve)."""
    p.add_argument("--drafter", default="none", help=registry.usage())
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative config, in place of --drafter and -k (a JSON object or a file "
                        "holding one), "
                        """e.g. '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}' or """
                        """'{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}'""")
    add_drafter_dtype(p)
    p.add_argument("--num-speculative-tokens", "-k", type=int_in(0, MAX_SPECULATIVE_TOKENS), default=None,
                   help="draft length K (default: a trained drafter's block size, else 5)")
    p.add_argument("--policy", default="auto", type=policy_arg, metavar="POLICY[:KEY=VALUE,...]",
                   help=policy_help())
    p.add_argument("--reproducible-seeds", action=argparse.BooleanOptionalAction, default=True,
                   help="a seeded request gives one output whatever K, policy, batch or load (position-keyed "
                        "coupling); --no-reproducible-seeds verifies seeded requests by the rejection rule "
                        "(more sampled drafts accepted; reproducible only while K does not depend on load)")
    p.add_argument("--forced-drafts", type=nonnegative_int, default=16, metavar="N",
                   help="structured outputs: where the grammar forces the next tokens (a JSON key, a regex's "
                        "literal text), up to N of them are the request's draft for a round, verified like any "
                        "draft (with or without --drafter; outputs never change); 0 = off")
    add_sglang_args(p)


def speculative_config(args) -> str | dict | None:
    """--speculative-config's JSON text (the value itself, or the file it names), or SGLang's
    speculative flags read as one (engine/sglang_args.py; their warnings printed here); None if
    neither is given."""
    sc, sglang = args.speculative_config, given(args)
    if sglang:
        flag = next(f.flag for f in FLAGS if f.field in sglang)
        for other, is_set in (("--speculative-config", sc is not None), ("--drafter", args.drafter != "none"),
                              ("-k/--num-speculative-tokens", args.num_speculative_tokens is not None)):
            if is_set:
                raise DraftsmithError(f"{other} and SGLang's {flag} both say how to speculate; give one")
        return sglang_speculative_config(sglang)
    return None if sc is None else json_text_or_file(sc, "--speculative-config")


def add_drafter_dtype(p: argparse.ArgumentParser) -> None:
    """--drafter-dtype: what model drafters compute in (drafters/precision.py)."""
    p.add_argument("--drafter-dtype", default="auto", choices=DRAFTER_DTYPES,
                   help="what a trained or draft-model drafter computes in; auto = bfloat16 beside a float32 "
                        "target on CPUs whose kernels run bfloat16 fast (AVX-512, AMX), else the target's dtype. "
                        "Outputs never depend on it, only speed and acceptance")


def add_max_tokens(p: argparse.ArgumentParser, default: int, help: str, dest: str = "max_new_tokens") -> None:
    """`--max-tokens N` (alias `--max-new-tokens`), stored under the job's existing dest."""
    p.add_argument("--max-tokens", "--max-new-tokens", dest=dest, type=positive_int, default=default,
                   metavar="N", help=help)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    add_max_tokens(p, 128, "new tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none = nondeterministic)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide (multiply) the positive (negative) logit of a token seen in the prompt or output (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract from the logit of a token the output holds, in [-2, 2] (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this x the times the output holds a token, in [-2, 2] (0 = off)")


def add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: only on a terminal)")


def add_prefix_caching(p: argparse.ArgumentParser, what: str, on: bool) -> None:
    """vLLM's flag: reuse the KV of a prompt prefix a free cache row still holds (engine/prefix_cache.py)."""
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None if on else False,
                   help=f"reuse the KV cache of a prompt prefix already computed ({what}); "
                        "outputs equal a run without it up to float rounding "
                        f"(default: {'on wherever the drafter allows' if on else 'off'})")


def add_threads(p: argparse.ArgumentParser) -> None:
    """One CPU-threads option, the same on every job."""
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for the model's kernels (default: the physical cores; serve, generate, "
                        "regen and cache use fewer while other processes keep some busy)")


def opt_auto(v: str) -> str | None:
    """'auto' -> None, as the job configs take it."""
    return None if v == "auto" else v
