"""`draftsmith import`: a drafter from the speculators format (what vLLM serves) or a DeepSpec
checkpoint as a Draftsmith checkpoint, to measure it with eval / bench / serve (docs/FORMATS.md)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.cli.options import add_job, add_target_args, opt_auto

HELP = "read a drafter in the speculators (vLLM) or DeepSpec format into a Draftsmith checkpoint"
EXAMPLE = "draftsmith import --format speculators --src exports/smollm2-135m-eagle3 --out runs/imported-eagle3"


def add_parser(sub) -> None:
    e = add_job(sub, "import", HELP, EXAMPLE)
    add_target_args(e)
    e.add_argument("--format", default="speculators", choices=["speculators", "deepspec"],
                   help="the source's layout: speculators (vLLM; eagle3, dflash, dspark) or deepspec (DeepSpec's "
                        "Qwen3DSparkModel, its DFlash baseline, Qwen3Eagle3Model)")
    e.add_argument("--src", type=Path, required=True,
                   help="directory with config.json + model.safetensors (deepspec: a step_N directory, or the run "
                        "directory with step_latest)")
    e.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write (KIND:OUT loads it)")
    e.set_defaults(func=cmd_import)


def cmd_import(args) -> int:
    from draftsmith.drafters.checkpoint import read_checkpoint_config
    from draftsmith.export.importing import import_drafter
    from draftsmith.models.target import load_target

    target = load_target(args.target, device=opt_auto(args.device), dtype=opt_auto(args.dtype))
    out = import_drafter(args.src, target, args.out, args.format)
    kind = read_checkpoint_config(out)["kind"]
    print(f"draftsmith: imported a {kind} drafter for {target.target_id}; use it as --drafter {kind}:{out}")
    return 0
