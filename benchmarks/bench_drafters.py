"""Issue 4's comparison: EAGLE-3 vs DFlash vs DSpark on smollm2-135m, same data and budget.

    .venv/bin/python benchmarks/bench_drafters.py [--work runs/drafters] [--samples 320]
        [--budget 20] [--kinds eagle3,dflash,dspark] [--parallel] [--eval-prompts 12]
        [--eval-tokens 96] [--bench-requests 6]

Every stage is a plain `draftsmith` CLI call and is skipped when its output exists, so a
re-run resumes (delete a stage's output to redo it; a bench stage killed midway goes on with
`bench --resume`, keeping the tiers it finished):

1. regen      train split, code:0.4,chat:0.6 mix, --samples conversations, 128 tokens per turn
2. cache      target layers 1,14,27 + final hidden (fp16): one cache serves all three recipes
3. train      recipes/smollm2-135m-{eagle3,dflash,dspark}.yaml, --budget minutes of wall clock
              each (the trainer sizes the step count from a timing probe and stops at the
              deadline). --parallel trains them at once with one torch thread each, so all
              see identical conditions; otherwise one after the other.
4. calibrate  STS for drafters with a confidence head (DSpark) on held-out ShareGPT prompts:
              disjoint from the eval tasks, so calibration is not fitted on what it is judged on
5. eval       held-out HumanEval + MT-Bench at T=0 and T=1, γ = 7 for every drafter, n-gram
              prompt lookup as a training-free reference
6. bench      batch 1 wall clock, plain vs each drafter stepped side by side (draftsmith bench,
              concurrency 1, fixed K = γ and the prefix scheduler), code and chat prompts

Writes <work>/results.json and a section between markers in BENCHMARKS.md.

Issue 12's long comparison reuses a larger data set and asks for a curve of τ against training
time (every stage still resumes):

    .venv/bin/python benchmarks/bench_drafters.py --work runs/drafters-long --section long \
        --regen runs/builtin/regen-v3.jsonl --cache runs/builtin/cache-v3 \
        --heldout-cache runs/builtin/heldout-cache --budget 135 --parallel --save-every 500 \
        --curve 15,45 --eval-tokens 128 --set dspark:drafter.rank=96 ...

--regen/--cache skip stages 1-2; --set KIND:KEY=VALUE overrides one recipe's field (repeatable);
--heldout-cache scores every checkpoint teacher-forced during training; --save-every N keeps
every Nth-step checkpoint and --curve M,.. evaluates (T=0) the checkpoints nearest M minutes of
training; each recipe's CPU time is measured (with --parallel, its processes share the cores).
--section NAME writes benchmarks/results/bench_drafters-NAME.json and its own BENCHMARKS.md
section, leaving issue 4's in place. --kinds dspark,dflash compares a subset (two recipes at once
on two cores reach a long CPU budget in its wall time; three take 1.5x that). A work directory
keeps the kinds it was started with (kinds.json): resuming it with others is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import sections
from draftsmith.data.regen_records import scan_output

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_drafters:begin -->", "<!-- bench_drafters:end -->"
KINDS = ("eagle3", "dflash", "dspark")
GAMMA = 7
WORKLOADS = ("humaneval", "mtbench")
POLICIES = ("fixed", "prefix-scheduler")


def eval_out(out: Path) -> list[str]:
    """`--out OUT` for a `draftsmith eval` stage, with --overwrite where OUT exists: a killed eval is run
    again (eval refuses a directory holding its leftover reports)."""
    return ["--out", str(out), *(["--overwrite"] if out.exists() else [])]


def bench_out(out: Path) -> list[str]:
    """`--out OUT` for a `draftsmith bench` stage, with --resume where OUT holds a killed bench's setup.json
    (bench/results.py; a stage is skipped once report.json is there): the rerun keeps the tiers it finished
    and measures the rest; bench refuses it if the setup differs (its fingerprint), and refuses a directory
    without --resume. Only results.jsonl, no setup.json: no --resume (with it, bench would keep tiers whose
    setup nothing vouches for), so bench refuses the directory and says what to do."""
    from draftsmith.bench.results import SETUP  # (bench's own name for it; no torch behind it)

    killed = (out / SETUP).is_file()
    return ["--out", str(out), *(["--resume"] if killed else [])]


def cli(*argv: str, threads: int | None = None, log: Path | None = None, wait: bool = True):
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "draftsmith", *argv]
    print("$ draftsmith " + " ".join(argv), flush=True)
    out = open(log, "a") if log else None
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if out else None)
    if not wait:
        return p
    if p.wait() != 0:
        raise SystemExit(f"stage failed: draftsmith {' '.join(argv)}" + (f" (log: {log})" if log else ""))
    return p


def train_info(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = rows[-1] if rows else {}
    info = json.loads((run / "train_info.json").read_text()) if (run / "train_info.json").is_file() else {}
    return {"steps": last.get("step"), "last": last, "info": info}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "drafters")
    ap.add_argument("--samples", type=int, default=320)
    ap.add_argument("--budget", type=float, default=None,
                    help="training minutes per drafter (default 20; with --steps: the CPU minutes they are sized to)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="the recipes to compare: two or three of eagle3,dflash,dspark (default: all three)")
    ap.add_argument("--parallel", action="store_true", help="train them at once, one thread each")
    ap.add_argument("--steps", default="",
                    help="fixed step counts instead of a probed budget, e.g. eagle3=10400,dflash=22100,dspark=20500 "
                         "(sized to --budget CPU minutes from each recipe's measured CPU seconds per step: a probe of "
                         "a few steps can miss a recipe whose step cost varies, and then its schedule is cut short)")
    ap.add_argument("--budget-clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: --budget counts each trainer's CPU minutes (equal work for recipes that share "
                         "the machine; the curve's minutes are CPU minutes too)")
    ap.add_argument("--eval-prompts", type=int, default=12, help="held-out prompts per task")
    ap.add_argument("--eval-tokens", type=int, default=96, help="new tokens per turn in eval")
    ap.add_argument("--bench-requests", type=int, default=6)
    ap.add_argument("--bench-tokens", type=int, default=64)
    ap.add_argument("--regen", type=Path, help="reuse this regenerated train set (skips the regen stage)")
    ap.add_argument("--cache", type=Path, help="reuse this feature cache of --regen (skips the cache stage)")
    ap.add_argument("--heldout-cache", type=Path,
                    help="feature cache of held-out conversations: every checkpoint is scored on it, teacher-forced")
    ap.add_argument("--set", action="append", default=[], metavar="KIND:KEY=VALUE",
                    help="override one recipe's field, e.g. dspark:drafter.rank=96 (repeatable)")
    ap.add_argument("--save-every", type=int, help="checkpoint every N steps and keep them all (for --curve)")
    ap.add_argument("--curve", default="", help="also evaluate (T=0) the checkpoints nearest these training "
                                                 "minutes, e.g. 15,45")
    ap.add_argument("--section", default="", help="results under this name, in their own BENCHMARKS.md section")
    ap.add_argument("--no-bench", action="store_true", help="skip stage 6 (wall clock); τ stages only")
    ap.add_argument("--no-md", action="store_true")
    args = ap.parse_args()
    if (args.regen is None) != (args.cache is None):
        raise SystemExit("--regen and --cache go together: the cache must hold that regen's features")
    kinds = tuple(k for k in KINDS if k in {x.strip() for x in args.kinds.split(",")})
    unknown = {x.strip() for x in args.kinds.split(",")} - set(KINDS)
    if unknown or len(kinds) < 2:
        raise SystemExit(f"--kinds {args.kinds!r}: expected two or three of {', '.join(KINDS)}, comma-separated "
                         "(a comparison; `draftsmith train` trains one)")
    overrides: dict[str, list[str]] = {k: [] for k in kinds}
    for item in args.set:
        kind, sep, kv = item.partition(":")
        if not sep or kind not in kinds or "=" not in kv:
            raise SystemExit(f"--set {item!r}: expected KIND:KEY=VALUE with KIND one of {', '.join(kinds)}"
                             + (f" ({kind} is not in --kinds)" if kind in KINDS else ""))
        overrides[kind].append(kv)
    steps: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in args.steps.split(","))):
        kind, sep, n = item.partition("=")
        if not sep or kind not in kinds or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--steps {item!r}: expected KIND=N with KIND one of {', '.join(kinds)}, N >= 1")
        steps[kind] = int(n)
    if steps and set(steps) != set(kinds):
        raise SystemExit(f"--steps needs a count for each of {', '.join(kinds)}")
    if steps and args.budget is None:
        raise SystemExit("--steps needs --budget M: the CPU minutes the step counts were sized to (the report's title)")
    if args.budget is None:
        args.budget = 20.0
    clock = "cpu" if steps else args.budget_clock  # what the curve's minutes count
    curve = [float(x) for x in args.curve.split(",") if x.strip()]
    if curve and args.save_every is None:
        raise SystemExit("--curve needs --save-every N (checkpoints to choose from)")
    w = args.work.resolve()
    w.mkdir(parents=True, exist_ok=True)
    check_kinds(w, kinds)
    t_all = time.perf_counter()
    stage_s: dict[str, float] = {}

    def stage(name: str, done: Path, fn) -> None:
        if done.exists():
            print(f"== {name}: reused ({done})", flush=True)
            return
        t0 = time.perf_counter()
        fn()
        stage_s[name] = round(time.perf_counter() - t0, 1)

    regen = args.regen.resolve() if args.regen else w / "regen.jsonl"
    if args.regen:
        for f in (args.regen, args.cache):
            if not f.exists():
                raise SystemExit(f"{f} does not exist")
    stage("regen", regen if args.regen else w / ".regen.done", lambda: (cli(
        "regen", "--mix", "code:0.4,chat:0.6", "--split", "train", "--max-samples", str(args.samples),
        "--max-tokens", "128", "--max-len", "1024", "--batch-size", "16", "--out", str(regen),
        *(["--resume"] if regen.exists() else [])), (w / ".regen.done").touch()))
    cache = args.cache.resolve() if args.cache else w / "cache"
    stage("cache", cache if args.cache else w / ".cache.done", lambda: (cli(
        "cache", "--data", str(regen), "--layers", "1,14,27", "--dtype", "fp16", "--out", str(cache),
        *(["--resume"] if cache.exists() else [])), (w / ".cache.done").touch()))

    def train_all() -> None:
        todo = [k for k in kinds if not (w / f".train-{k}.done").exists()]
        extra = ([f"data.eval_cache={args.heldout_cache.resolve()}", "data.eval_samples=24"]
                 if args.heldout_cache else [])
        if args.save_every:
            extra += [f"train.save_every={args.save_every}", "train.keep_checkpoints=100000"]
        sizing = {k: (f"train.max_steps={steps[k]}", "train.budget_minutes=null") if steps else
                  ("--budget", f"{args.budget:g}", "--budget-clock", args.budget_clock) for k in todo}
        argv = {k: ("train", "--config", f"recipes/smollm2-135m-{k}.yaml", *sizing[k],
                    f"out={w / k}", f"data.cache={cache}", *extra, *overrides[k],
                    *(["--resume"] if (w / k).is_dir() else [])) for k in todo}
        if args.parallel:
            t0 = time.perf_counter()
            wait_measured({k: cli(*argv[k], threads=1, log=w / f"train-{k}.log", wait=False) for k in todo}, w, t0)
        else:
            for k in todo:
                t0 = time.perf_counter()
                wait_measured({k: cli(*argv[k], log=w / f"train-{k}.log", wait=False)}, w, t0)
        (w / ".train.done").touch()

    stage("train", w / ".train.done", train_all)
    if "dspark" in kinds:  # the one with a confidence head
        stage("calibrate", w / ".calibrate.done", lambda: (cli(
            "calibrate", "--drafter", f"dspark:{w / 'dspark'}", "--tasks", "sharegpt", "--max-prompts", "16",
            "--max-tokens", "64", "--temperature", "1", "--block-size", str(GAMMA)), (w / ".calibrate.done").touch()))
    specs = [f"{k}:{w / k}" for k in kinds]
    for minutes in curve:
        out = w / f"curve-{minutes:g}min"
        stage(f"curve-{minutes:g}min", out / "report.json", lambda out=out, minutes=minutes: cli(
            "eval", *[x for k in kinds for x in ("--drafter", f"{k}:{nearest_checkpoint(w / k, minutes, clock)[0]}")],
            "--tasks", ",".join(WORKLOADS), "--max-prompts", str(args.eval_prompts), "--max-tokens",
            str(args.eval_tokens), "--temperature", "0", "--block-size", str(GAMMA), *eval_out(out)))
    for temp in ("0", "1"):
        out = w / f"eval-T{temp}"
        stage(f"eval-T{temp}", out / "report.json", lambda out=out, temp=temp: cli(
            "eval", *[x for s in specs + ["ngram"] for x in ("--drafter", s)], "--tasks", ",".join(WORKLOADS),
            "--max-prompts", str(args.eval_prompts), "--max-tokens", str(args.eval_tokens),
            "--temperature", temp, "--block-size", str(GAMMA), *eval_out(out)))
    for policy in () if args.no_bench else POLICIES:
        for wl in WORKLOADS:
            out = w / f"bench-{policy}-{wl}"
            stage(f"bench-{policy}-{wl}", out / "report.json", lambda out=out, wl=wl, policy=policy: cli(
                "bench", *[x for s in specs for x in ("--drafter", s)], "--workload", wl, "--concurrency", "1",
                "--requests", str(args.bench_requests), "--max-tokens", str(args.bench_tokens), "--warmup", "1",
                "--num-speculative-tokens", str(GAMMA), "--policy", policy, *bench_out(out)))

    results = collect(w, regen, kinds, curve, clock)
    prev = w / "results.json"
    if prev.is_file():  # keep the times of stages an earlier run did (this one reused them)
        stage_s = {**json.loads(prev.read_text()).get("setup", {}).get("stage_s", {}), **stage_s}
    results["setup"] = {"kinds": list(kinds), "samples": args.samples, "budget_minutes": args.budget,
                        "parallel": args.parallel,
                        "budget_clock": clock, "steps": steps or None,
                        "regen": _rel(regen), "cache": _rel(cache), "overrides": overrides,
                        "heldout_cache": _rel(args.heldout_cache.resolve()) if args.heldout_cache else None,
                        "eval_prompts": args.eval_prompts, "eval_tokens": args.eval_tokens, "gamma": GAMMA,
                        "bench_requests": args.bench_requests, "bench_tokens": args.bench_tokens,
                        "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "stage_s": stage_s,
                        "wall_s": round(time.perf_counter() - t_all, 1), "loadavg_end": os.getloadavg()}
    (w / "results.json").write_text(json.dumps(results, indent=1))
    name = f"bench_drafters-{args.section}" if args.section else "bench_drafters"
    dest = ROOT / "benchmarks" / "results" / f"{name}.json"
    dest.write_text(json.dumps(results, indent=1))
    plots = ROOT / "benchmarks" / "results" / ("drafters-" + args.section if args.section else "drafters")
    plots.mkdir(parents=True, exist_ok=True)
    for src, name in ((w / "eval-T0" / "conditional_acceptance.png", "conditional_acceptance_T0.png"),
                      (w / "eval-T1" / "conditional_acceptance.png", "conditional_acceptance_T1.png"),
                      (w / "eval-T1" / "reliability-dspark_dspark.png", "reliability_dspark_T1.png")):
        if src.is_file():
            shutil.copyfile(src, plots / name)
    print(f"wrote {dest}")
    if not args.no_md:
        write_markdown(results, args.section)
    return 0


def check_kinds(w: Path, kinds: tuple[str, ...]) -> None:
    """Record the kinds a work directory compares (kinds.json) and refuse to resume it with
    others: its stage markers and reports (train, curve, eval, bench) hold those drafters only.
    A directory from before kinds.json holds the kinds it has training runs of: all of them once
    training is done, else the first ones (a run killed while training one after the other)."""
    f = w / "kinds.json"
    if f.is_file():
        before = json.loads(f.read_text())
        ok = tuple(before) == kinds
    else:
        before = [k for k in KINDS if (w / k).is_dir()]
        ok = tuple(before) == (kinds if (w / ".train.done").exists() else kinds[:len(before)])
    if not ok:
        raise SystemExit(f"{w} holds a comparison of {','.join(before)}; resume it with --kinds {','.join(before)} "
                         "or give a new --work")
    f.write_text(json.dumps(list(kinds)))


def _rel(p: Path) -> str:
    """A path as the results name it: relative to the repo (no machine paths in committed files)."""
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return p.name


def wait_measured(procs: dict[str, subprocess.Popen], w: Path, started: float) -> None:
    """Wait for training processes launched together at `started` (time.perf_counter()); as each
    ends, append its CPU and wall seconds to <w>/train-NAME.cpu.jsonl (one row per attempt: a
    resumed run adds a row) and mark it done (<w>/.train-NAME.done). Each is timed to its own end
    (waiting for them one by one timed the second from the first one's end: 0.0 when it had ended
    first); each is polled by its pid (a wait for any child would reap other code's children too).
    A failed one is reported once all have ended."""
    pending = dict(procs)
    failed = []
    while pending:
        for name, p in list(pending.items()):
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if not pid:
                continue
            del pending[name]
            p.returncode = os.waitstatus_to_exitcode(status)
            with open(w / f"train-{name}.cpu.jsonl", "a") as f:
                f.write(json.dumps({"cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
                                    "max_rss_mb": round(ru.ru_maxrss / 1024),
                                    "wall_s": round(time.perf_counter() - started, 1), "rc": p.returncode}) + "\n")
            if p.returncode != 0:
                failed.append(name)
            else:
                (w / f".train-{name}.done").touch()
        if pending:
            time.sleep(0.05)
    if failed:
        raise SystemExit("training failed: " + ", ".join(f"{n} (see {w / f'train-{n}.log'})" for n in failed))


def nearest_checkpoint(run: Path, minutes: float, clock: str = "wall") -> tuple[Path, dict]:
    """The checkpoint of `run` whose training time is nearest `minutes`: its meta's train_cpu_s for a
    CPU budget, else budget_s (the wall seconds its budget counted; elapsed_s in checkpoints from
    before it) -- neither counts held-out evaluation or computing the target statistics."""
    best: tuple[float, Path, dict] | None = None
    for d in sorted(run.glob("checkpoint-*")):
        meta_f = d / "train_state" / "meta.json"
        if not meta_f.is_file():
            continue
        meta = json.loads(meta_f.read_text())
        key = "train_cpu_s" if clock == "cpu" else "budget_s" if "budget_s" in meta else "elapsed_s"
        gap = abs(float(meta[key]) - minutes * 60)
        if best is None or gap < best[0]:
            best = (gap, d, meta)
    if best is None:
        raise SystemExit(f"{run} has no checkpoints to take the {minutes:g}-minute point from")
    keep = ("step", "elapsed_s", "cpu_s", "train_cpu_s", "budget_s")
    return best[1], {k: best[2][k] for k in keep if k in best[2]}


def collect(w: Path, regen_path: Path, kinds: tuple[str, ...] = KINDS, curve: list[float] = (),
            clock: str = "wall") -> dict:
    regen = list(scan_output(regen_path, repair=False)[0].values())  # a torn last line (a killed run) is skipped
    res: dict = {"data": {"conversations": len(regen), "tokens": sum(int(r.get("num_tokens", 0)) for r in regen),
                          "trained_tokens": sum(sum(r.get("loss_mask") or []) for r in regen)},
                 "train": {k: train_info(w / k) for k in kinds if (w / k / "metrics.jsonl").is_file()},
                 "eval": {}, "bench": {}, "curve": {}}
    for k in res["train"]:
        f = w / f"train-{k}.cpu.jsonl"
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []
        res["train"][k]["cpu_s"] = round(sum(r["cpu_s"] for r in rows), 1) if rows else None
        res["train"][k]["wall_s"] = round(sum(r["wall_s"] for r in rows), 1) if rows else None
        res["train"][k]["attempts"] = rows  # one per process: a resumed or relaunched run has several
        hf = w / k / "heldout.jsonl"
        if hf.is_file():
            res["train"][k]["heldout"] = [json.loads(x) for x in hf.read_text().splitlines() if x.strip()]
    for minutes in curve:
        p = w / f"curve-{minutes:g}min" / "report.json"
        if p.is_file():
            rep = json.loads(p.read_text())
            res["curve"][f"{minutes:g}"] = {d["kind"]: {
                **nearest_checkpoint(w / d["kind"], minutes, clock)[1], "overall": _acc(d["overall"]),
                "tasks": {t: _acc(v) for t, v in d["tasks"].items()}} for d in rep["drafters"]}
    for temp in ("0", "1"):
        p = w / f"eval-T{temp}" / "report.json"
        if p.is_file():
            rep = json.loads(p.read_text())
            res["eval"][temp] = {"prompts": rep["prompts"], "drafters": {
                d["kind"] if d["kind"] in KINDS else d["label"]: {
                    "overall": _acc(d["overall"]), "tasks": {t: _acc(v) for t, v in d["tasks"].items()},
                    "calibration": _cal(d.get("calibration"))} for d in rep["drafters"]}}
    for policy in POLICIES:
        for wl in WORKLOADS:
            p = w / f"bench-{policy}-{wl}" / "report.json"
            if p.is_file():
                rep = json.loads(p.read_text())
                tier = rep["tiers"][0]
                # keyed by kind (a label is KIND:PATH, and the work dir is a local path)
                res["bench"][f"{policy}:{wl}"] = {r["label"].partition(":")[0]: {
                    "speedup": r["speedup"], "tokens_per_s": r["system_tokens_per_s"], "tau": r["tau"],
                    "acceptance": r["acceptance_rate"], "spread": r.get("speedup_spread")} for r in tier["results"]}
    return res


def _acc(s: dict) -> dict:
    return {k: s[k] for k in ("tau", "acceptance_rate", "rounds", "committed", "conditional_acceptance",
                              "prefix_survival")}


def _cal(c: dict | None) -> dict | None:
    if not c:
        return None
    return {"source": c["source"], "temperatures": c["temperatures"],
            **{f"{when}_{k}": c[when][k] for when in ("before", "after")
               for k in ("mean_ece_cumulative", "mean_ece_conditional")},
            "before_pooled": c["before"]["pooled_conditional"], "after_pooled": c["after"]["pooled_conditional"]}


def _f(x, nd=2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def write_markdown(r: dict, section: str = "") -> None:
    s, d = r["setup"], r["data"]
    names = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark", "ngram": "n-gram (reference)"}
    begin, end = (f"<!-- bench_drafters-{section}:begin -->", f"<!-- bench_drafters-{section}:end -->") if section \
        else (BEGIN, END)
    kinds = tuple(s.get("kinds") or KINDS)
    compared = " vs ".join(names[k] for k in kinds)
    n = {2: "two", 3: "three"}.get(len(kinds), str(len(kinds)))
    cpu_clock = s.get("budget_clock") == "cpu"
    unit = "CPU minutes" if cpu_clock else "minutes"
    title = (f"## Drafters at equal long budgets: {compared}, {s['budget_minutes']:g} {unit} each "
             "(issue 12)" if section else f"## Drafters: {compared}, same data and budget (issue 4)")
    flags = "".join(f" --{k.replace('_', '-')} {s[k]}" for k in ("regen", "cache", "heldout_cache") if s.get(k)
                    and section)
    sets = "".join(f" --set {k}:{kv}" for k, kvs in (s.get("overrides") or {}).items() for kv in kvs)
    lines = [begin, title, "",
             "`benchmarks/bench_drafters.py" + ("" if s.get("regen") and section else f" --samples {s['samples']}")
             + f" --budget {s['budget_minutes']:g}"
             + ("" if kinds == KINDS else " --kinds " + ",".join(kinds))
             + (" --parallel" if s["parallel"] else "")
             + (" --steps " + ",".join(f"{k}={n}" for k, n in s["steps"].items()) if s.get("steps")
                else " --budget-clock cpu" if cpu_clock else "") + flags + sets + "` (JSON: `benchmarks/results/"
             + (f"bench_drafters-{section}" if section else "bench_drafters") + ".json`). "
             f"Machine: {s['machine']}, no GPU. Data: {d['conversations']} regenerated train-split conversations "
             f"(code:0.4, chat:0.6; {d['tokens']} tokens, {d['trained_tokens']} of them target answers), one feature "
             f"cache (layers 1, 14, 27 + final) for all {n}. Training: each recipe for {s['budget_minutes']:g} "
             + ("CPU minutes: a fixed step count sized from the recipe's CPU seconds per step measured under the "
                "same load (each completes its learning-rate schedule; the CPU minutes it took are in the table)"
                if s.get("steps") else
                "CPU minutes (its process's CPU time sets the step count and the stop)" if cpu_clock
                else "minutes of wall clock") + (f", the {n} at once with one torch thread each (identical conditions)"
                                         if s["parallel"] else ", one after the other") + ".", "",
             "| drafter | steps | CPU minutes (training / process) | final loss | train acc@1 / expected acceptance "
             "| held-out at the end (teacher-forced) |", "|---|---|---|---|---|---|"]
    for k, t in r["train"].items():
        last = t["last"]
        acc = next((last[x] for x in ("acc@1", "accept") if x in last), None)
        ho = (t.get("heldout") or [{}])[-1]
        held = ", ".join(f"{x} {ho[x]:.3f}" for x in ("greedy", "greedy@1", "accept", "acc@1", "acc") if x in ho) or "–"
        cpu = (_f(last["train_cpu_s"] / 60, 1) if "train_cpu_s" in last else "–") + " / " + (
            _f(t["cpu_s"] / 60, 1) if t.get("cpu_s") else "–")
        lines.append(f"| {names[k]} | {t['steps']} | {cpu} | {_f(last.get('loss'), 3)} | {_f(acc, 3)} | {held} |")
    if any(t.get("heldout") for t in r["train"].values()):
        lines += ["", "Held-out columns (train/evaluate.py, 24 held-out conversations, teacher-forced): `greedy` = the "
                  "draft's argmax is the target's (T = 0 acceptance of a position whose prefix was accepted), "
                  "`accept` = mean 1 − TV (the same at T = 1), `acc` = top-1 agreement with the data token; `@1` = "
                  "the first draft position only. The per-checkpoint curves are in the JSON."]
    lines += ["", f"Held-out τ (tokens per verification round, bonus included; γ = {s['gamma']} drafts, fixed), "
              f"{s['eval_prompts']} held-out prompts per task, {s['eval_tokens']} new tokens per turn "
              "(MT-Bench: 2 turns):", "",
              "| drafter | τ HumanEval T=0 | τ MT-Bench T=0 | τ all T=0 | τ HumanEval T=1 | τ MT-Bench T=1 | τ all T=1 "
              "| acceptance T=1 |", "|---|---|---|---|---|---|---|---|"]
    ev = r["eval"]
    labels = list((ev.get("1") or ev.get("0") or {"drafters": {}})["drafters"])
    for lab in labels:
        row = [names.get(lab, lab)]
        for temp in ("0", "1"):
            e = (ev.get(temp) or {"drafters": {}})["drafters"].get(lab)
            row += ([_f(e["tasks"].get(t, {}).get("tau")) for t in WORKLOADS] + [_f(e["overall"]["tau"])]
                    if e else ["–"] * 3)
        e1 = (ev.get("1") or {"drafters": {}})["drafters"].get(lab)
        row.append(_f(e1["overall"]["acceptance_rate"]) if e1 else "–")
        lines.append("| " + " | ".join(row) + " |")
    for temp in ("0", "1"):
        e = (ev.get(temp) or {"drafters": {}})["drafters"]
        if "dspark" in e and len(kinds) > 1 and all(k in e for k in kinds):
            t = {k: e[k]["overall"]["tau"] for k in kinds}
            paper = {"dflash": "+16–18% over DFlash", "eagle3": "+27–31% over EAGLE-3"}
            lines += ["", f"Ordering at T={temp}: DSpark τ {t['dspark']:.2f} vs "
                      + " vs ".join(f"{names[k]} {t[k]:.2f} ({(t['dspark'] / t[k] - 1) * 100:+.0f}%)"
                                    for k in paper if k in kinds)
                      + "; paper: " + ", ".join(paper[k] for k in paper if k in kinds) + "."]
    if r.get("curve"):
        lines += ["", "τ at T = 0 against training time (the checkpoint nearest each point; held-out HumanEval / "
                  "MT-Bench / all, same eval arguments as above):", "",
                  f"| {'CPU minutes' if cpu_clock else 'minutes (wall)'} | " + " | ".join(names[k] for k in kinds) + " |", "|---|" + "---|" * len(kinds)]
        final = (ev.get("0") or {"drafters": {}})["drafters"]
        points = [(m, c) for m, c in r["curve"].items()] + ([(f"{s['budget_minutes']:g} (final)", final)] if final else [])
        for m, c in points:
            cells = []
            for k in kinds:
                e = c.get(k)
                cells.append("–" if not e else " / ".join(_f(e["tasks"].get(t, {}).get("tau")) for t in WORKLOADS)
                             + f" / {_f(e['overall']['tau'])}" + (f" (step {e['step']})" if "step" in e else ""))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    e1 = (ev.get("1") or {"drafters": {}})["drafters"]
    if e1:
        lines += ["", "Conditional acceptance per position k = 1..γ at T=1 (P(draft k accepted | 1..k−1 accepted); "
                  f"plots: `benchmarks/results/{'drafters-' + section if section else 'drafters'}/`):", ""]
        for lab, e in e1.items():
            ca = e["overall"]["conditional_acceptance"]
            lines.append(f"- {names.get(lab, lab)}: " + ", ".join(_f(x) for x in ca))
        cal = e1.get("dspark", {}).get("calibration")
        if cal:
            lines += ["", f"DSpark confidence calibration at T=1 (STS from {cal['source']}): mean ECE over positions "
                      f"(cumulative a_k) {_f(cal['before_mean_ece_cumulative'], 3)} before → "
                      f"{_f(cal['after_mean_ece_cumulative'], 3)} after; conditional c_k "
                      f"{_f(cal['before_mean_ece_conditional'], 3)} → {_f(cal['after_mean_ece_conditional'], 3)}; "
                      f"pooled conditional AUROC {_f(cal['before_pooled'].get('auroc'))}, Brier "
                      f"{_f(cal['before_pooled'].get('brier'), 3)} → {_f(cal['after_pooled'].get('brier'), 3)}."]
    if r["bench"]:
        lines += ["", f"Wall clock at batch 1 (draftsmith bench, concurrency 1, {s['bench_requests']} held-out requests "
                  f"× {s['bench_tokens']} tokens, greedy, each drafter interleaved with plain decoding in one run; "
                  "speedup = tokens/s ÷ plain's):", "",
                  "| policy | workload | " + " | ".join(names[k] for k in kinds) + " |",
                  "|---|---|" + "---|" * len(kinds)]
        for key, rows in r["bench"].items():
            policy, wl = key.split(":")
            cells = []
            for k in kinds:
                v = rows.get(k)
                cells.append(f"{v['speedup']:.2f}× (τ {_f(v['tau'])})" if v and v["speedup"] is not None else "–")
            lines.append(f"| {policy} | {wl} | " + " | ".join(cells) + " |")
    lines += ["", f"Stage times (s): {s['stage_s']}; load average at the end {s['loadavg_end'][0]:.1f}."]
    sections.write_section(begin, end, "\n".join(lines[1:]))


if __name__ == "__main__":
    sys.exit(main())
