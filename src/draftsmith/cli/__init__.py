"""One entry point: `draftsmith <job> ...`.

User errors (DraftsmithError, bad flags) print one line and exit 2; no tracebacks. Ctrl-C exits
130; SIGTERM (`kill`, a scheduler's preemption) is raised as an interrupt too (`Terminated`), so a
job closes what it wrote for --resume as on Ctrl-C, and exits 143 (`serve`: uvicorn's own shutdown).

One module per job (or closely related pair); the option groups they share live in
`draftsmith.cli.options`. `build_parser()` adds the jobs in pipeline order.

Each job module imports its job's machinery inside its command function, on purpose: a
parser is built for every invocation, and importing every job (the server's FastAPI, the
bench's plotting, transformers) would cost seconds before `--help` or a one-line error.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import draftsmith
from draftsmith.cli import bench, cache, export, generate, imports, profile, regen, serve, train
from draftsmith.cli import eval as eval_
from draftsmith.cli.options import HelpFormatter, add_threads
from draftsmith.errors import DraftsmithError, DraftsmithWarning

__all__ = ["main", "build_parser", "Terminated"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as an interrupt: the jobs' interrupt paths run (a
    feature cache keeps what it recorded, a regen output its complete records)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


@contextmanager
def _sigterm_as_interrupt(job: str) -> Iterator[None]:
    """Raise `Terminated` on SIGTERM while a job runs (Python's default ends the process without
    unwinding). Not for `serve` (uvicorn shuts down gracefully on its own) nor off the main thread
    (where a handler cannot be set: main() called from a thread)."""
    if job == "serve" or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:  # (None: a handler set outside Python, which cannot be put back from here)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

# (title, [(job, add_parser, example)]) in the order a drafter is made and used.
_SECTIONS = (
    ("mint a drafter, verify it, decide whether it pays", (
        ("regen", regen.add_parser, regen.EXAMPLE),
        ("cache", cache.add_parser, cache.EXAMPLE),
        ("train", train.add_parser, train.EXAMPLE),
        ("calibrate", eval_.add_calibrate_parser, eval_.CALIBRATE_EXAMPLE),
        ("eval", eval_.add_eval_parser, eval_.EVAL_EXAMPLE),
        ("bench", bench.add_parser, bench.EXAMPLE),
    )),
    ("use it", (
        ("generate", generate.add_parser, generate.EXAMPLE),
        ("serve", serve.add_parser, serve.EXAMPLE),
        ("export", export.add_parser, export.EXAMPLE),
        ("import", imports.add_parser, imports.EXAMPLE),
    )),
    ("measure the hardware", (
        ("profile", profile.add_parser, profile.EXAMPLE),
    )),
)


def _epilog() -> str:
    lines = ["pipeline: regen -> cache -> train -> calibrate -> eval -> bench; then generate / serve / export "
             "(import: a vLLM / speculators drafter); profile",
             "", "examples:"]
    for title, jobs in _SECTIONS:
        lines.append(f"  {title}:")
        lines.extend(f"    {example}" for _job, _add, example in jobs)
    lines += ["", "`draftsmith JOB --help` lists a job's options and their defaults."]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftsmith", description=draftsmith.__doc__.splitlines()[0],
                                 formatter_class=HelpFormatter, epilog=_epilog())
    ap.add_argument("--version", action="version", version=f"draftsmith {draftsmith.__version__}")
    sub = ap.add_subparsers(dest="job", required=True, metavar="JOB",
                            title="jobs (in pipeline order)")
    for _title, jobs in _SECTIONS:
        for _job, add_parser, _example in jobs:
            add_parser(sub)
    for cmd in sub.choices.values():
        add_threads(cmd)
    return ap


def _show_warning(message, category, filename, lineno, file=None, line=None, *, python) -> None:
    """Draftsmith's own warnings as one line, as its errors; any other as Python prints it."""
    if issubclass(category, DraftsmithWarning):
        print(f"draftsmith: warning: {message}", file=file or sys.stderr, flush=True)
    else:
        python(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from draftsmith.models.threads import configure_threads

        with warnings.catch_warnings(), _sigterm_as_interrupt(args.job):  # (restore what they set on the way out)
            warnings.showwarning = partial(_show_warning, python=warnings.showwarning)
            configure_threads(args.threads)
            return int(args.func(args) or 0)
    except DraftsmithError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        print("draftsmith: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        return 130
