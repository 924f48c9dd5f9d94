"""`draftsmith import DIR --out CKPT`: a drafter in the speculators format (what vLLM serves), a
DeepSpec checkpoint or a z-lab DFlash checkpoint as a Draftsmith checkpoint, to measure it with
eval / bench / serve (docs/FORMATS.md). The format is detected from config.json unless given.
`--src DIR`, the old spelling of DIR, is still accepted."""

from __future__ import annotations

from pathlib import Path

from draftsmith.cli.options import add_job, add_target_args, opt_auto
from draftsmith.errors import DraftsmithError

HELP = "read a drafter in the speculators (vLLM), DeepSpec or z-lab DFlash format into a Draftsmith checkpoint"
EXAMPLE = "draftsmith import exports/smollm2-135m-eagle3 --out runs/imported-eagle3"
FORMATS = ("speculators", "deepspec", "dflash-native")  # export/detect.py IMPORT_FORMATS
_SRC_HELP = ("directory with config.json + model.safetensors (deepspec: a step_N directory, or the run directory "
             "with step_latest)")


def add_parser(sub) -> None:
    e = add_job(sub, "import", HELP, EXAMPLE)
    e.add_argument("src", nargs="?", type=Path, metavar="DIR", help=_SRC_HELP)
    add_target_args(e)
    e.add_argument("--format", default=None, choices=FORMATS,
                   help="the source's layout (default: detected from its config.json): speculators (vLLM; eagle3, "
                        "dflash, dspark), deepspec (DeepSpec's Qwen3DSparkModel, its DFlash baseline, "
                        "Qwen3Eagle3Model) or dflash-native (z-lab's DFlashDraftModel)")
    e.add_argument("--src", dest="src_flag", type=Path, default=None, metavar="DIR",
                   help="deprecated: the old spelling of the positional DIR (still accepted)")
    e.add_argument("--out", type=Path, required=True,
                   help="the checkpoint directory to write (KIND:OUT loads it; DIR's calibration.json comes along)")
    e.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out (or DIR itself), replacing the drafter there (its "
                        "config.json and model.safetensors, and calibration.json: DIR's, or none)")
    e.set_defaults(func=cmd_import, import_parser=e)


def source_dir(args) -> Path:
    """The directory to import: the positional DIR, or the deprecated `--src DIR`. Neither is a
    usage error (argparse's, exit 2); both, naming different directories, a DraftsmithError. What
    is there (a file, nothing, another format) is checked after --out (cmd_import)."""
    pos, flag = args.src, args.src_flag
    if pos is not None and flag is not None and pos != flag:
        raise DraftsmithError(f"two source directories: DIR {pos} and --src {flag} (the old spelling of DIR); "
                              "give one")
    src = pos if pos is not None else flag
    if src is None:
        args.import_parser.error("the following arguments are required: DIR (the drafter directory to import)")
    return src


def cmd_import(args) -> int:
    from draftsmith.drafters.checkpoint import read_checkpoint_config
    from draftsmith.export.detect import detect_foreign
    from draftsmith.export.formats import check_drafter_out
    from draftsmith.export.importing import import_drafter
    from draftsmith.models.target import load_target

    src = source_dir(args)
    # --out first, as export checks it: a bad --out is the same one-line error whatever the source
    check_drafter_out(args.out, args.overwrite, source=src, source_what="drafter directory")
    if src.is_file():  # a model.safetensors or config.json given for its directory
        raise DraftsmithError(f"{src} is a file, not a drafter directory; give the directory that holds its "
                              "config.json and model.safetensors")
    fmt = args.format or detect_foreign(src)  # before loading the target: a wrong directory fails fast
    target = load_target(args.target, device=opt_auto(args.device), dtype=opt_auto(args.dtype))
    out = import_drafter(src, target, args.out, fmt, overwrite=args.overwrite)
    kind = read_checkpoint_config(out)["kind"]
    how = "given" if args.format else "detected"
    article = "an" if kind[:1] in "aeiou" else "a"
    print(f"draftsmith: imported {article} {kind} drafter ({fmt} format, {how}) for {target.target_id}; "
          f"use it as --drafter {kind}:{out}")
    return 0
