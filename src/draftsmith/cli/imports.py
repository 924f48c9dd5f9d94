"""`draftsmith import`: a drafter in the speculators format (what vLLM serves), a DeepSpec
checkpoint or a z-lab DFlash checkpoint as a Draftsmith checkpoint, to measure it with eval /
bench / serve (docs/FORMATS.md). The format is detected from config.json unless given."""

from __future__ import annotations

from pathlib import Path

from draftsmith.cli.options import add_job, add_target_args, opt_auto

HELP = "read a drafter in the speculators (vLLM), DeepSpec or z-lab DFlash format into a Draftsmith checkpoint"
EXAMPLE = "draftsmith import --src exports/smollm2-135m-eagle3 --out runs/imported-eagle3"
FORMATS = ("speculators", "deepspec", "dflash-native")  # export/detect.py IMPORT_FORMATS


def add_parser(sub) -> None:
    e = add_job(sub, "import", HELP, EXAMPLE)
    add_target_args(e)
    e.add_argument("--format", default=None, choices=FORMATS,
                   help="the source's layout (default: detected from its config.json): speculators (vLLM; eagle3, "
                        "dflash, dspark), deepspec (DeepSpec's Qwen3DSparkModel, its DFlash baseline, "
                        "Qwen3Eagle3Model) or dflash-native (z-lab's DFlashDraftModel)")
    e.add_argument("--src", type=Path, required=True,
                   help="directory with config.json + model.safetensors (deepspec: a step_N directory, or the run "
                        "directory with step_latest)")
    e.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write (KIND:OUT loads it)")
    e.set_defaults(func=cmd_import)


def cmd_import(args) -> int:
    from draftsmith.drafters.checkpoint import read_checkpoint_config
    from draftsmith.export.detect import detect_foreign
    from draftsmith.export.importing import import_drafter
    from draftsmith.models.target import load_target

    fmt = args.format or detect_foreign(args.src)  # before loading the target: a wrong directory fails fast
    target = load_target(args.target, device=opt_auto(args.device), dtype=opt_auto(args.dtype))
    out = import_drafter(args.src, target, args.out, fmt)
    kind = read_checkpoint_config(out)["kind"]
    how = "given" if args.format else "detected"
    print(f"draftsmith: imported a {kind} drafter ({fmt} format, {how}) for {target.target_id}; "
          f"use it as --drafter {kind}:{out}")
    return 0
