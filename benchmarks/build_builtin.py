"""Package a trained drafter run as a built-in drafter (drafters/builtin.py), with what made it.

    .venv/bin/python benchmarks/build_builtin.py --run runs/builtin/dspark --kind dspark --name smollm2-135m \
        --recipe recipes/smollm2-135m-dspark-builtin.yaml --data runs/builtin/train-regen.jsonl \
        [--eval-json runs/builtin/eval/report.json] [--notes FILE.md]

Writes src/draftsmith/builtin/KIND/NAME/:
    config.json          the run's (kind, target id + weights hash, the drafter config)
    model.safetensors    the weights in bfloat16 (--dtype), with their content hash
    calibration.json     the run's STS temperatures, when it has them
    recipe.yaml          the recipe, verbatim
    data_manifest.json   every data file: sha256, bytes, records, tokens, answer tokens, sources
    TRAINING.md          steps, minutes, steps/s, the last training and held-out numbers, notes
Refuses weights over 20 MB (the package-data limit). The data files themselves are never
packaged: the manifest says how to make them again and lets a rerun check it got the same.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
from pathlib import Path

import draftsmith  # noqa: F401  (OpenMP settings before torch)
import torch

from draftsmith.data.regen_records import iter_records
from draftsmith.drafters.builtin import BUILTIN_ROOT
from draftsmith.fileio import file_sha256
from draftsmith.tensorfile import load_tensors, save_tensors

MAX_BYTES = 20 * 1000 * 1000


def describe_jsonl(path: Path) -> dict:
    """Counts of one regen JSONL: records, tokens, answer (loss) tokens, records per source / split."""
    records = tokens = answer = 0
    sources: collections.Counter = collections.Counter()
    splits: collections.Counter = collections.Counter()
    for r in iter_records(path):
        records += 1
        tokens += len(r["input_ids"])
        answer += sum(r["loss_mask"])
        sources[r.get("source", "?")] += 1
        splits[r.get("split", "?")] += 1
    return {"file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size, "records": records,
            "tokens": tokens, "answer_tokens": answer, "sources": dict(sorted(sources.items())),
            "splits": dict(splits)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the trained run directory (`train` out:)")
    ap.add_argument("--kind", required=True)
    ap.add_argument("--name", required=True, help="built-in name: the target alias it fits")
    ap.add_argument("--recipe", type=Path, required=True)
    ap.add_argument("--data", type=Path, nargs="+", required=True, help="the regen JSONL(s) it trained on")
    ap.add_argument("--heldout-data", type=Path, nargs="*", default=[], help="held-out JSONL(s) it was judged on")
    ap.add_argument("--notes", type=Path, help="markdown appended to TRAINING.md (measurements)")
    ap.add_argument("--earlier-manifest", type=Path,
                    help="data_manifest.json of the drafter this run started from (train.init_from): its data "
                         "files are kept in the new manifest as `earlier_files`")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = ap.parse_args()

    run = args.run
    cfg = json.loads((run / "config.json").read_text())
    if cfg["kind"] != args.kind:
        sys.exit(f"{run} holds a {cfg['kind']} drafter, not {args.kind}")
    dtype = getattr(torch, args.dtype)
    state = load_tensors(run / "model.safetensors", "drafter checkpoint")
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    out = BUILTIN_ROOT / args.kind / args.name
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_tensors(tmp / "model.safetensors", state, metadata={"format": "pt", "kind": args.kind})
    size = (tmp / "model.safetensors").stat().st_size
    if size > MAX_BYTES:
        shutil.rmtree(tmp)
        sys.exit(f"weights are {size / 1e6:.1f} MB in {args.dtype}: over the {MAX_BYTES / 1e6:.0f} MB package limit")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    if (run / "calibration.json").is_file():
        shutil.copyfile(run / "calibration.json", tmp / "calibration.json")
    shutil.copyfile(args.recipe, tmp / "recipe.yaml")
    files = [describe_jsonl(p) for p in args.data]
    held = [describe_jsonl(p) for p in args.heldout_data]
    manifest = {"conversations": sum(f["records"] for f in files), "tokens": sum(f["tokens"] for f in files),
                "answer_tokens": sum(f["answer_tokens"] for f in files), "files": files, "heldout_files": held}
    earlier: list[dict] = []
    if args.earlier_manifest:  # read before the old built-in (which may hold this file) is replaced
        old = json.loads(args.earlier_manifest.read_text())
        earlier = [*old.get("earlier_files", []), *old.get("files", [])]
        manifest["earlier_files"] = earlier
    (tmp / "data_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    info = json.loads((run / "train_info.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    held_rows = ([json.loads(x) for x in (run / "heldout.jsonl").read_text().splitlines() if x.strip()]
                 if (run / "heldout.jsonl").is_file() else [])
    last = rows[-1] if rows else {}
    n_params = sum(v.numel() for v in state.values() if v.is_floating_point())
    lines = [f"# Built-in {args.kind} drafter for {args.name}", "",
             f"Trained by Draftsmith's own recipe (`recipe.yaml`) on {manifest['conversations']} regenerated "
             f"conversations ({manifest['answer_tokens']} answer tokens; `data_manifest.json`)"
             + (f", starting from a drafter trained on {sum(f['records'] for f in earlier)} earlier ones "
                f"({sum(f['answer_tokens'] for f in earlier)} answer tokens; `earlier_files`)" if earlier else "")
             + ".", "",
             "| what | value |", "|---|---|",
             f"| steps | {info['step']} |",
             f"| wall clock | {info.get('elapsed_s', 0) / 60:.1f} min |",
             f"| steps/s (last log) | {last.get('steps_per_s', float('nan')):.2f} |",
             f"| parameters | {n_params / 1e6:.2f} M ({args.dtype}, {size / 1e6:.1f} MB) |",
             f"| final training loss | {info.get('loss', float('nan')):.4f} |",
             f"| training acceptance (1 − TV, T = 1) | {last.get('accept', float('nan')):.3f} |"]
    if held_rows:
        h = held_rows[-1]
        lines.append(f"| held-out acceptance (1 − TV, T = 1, teacher-forced) | {h.get('accept', float('nan')):.3f} |")
        if "greedy" in h:
            lines.append(f"| held-out greedy agreement with the target (T = 0), first / all positions | "
                         f"{h['greedy@1']:.3f} / {h['greedy']:.3f} |")
        lines.append(f"| held-out top-1 agreement with the data, first / all positions | "
                     f"{h.get('acc@1', float('nan')):.3f} / {h.get('acc', float('nan')):.3f} |")
        lines += ["", "Held-out curve (teacher-forced, at each checkpoint):", "",
                  "| step | accept (T = 1) | greedy@1 | greedy | acc |", "|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r.get('accept', float('nan')):.3f} | {r.get('greedy@1', float('nan')):.3f} | "
                  f"{r.get('greedy', float('nan')):.3f} | {r.get('acc', float('nan')):.3f} |" for r in held_rows]
    if args.notes:
        lines += ["", args.notes.read_text().rstrip()]
    (tmp / "TRAINING.md").write_text("\n".join(lines) + "\n")
    for f in tmp.iterdir():
        f.chmod(0o644)  # package data: readable by whoever installs it
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"built-in {args.kind}:{args.name} -> {out} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
