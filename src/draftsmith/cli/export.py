"""`draftsmith export`: a trained drafter in the formats vLLM, SGLang, DeepSpec and z-lab DFlash load
(docs/FORMATS.md)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.cli.options import add_job, add_target_args, opt_auto
from draftsmith.errors import DraftsmithError

HELP = "write a trained drafter in the format vLLM (speculators), SGLang, DeepSpec or z-lab DFlash loads"
EXAMPLE = ("draftsmith export --drafter eagle3:runs/smollm2-135m-eagle3 --format speculators "
           "--out exports/smollm2-135m-eagle3")
FORMATS = ("speculators", "sglang", "deepspec", "dflash-native")  # export/formats.py, without importing torch here


def add_parser(sub) -> None:
    e = add_job(sub, "export", HELP, EXAMPLE)
    add_target_args(e)
    e.add_argument("--drafter", required=True, help="KIND:CHECKPOINT of a trained drafter (eagle3, dflash, dspark)")
    e.add_argument("--format", required=True, choices=FORMATS,
                   help="speculators: vLLM --speculative-config (eagle3, dflash, dspark); sglang: EAGLE-3 drafts; "
                        "deepspec: a DeepSpec step directory (full-vocabulary dspark; eagle3 on Qwen3 targets); "
                        "dflash-native: z-lab's DFlashDraftModel layout (full-vocabulary dflash)")
    e.add_argument("--out", type=Path, required=True,
                   help="output directory (config.json + model.safetensors; calibration.json when the drafter has one)")
    e.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out (or the checkpoint's own directory), replacing its "
                        "config.json and model.safetensors (and calibration.json: the drafter's, or none)")
    e.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from draftsmith.drafters import registry
    from draftsmith.drafters.checkpoint import check_kind, read_checkpoint_config
    from draftsmith.export.formats import check_drafter_out, export_drafter
    from draftsmith.models.target import load_target

    kind, arg = registry.parse_spec(args.drafter)
    if not kind.trainable:
        raise DraftsmithError(f"--drafter {kind.name} has no trained weights to export; give KIND:CHECKPOINT")
    check_drafter_out(args.out, args.overwrite, source=arg, source_what="checkpoint")  # before the target loads
    # KIND must be the checkpoint's (it was ignored: the checkpoint's own kind was exported); every
    # job's kind rule (check_target's), here before the target loads: check_target needs its weights hash
    check_kind(read_checkpoint_config(arg), kind.name, arg)
    target = load_target(args.target, device=opt_auto(args.device), dtype=opt_auto(args.dtype))
    out = export_drafter(arg, target, args.format, args.out, overwrite=args.overwrite)
    print(f"draftsmith: wrote the {kind.name} drafter in {args.format} format to {out}")
    return 0
