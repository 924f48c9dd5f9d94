"""Issue 12, item 3: the DSpark recipe's knobs one at a time, as τ per training minute.

    .venv/bin/python benchmarks/probe_knobs.py --cache CACHE --heldout-cache HELDOUT_CACHE
        [--minutes 15] [--variants base,anchors64,...] [--work runs/knob-probes] [--no-md]

Every variant is the recipe the built-in drafter was made with (recipes/smollm2-135m-dspark.yaml
with rank 96, the KL term, position decay 4, draft layers started from the target's last two,
q/k norm; lr 1e-2 from scratch) with one knob changed. Each trains for --minutes CPU minutes
(`--budget-clock cpu`: the trainer fits its learning-rate schedule to the budget, so a slower
step buys fewer steps), two at a time with one torch thread each (the same conditions for the
pair; `base` is in the first pair), on the same feature cache. One `draftsmith eval` at T = 0
then scores every variant side by side (held-out HumanEval and MT-Bench, γ = 7, the same
prompts), and the teacher-forced held-out numbers at the end of training (train/evaluate.py)
say which draft positions moved.

Computing the target statistics is not charged to a run's budget (the trainer's rule); --stats-from
copies a finished dspark run's statistics on the same cache into each new variant's directory,
and the trainer takes them where they match (else computes its own), which saves ~3-5 minutes
of wall clock per variant. Every stage resumes: a variant whose run finished (its .done marker) is not trained again, an
unfinished one goes on with `train --resume`, an eval whose report exists is reused. Writes
<work>/results.json, benchmarks/results/probe_knobs.json and its BENCHMARKS.md section.
Idle machine: nothing else may run beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import sections
from bench_drafters import _acc, _rel, cli, eval_out, train_info, wait_measured

ROOT = Path(__file__).resolve().parents[1]
STATS_FILE = "target_stats.safetensors"  # train/trainer.py's STATS_FILE (a test holds them equal; no torch here)
EVAL_SAMPLES = 24  # held-out conversations scored teacher-forced at each checkpoint
GAMMA = 7
RECIPE = "recipes/smollm2-135m-dspark.yaml"
BUILTIN = ["drafter.rank=96", "drafter.kl_weight=1.0", "drafter.position_decay=4.0",
           "drafter.init_from_target=true", "drafter.qk_norm=true", "train.epochs=100"]
# name: (what changes against the built-in's recipe, its overrides)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "base": ("none (the built-in's recipe: 16 anchors, batch 2, 8192-token draft vocabulary, 2 layers, decay 4)", []),
    "anchors64": ("64 anchors per sequence (16)", ["drafter.max_anchors=64"]),
    "batch8": ("8 sequences per step (2): as many blocks per step as anchors64", ["train.batch_size=8"]),
    "vocab16k": ("draft vocabulary 16384 (8192)", ["drafter.draft_vocab_size=16384"]),
    "layers3": ("3 draft layers (2), from the target's last three", ["drafter.num_layers=3"]),
    "decay2": ("position decay 2 (4): the first positions weigh more", ["drafter.position_decay=2.0"]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True, help="feature cache of the train conversations")
    ap.add_argument("--heldout-cache", type=Path, required=True, help="feature cache of held-out conversations")
    ap.add_argument("--minutes", type=float, default=15.0, help="training CPU minutes per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "knob-probes")
    ap.add_argument("--eval-prompts", type=int, default=12, help="held-out prompts per task")
    ap.add_argument("--eval-tokens", type=int, default=96, help="new tokens per turn in eval")
    ap.add_argument("--stats-from", type=Path,
                    help="a dspark run on the same cache whose target statistics (target_stats.safetensors) "
                         "the variants start from; the trainer uses them only where they match (same draft "
                         "vocabulary, windows, precision) and computes them otherwise")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of every variant (a replicate: another seed)")
    ap.add_argument("--section", default="", help="results under this name (probe_knobs-NAME.json) in their own "
                                                   "BENCHMARKS.md section, leaving the others in place")
    ap.add_argument("--no-md", action="store_true")
    args = ap.parse_args()
    names = [x.strip() for x in args.variants.split(",") if x.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or "base" not in names or len(set(names)) != len(names):
        raise SystemExit(f"--variants {args.variants!r}: expected distinct names of {', '.join(VARIANTS)}, "
                         "base among them (every variant is read against it)")
    names.remove("base")
    names.insert(0, "base")
    for f in (args.cache, args.heldout_cache):
        if not (f / "manifest.json").is_file():
            raise SystemExit(f"{f} is not a feature cache (no manifest.json): make one with `draftsmith cache`")
    if args.stats_from and not (args.stats_from / STATS_FILE).is_file():
        raise SystemExit(f"--stats-from {args.stats_from}: no {STATS_FILE} there (give a dspark run directory "
                         "on this cache)")
    w = args.work.resolve()
    w.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    common = [f"data.cache={args.cache.resolve()}", f"data.eval_cache={args.heldout_cache.resolve()}",
              f"data.eval_samples={EVAL_SAMPLES}", "train.save_every=1000", "train.keep_checkpoints=2",
              f"train.seed={args.seed}", *BUILTIN]

    def argv(name: str) -> list[str]:
        run = w / name
        if args.stats_from and not run.exists():
            run.mkdir()
            shutil.copyfile(args.stats_from / STATS_FILE, run / STATS_FILE)
        # --resume: a run with no checkpoint yet starts again (the trainer's rule), one with some goes on
        return ["train", "--config", RECIPE, "--budget", f"{args.minutes:g}", "--budget-clock", "cpu",
                f"out={run}", *common, *VARIANTS[name][1], "--resume"]

    todo = [n for n in names if not (w / f".train-{n}.done").exists()]
    for i in range(0, len(todo), 2):  # two at a time, one thread each
        pair = todo[i: i + 2]
        t0 = time.perf_counter()
        wait_measured({n: cli(*argv(n), threads=1, log=w / f"train-{n}.log", wait=False) for n in pair}, w, t0)
    out = w / "eval-T0"
    if evaluated(out) != names:  # none yet, or of another set of variants
        cli("eval", *[x for n in names for x in ("--drafter", f"dspark:{w / n}")], "--tasks", "humaneval,mtbench",
            "--max-prompts", str(args.eval_prompts), "--max-tokens", str(args.eval_tokens), "--temperature", "0",
            "--block-size", str(GAMMA), *eval_out(out))
    res = collect(w, names)
    prev = w / "results.json"  # a run that resumed earlier stages adds its time to theirs
    before = json.loads(prev.read_text()).get("setup", {}).get("wall_s", 0.0) if prev.is_file() else 0.0
    res["setup"] = {"minutes": args.minutes, "seed": args.seed, "section": args.section, "recipe": RECIPE,
                    "stats_from": _rel(args.stats_from) if args.stats_from else None,
                    "builtin_overrides": BUILTIN,
                    "cache": _rel(args.cache), "heldout_cache": _rel(args.heldout_cache),
                    "eval_prompts": args.eval_prompts, "eval_tokens": args.eval_tokens, "gamma": GAMMA,
                    "eval_samples": EVAL_SAMPLES, "machine": machine(),
                    "wall_s": round(before + time.perf_counter() - t_all, 1), "loadavg_end": os.getloadavg()}
    (w / "results.json").write_text(json.dumps(res, indent=1))
    name = section_name(args.section)
    dest = ROOT / "benchmarks" / "results" / f"{name}.json"
    dest.write_text(json.dumps(res, indent=1))
    print(f"wrote {dest}")
    if not args.no_md:
        sections.write_section(f"<!-- {name}:begin -->", f"<!-- {name}:end -->", markdown(res))
    return 0


def machine() -> str:
    zen = sections.amd_zen()
    return f"{platform.machine()} {os.cpu_count()} CPUs" + (f" (AMD {zen})" if zen else "")


def evaluated(out: Path) -> list[str] | None:
    """The variants an eval report in `out` scored, in order (None: no report)."""
    f = out / "report.json"
    if not f.is_file():
        return None
    return [d["label"].partition(":")[2] for d in json.loads(f.read_text())["drafters"]]


def section_name(section: str) -> str:
    """The results' name: probe_knobs.json and its BENCHMARKS.md markers, or probe_knobs-SECTION."""
    return f"probe_knobs-{section}" if section else "probe_knobs"


def per_request(rounds: Path) -> dict[str, tuple[int, int]]:
    """(tokens committed, verification rounds) per prompt of an eval's rounds file: the turns of
    one conversation (requests ID#0, ID#1, ...: a second turn continues the first) are one
    prompt, the unit a bootstrap resamples."""
    acc: dict[str, list[int]] = {}
    for line in rounds.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            a = acc.setdefault(r["request"].rpartition("#")[0] or r["request"], [0, 0])
            a[0] += int(r["committed"])
            a[1] += 1
    return {k: (c, n) for k, (c, n) in acc.items()}


def ratio_ci(base: dict[str, tuple[int, int]], other: dict[str, tuple[int, int]], draws: int = 2000,
             seed: int = 0) -> tuple[float, float, float]:
    """τ(other) / τ(base) over the requests both served, and its 95% interval from a paired
    bootstrap over requests (the same prompts for both: greedy outputs are the target's). It
    covers the choice of prompts, not training noise (a replicate with another --seed does)."""
    keys = sorted(set(base) & set(other))

    def ratio(ks) -> float:
        tb = sum(base[k][0] for k in ks) / sum(base[k][1] for k in ks)
        return sum(other[k][0] for k in ks) / sum(other[k][1] for k in ks) / tb

    rng = random.Random(seed)
    boot = sorted(ratio([rng.choice(keys) for _ in keys]) for _ in range(draws))
    return ratio(keys), boot[int(0.025 * draws)], boot[int(0.975 * draws) - 1]


def collect(w: Path, names: list[str]) -> dict:
    rep = json.loads((w / "eval-T0" / "report.json").read_text())
    by_label = {d["label"].partition(":")[2]: d for d in rep["drafters"]}
    res: dict = {"prompts": rep["prompts"], "variants": {}}
    rounds = {n: per_request(w / "eval-T0" / f"rounds-dspark_{n}.jsonl") for n in names}
    for n in names:
        t = train_info(w / n)
        rows = [json.loads(x) for x in (w / f"train-{n}.cpu.jsonl").read_text().splitlines() if x.strip()]
        held = [json.loads(x) for x in (w / n / "heldout.jsonl").read_text().splitlines() if x.strip()]
        d = by_label[n]
        res["variants"][n] = {
            "change": VARIANTS[n][0], "overrides": VARIANTS[n][1], "steps": t["info"].get("step", t["steps"]),
            "train_cpu_s": t["info"].get("train_cpu_s"), "process_cpu_s": round(sum(r["cpu_s"] for r in rows), 1),
            "heldout": held, "overall": _acc(d["overall"]), "tasks": {k: _acc(v) for k, v in d["tasks"].items()},
            "tau_vs_base_ci95": ratio_ci(rounds["base"], rounds[n])}
    return res


def ci(r: list[float] | tuple[float, float, float]) -> str:
    return f"{r[0]:.3f}× ({r[1]:.3f}–{r[2]:.3f})"


def markdown(res: dict) -> str:
    s, v = res["setup"], res["variants"]
    seed, section = s.get("seed", 0), s.get("section", "")
    flags = (f" --variants {','.join(v)}" if list(v) != list(VARIANTS) else "") + (f" --seed {seed}" if seed else "") \
        + (f" --section {section}" if section else "") \
        + (f" --stats-from {s['stats_from']}" if s.get("stats_from") else "")
    name = section_name(section)
    title = "## Recipe knobs one at a time: τ per training minute (issue 12)" + (f", seed {seed}" if seed else "")
    lines = [title, "",
             f"`benchmarks/probe_knobs.py --cache {s['cache']} --heldout-cache {s['heldout_cache']} "
             f"--minutes {s['minutes']:g}{flags}` (JSON: `benchmarks/results/{name}.json`). Machine: {s['machine']}, "
             "no GPU. Each variant is the built-in drafter's recipe (`" + s["recipe"] + "` with "
             + ", ".join(f"`{o}`" for o in s["builtin_overrides"]) + ") with one knob changed, trained from scratch "
             f"for {s['minutes']:g} CPU minutes (the schedule fitted to the budget), two at a time with one torch "
             "thread each, on the same cache. τ: one `draftsmith eval` at T = 0 over every variant, "
             f"γ = {s['gamma']}, {res['prompts'].get('humaneval')} held-out HumanEval and "
             f"{res['prompts'].get('mtbench')} MT-Bench prompts, {s['eval_tokens']} new tokens per turn. "
             f"Held-out columns: teacher-forced on {s['eval_samples']} held-out conversations at the end of "
             "training (`greedy@1` / `greedy`: the draft's argmax is the target's at the first / every block "
             "position; `accept`: mean 1 − TV, the T = 1 acceptance of a position).", "",
             "| variant | change | steps | CPU min | held-out greedy@1 / greedy / accept | τ HumanEval | "
             "τ MT-Bench | τ all | τ vs base (95% interval over prompts) |", "|---|---|---|---|---|---|---|---|---|"]
    for n, r in v.items():
        h = r["heldout"][-1] if r["heldout"] else {}
        cpu = r["train_cpu_s"]
        lines.append(
            f"| {n} | {r['change']} | {r['steps']} | {'–' if cpu is None else f'{cpu / 60:.1f}'} | "
            f"{h.get('greedy@1', float('nan')):.3f} / {h.get('greedy', float('nan')):.3f} / "
            f"{h.get('accept', float('nan')):.3f} | {r['tasks']['humaneval']['tau']:.2f} | "
            f"{r['tasks']['mtbench']['tau']:.2f} | {r['overall']['tau']:.2f} | {ci(r['tau_vs_base_ci95'])} |")
    lines += ["", "The interval: a paired bootstrap over the requests (each variant against base on the same "
              "prompts); it covers the choice of prompts, not training noise, which a replicate with another "
              "`--seed` measures.",
              "", "Conditional acceptance per draft position k = 1..γ at T = 0 (all prompts):", ""]
    for n, r in v.items():
        ca = ", ".join("–" if x is None else f"{x:.2f}" for x in r["overall"]["conditional_acceptance"])
        lines.append(f"- {n}: {ca}")
    lines += ["", f"Wall clock of the probe: {s['wall_s'] / 60:.0f} min, summed over its runs that reached the end "
              "(a killed run's time is not in it); load average at the end of the last run "
              + ", ".join(f"{x:.1f}" for x in s["loadavg_end"]) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
