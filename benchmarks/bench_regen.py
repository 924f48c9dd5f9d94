"""Regeneration throughput of the built-in engine by batch size (issue 12, item 1).

    .venv/bin/python benchmarks/bench_regen.py [--samples 128] [--serial-samples 16]
        [--max-new-tokens 128] [--batch-sizes 1,8,32,64] [--dtypes float32,bfloat16] [--no-write]
        [--compare-torch] [--compare-prefix-caching] [--turns 2]

--compare-torch runs every batch size twice, back to back: the default runtime (Draftsmith's CPU
kernels) and the path before them (oneDNN-prepacked linears, torch's attention and RMSNorm), so
the speedup is measured side by side in one run (this machine's absolute speed drifts between
days); outputs of the two are compared too. --compare-prefix-caching does the same with prefix
caching off (each turn prefills the whole conversation so far) beside the default (on: a turn
reuses its conversation's KV).

The same train-split conversations of `code:0.4,chat:0.6` (first `--turns` user turns each; 0: all) are
regenerated with `--batch-size` 1, 8, 32 and 64 (conversations in flight; continuous
batching), one target per dtype, all threads. Batch 1 runs on the first
`--serial-samples` conversations only (it is the slow case); every batch size's outputs
on those are compared for identity (per-answer seeds make batching invisible).
Generated tokens / wall seconds, prefill included. Run on an idle machine.
Writes its section of BENCHMARKS.md and benchmarks/results/bench_regen.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import sections

import draftsmith  # noqa: F401  (OpenMP settings before torch)
import torch

from draftsmith.data.regen import RegenConfig, load_records, run_regen
from draftsmith.data.regen_backends import EngineBackend
from draftsmith.data.sources import load_mix
from draftsmith.data.sources.conversation import Conversation
from draftsmith.models.target import load_target

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_regen:begin -->", "<!-- bench_regen:end -->"


def first_turns(n: int, turns: int = 2) -> list[Conversation]:
    """n train-split conversations of code:0.4,chat:0.6 cut after their first `turns` user turns
    (0: all; bench_data.py regenerates the same ones)."""
    out = []
    for c in load_mix("code:0.4,chat:0.6", split="train", max_samples=n, seed=0):
        keep, users = [], 0
        for m in c.messages:
            users += m["role"] == "user"
            if turns and users > turns:
                break
            keep.append(m)
        out.append(Conversation(id=c.id, source=c.source, split=c.split, messages=keep))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--serial-samples", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--no-write", action="store_true",
                    help="print only; leave BENCHMARKS.md and benchmarks/results/bench_regen.json alone")
    ap.add_argument("--compare-torch", action="store_true", help="also the runtime before Draftsmith's CPU kernels")
    ap.add_argument("--compare-prefix-caching", action="store_true", help="also every run with prefix caching off")
    ap.add_argument("--turns", type=int, default=2, help="user turns kept per conversation (0: all)")
    args = ap.parse_args()
    variants = [("kernels", True)] + [("torch", True)] * args.compare_torch + [("kernels", False)] * args.compare_prefix_caching
    convs = first_turns(args.samples, args.turns)
    load0, t0 = os.getloadavg(), time.time()
    rows, outputs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-regen-") as d:
        for dtype in args.dtypes.split(","):
            targets = {"kernels": load_target("smollm2-135m", device="cpu", dtype=dtype)}
            if args.compare_torch:
                targets["torch"] = load_target("smollm2-135m", device="cpu", dtype=dtype, linear_backend="onednn")
                targets["torch"].model.attention_kernel = "torch"
            for bs in [int(x) for x in args.batch_sizes.split(",")]:
                todo = convs[: args.serial_samples] if bs == 1 else convs
                for rt, pc in variants:
                    cfg = RegenConfig(target="smollm2-135m", out=Path(d) / f"{dtype}-b{bs}-{rt}-{pc}.jsonl",
                                      max_new_tokens=args.max_new_tokens, batch_size=bs, max_len=2048, overwrite=True,
                                      progress=False, dtype=dtype, enable_prefix_caching=pc)
                    s = run_regen(cfg, conversations=todo, backend=EngineBackend(cfg, target=targets[rt]))
                    recs = load_records(cfg.out)
                    outputs[(dtype, bs, rt, pc)] = {r["id"]: r["input_ids"] for r in recs}
                    row = {"dtype": dtype, "batch_size": bs, "runtime": rt, "prefix_caching": pc, "conversations": s.written,
                           "errors": s.errors, "generated_tokens": s.generated_tokens,
                           "prompt_tokens": sum(t["prompt_tokens"] for r in recs for t in r["turns"]),
                           "wall_s": round(s.wall_s, 1), "tokens_per_s": round(s.tokens_per_s, 1)}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
            del targets
    common = [c.id for c in convs[: args.serial_samples]]
    identical = {dt: all(len({json.dumps(o.get(i)) for (t, _, rt, pc), o in outputs.items()
                              if t == dt and rt == "kernels" and pc}) == 1
                         for i in common) for dt in args.dtypes.split(",")}
    same_as_torch: dict[str, list[int]] = {}  # dtype -> [conversations equal to the torch path's, compared]
    same_without_caching: dict[str, list[int]] = {}  # the same against prefix caching off
    for (dt, bs, rt, pc), o in outputs.items():
        if rt == "torch" or not pc:
            eq = (same_as_torch if rt == "torch" else same_without_caching).setdefault(dt, [0, 0])
            eq[0] += sum(outputs[(dt, bs, "kernels", True)].get(i) == ids for i, ids in o.items())
            eq[1] += len(o)
    load1 = os.getloadavg()
    result = {"rows": rows, "identical_on_common": identical, "same_as_torch_path": same_as_torch,
              "same_without_prefix_caching": same_without_caching, "dtypes": args.dtypes,
              "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens, "turns": args.turns,
              "load_before": load0[0], "load_after": load1[0], "wall_s": round(time.time() - t0)}
    if args.no_write:  # the committed JSON backs BENCHMARKS.md's table: a side run leaves both alone
        print(json.dumps(result, indent=1))
        return
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / "benchmarks/results/bench_regen.json").write_text(json.dumps(result, indent=1) + "\n")
    best = max((r for r in rows if r["runtime"] == "kernels" and r["prefix_caching"]), key=lambda r: r["tokens_per_s"])
    by = {(r["dtype"], r["batch_size"], r["runtime"], r["prefix_caching"]): r for r in rows}
    kept = "all user turns" if not args.turns else f"first {args.turns} user turns each"
    lines = [
        "## Regeneration throughput by batch size (issue 12)",
        "",
        f"`benchmarks/bench_regen.py` (JSON: `benchmarks/results/bench_regen.json`): 2-core CPU, "
        f"{result['threads']} torch threads, target `smollm2-135m` in {args.dtypes.replace(',', ' and ')}, the same train-split "
        f"conversations of `code:0.4,chat:0.6` ({kept}), max {args.max_new_tokens} new tokens per "
        f"answer, the target's sampling defaults with per-answer seeds. Load average {load0[0]:.1f} before, "
        f"{load1[0]:.1f} after; {result['wall_s']} s in all. Batch 1 regenerates the first {args.serial_samples} "
        "conversations only.",
        "",
        "| dtype | batch size | runtime | prefix caching | conversations | generated tokens | prompt tokens | wall s "
        "| generated tok/s | ÷ torch path | ÷ prefix caching off |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(r: dict, base: dict | None) -> str:
        return f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base and base is not r else "–"

    for r in rows:
        key = (r["dtype"], r["batch_size"])
        mine = r["runtime"] == "kernels" and r["prefix_caching"]
        lines.append(f"| {r['dtype']} | {r['batch_size']} | {r['runtime']} | {'on' if r['prefix_caching'] else 'off'} | "
                     f"{r['conversations']} | {r['generated_tokens']} | {r['prompt_tokens']} | {r['wall_s']} | "
                     f"{r['tokens_per_s']} | {ratio(r, by.get((*key, 'torch', True)) if mine else None)} | "
                     f"{ratio(r, by.get((*key, 'kernels', False)) if mine else None)} |")
    lines += [
        "",
        f"Best: **{best['tokens_per_s']} tok/s at batch {best['batch_size']} in {best['dtype']}** "
        f"({best['tokens_per_s'] / 29:.1f}x the 29 tok/s of the issue-4 regeneration). "
        + " ".join(f"{dt}: every batch size produced identical token ids on the common conversations."
                   if same else f"{dt}: **outputs differ between batch sizes on some common conversations.**"
                   for dt, same in identical.items())
        + (" (bfloat16 regenerates the bf16 target's answers: the same distribution up to bf16 rounding,"
           " not the float32 target's tokens.)" if "bfloat16" in identical else "")
        + "".join(f" {dt}: {e} of {n} conversations token-for-token equal between the two runtimes."
                  for dt, (e, n) in same_as_torch.items())
        + "".join(f" {dt}: {e} of {n} conversations token-for-token equal with prefix caching on and off."
                  for dt, (e, n) in same_without_caching.items()),
    ]
    sections.write_section(BEGIN, END, "\n".join(lines))


if __name__ == "__main__":
    main()
