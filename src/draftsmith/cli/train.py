"""`draftsmith train` (Mint stage 3): train a drafter from a recipe (torchrun-ready: DDP over gloo / nccl)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from draftsmith.cli.options import add_job
from draftsmith.errors import DraftsmithError

HELP = "train a drafter from a recipe (torchrun-ready: DDP over gloo / nccl)"
EXAMPLE = "draftsmith train --config recipes/smollm2-135m-dspark.yaml data.cache=data/cache"


def add_parser(sub) -> None:
    t = add_job(sub, "train", HELP, EXAMPLE)
    t.add_argument("--config", type=Path, required=True, help="recipe YAML, e.g. recipes/smollm2-135m-dspark.yaml")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides parsed as YAML, e.g. train.lr=3e-4 data.cache=cache/ drafter.num_layers=2")
    t.add_argument("--budget", type=float, default=None, metavar="MINUTES",
                   help="wall-clock budget: size the run from a timing probe (fitted again at a tenth of the "
                        "run) and stop at the deadline (default: the recipe's train.budget_minutes, if any)")
    t.add_argument("--budget-clock", choices=("wall", "cpu"), default=None,
                   help="what --budget counts: wall clock (default) or this process's CPU time, so runs that "
                        "share a machine get equal work (the recipe's train.budget_clock)")
    t.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                   help="continue exactly from the newest checkpoint of the run dir (or the one given)")
    t.add_argument("--overwrite", action="store_true", help="discard the run dir's checkpoints and start again")
    t.add_argument("--json", action="store_true", help="print the result as JSON (rank 0)")
    t.set_defaults(func=cmd_train)
    _overrides_anywhere(t)


def _overrides_anywhere(t) -> None:
    """KEY=VALUE wherever it stands: argparse fills the positional from the first run of them and
    called any after an option unrecognized (`train --config R out=x --resume train.lr=1e-3 a=b`
    failed on a=b), and `--resume KEY=VALUE` took the override as the checkpoint. The overrides
    keep their command-line order: a key given twice takes its last value."""
    parse = t.parse_known_args

    def parse_known_args(args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        ns, extras = parse(argv, namespace)
        more = [a for a in extras if "=" in a and not a.startswith("-")]
        ns.overrides = list(ns.overrides) + more
        if isinstance(ns.resume, str) and "=" in ns.resume and not Path(ns.resume).exists():
            ns.overrides.append(ns.resume)
            ns.resume = True
        ns.overrides.sort(key=lambda o: argv.index(o) if o in argv else len(argv))
        return ns, [a for a in extras if a not in more]

    t.parse_known_args = parse_known_args


def cmd_train(args) -> int:
    from draftsmith.train.config import load_train_config
    from draftsmith.train.trainer import Trainer

    overrides = list(args.overrides)  # (in command-line order, `--resume KEY=VALUE` among them: add_parser)
    if args.resume and args.overwrite:
        raise DraftsmithError("--resume and --overwrite exclude each other")
    if args.budget is not None and not (args.budget > 0 and math.isfinite(args.budget)):
        raise DraftsmithError(f"--budget must be a positive number of minutes, got {args.budget}")
    if args.budget_clock is not None:
        overrides.append(f"train.budget_clock={args.budget_clock}")
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
