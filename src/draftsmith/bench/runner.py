"""`run_bench(config) -> report.json path`: plan the tiers, run them interleaved, stream the
results to disk, write the report.

Within a tier every configuration runs the same requests (same prompts, same seeds, same
arrival schedule) back to back, in alternating order per interleaving unit (bench/tier.py;
docs/MEASURING.md #1). Peers (`--peers hf,llamacpp`: HF transformers, llama.cpp) join the
concurrency-1 closed-loop tier as extra configurations; if there is no such tier, a `peers` phase (concurrency 1, closed loop) runs
ours and theirs (bench/phases.py).

Files in `out`:
    setup.json     the full setup + the fingerprint a --resume must match + one entry per invocation
    results.jsonl  one JSON line per finished (tier, configuration), written when its tier ends
                   (a tier's configurations are only comparable measured together; bench/results.py)
    report.json, report.md, *.png   (bench/report.py)
An interrupted run keeps every finished tier; `--resume` skips them and reruns a tier that
was cut short as a whole.

Modules: machine (machine facts), inprocess / endpoint (the backends), phases, tier (one
tier's run), tier_lines (its results lines), results (the raw files), report (the report).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from draftsmith.bench.config import BenchConfig
from draftsmith.bench.endpoint import EndpointBackend
from draftsmith.bench.inprocess import InProcessBackend
from draftsmith.bench.machine import loadavg, machine_info, utc_now, versions
from draftsmith.bench.phases import phase_labels, plan_phases
from draftsmith.bench.report import OUTPUT_FILES, write_report
from draftsmith.bench.results import (
    FORMAT_VERSION, RESULTS, SETUP, append_lines, atomic_write, fingerprint_sha, keep_finished, read_results,
)
from draftsmith.bench.tier import run_phase
from draftsmith.bench.workload import load_workload
from draftsmith.data.outdir import check_no_other_job, check_out_dir
from draftsmith.errors import DraftsmithError
from draftsmith.policy.roofline import measure_bandwidth


def _default_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _config_json(cfg: BenchConfig) -> dict:
    d = asdict(cfg)
    d["out"] = str(cfg.out)
    d["arrival"] = cfg.arrival.label
    return d


# What a resumed run must share with the run it continues: the tiers of one report are compared with
# each other, and a tier measured on other hardware or with other threads is not comparable.
SAME_MACHINE = ("cpu_model", "cpu_count", "torch_threads", "device", "cuda", "gpu")
GPU_KEYS = ("cuda", "gpu")  # what the machine has, not what ran: compared only where a run measured on CUDA


def check_same_machine(old: dict, new: dict, out: Path, devices: tuple[str | None, str | None] = (None, None)) -> None:
    """Refuse a --resume on another machine or with another thread count than setup.json's.
    `devices`: the target's device then (setup.json's target) and now; where neither is CUDA the
    GPU's facts do not count (a `--device cpu` run resumed with the GPU hidden measures the same)."""
    then, now = devices
    old = {**old, **({"device": then} if then is not None else {})}
    new = {**new, **({"device": now} if now is not None else {})}
    on_gpu = then is None or now is None or then.startswith("cuda") or now.startswith("cuda")
    keys = [k for k in SAME_MACHINE if on_gpu or k not in GPU_KEYS]
    diff = [k for k in keys if k in old and old.get(k) != new.get(k)]
    if diff:
        said = "; ".join(f"{k} {old.get(k)!r} then, {new.get(k)!r} now" for k in diff)
        raise DraftsmithError(f"--resume: {out} was measured on another machine or with other threads ({said}); "
                              "resume it where it ran (with the same --threads), or use another --out or --overwrite")


def run_bench(config: BenchConfig, log: Callable[[str], None] | None = None) -> Path:
    """Run (or resume) the bench described by `config`; write the report; return report.json's path.

    report.md and the PNG plots are written next to it (see bench/report.py).
    """
    cfg = config
    log = log or _default_log
    out = check_out_dir(cfg.out)
    check_no_other_job(out, "bench", (SETUP, RESULTS))  # (--overwrite deleted an eval's report.json)
    results_path, setup_path = out / RESULTS, out / SETUP
    existing, _ = read_results(results_path)
    if (existing or setup_path.exists()) and not (cfg.resume or cfg.overwrite):
        raise DraftsmithError(f"{out} already holds bench results; pass --resume to continue them or "
                              "--overwrite to start again")
    t_start, load_start = utc_now(), loadavg()
    # the backend before --out is created or emptied: a server that does not answer is refused first
    backend = EndpointBackend(cfg, log) if cfg.endpoint_mode else InProcessBackend(cfg, log)
    if cfg.resume and not setup_path.exists():
        log(f"bench: nothing to resume in {out}; starting a new run")
    wl = load_workload(cfg.workload, cfg.split, cfg.requests, backend.tokenize, backend.max_prompt_tokens,
                       turns=cfg.turns, answer_tokens=cfg.max_tokens + 8)
    fp = cfg.fingerprint([p.id for p in wl.prompts], backend.weights_hash)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.overwrite:  # after the workload loads: a mistyped --workload / --split deletes nothing
        for name in (RESULTS, SETUP, *OUTPUT_FILES):
            (out / name).unlink(missing_ok=True)
    fp_sha = fingerprint_sha(fp)
    max_len = 0
    if not cfg.endpoint_mode:
        longest = max(p.longest_prompt for p in wl.prompts)
        max_len = min(backend.model.config.max_position_embeddings, longest + cfg.max_tokens + backend.max_k + 2)

    machine = machine_info()
    invocation = {"started": t_start, "loadavg_start": load_start, "resumed": False, "phases_run": [],
                  "argv": list(sys.argv), "pid": os.getpid(), "versions": versions(),
                  "torch_threads": machine["torch_threads"]}
    if setup_path.exists():
        setup = json.loads(setup_path.read_text())
        old = setup.get("fingerprint", {})
        if old != fp:
            diff = sorted(k for k in set(old) | set(fp) if old.get(k) != fp.get(k))
            raise DraftsmithError(f"--resume: {out} was measured with a different setup (differs in: "
                                  f"{', '.join(diff)}); use another --out or --overwrite")
        if not cfg.endpoint_mode:  # (against servers, this client's machine is not what was measured)
            check_same_machine(setup.get("machine", {}), machine, out,
                               (setup.get("target", {}).get("device"), getattr(backend, "target_info", {}).get("device")))
        invocation["resumed"] = True
        setup["config"] = _config_json(cfg)  # the tier list (and report-only inputs) may differ
    else:
        setup = {
            "format_version": FORMAT_VERSION, "created": t_start, "fingerprint": fp, "fingerprint_sha": fp_sha,
            "config": _config_json(cfg), "versions": versions(), "machine": machine,
            **backend.setup(),
            "workload": {"name": cfg.workload, "split": wl.split, "prompt_ids": [p.id for p in wl.prompts],
                         "unique_prompts": len(wl.prompts) - wl.reused, "reused_prompts": wl.reused,
                         "skipped_prompts": wl.skipped, "max_prompt_tokens": backend.max_prompt_tokens,
                         "engine_max_len": max_len or None,
                         "prompt_sources": sorted({p.source for p in wl.prompts}),
                         **({"turns": cfg.turns, "total_turns": wl.total_turns} if cfg.turns > 1 else {})},
            "prefix_caching": cfg.enable_prefix_caching if not cfg.endpoint_mode else "the servers' own setting",
            "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens,
                         "seed": cfg.seed, "per_request_seed": "seed * 1000003 + request index",
                         **({"json_schema": cfg.schema} if cfg.json_schema is not None else {})},
            "arrival": cfg.arrival.label, "warmup": cfg.warmup, "repeats": cfg.repeats,
            "invocations": [],
        }
    setup["invocations"].append(invocation)
    atomic_write(setup_path, json.dumps(setup, indent=2))

    # keep complete tiers only (a tier cut short is measured again, all its configurations together)
    phases = plan_phases(cfg)
    expected = {ph.key: phase_labels(cfg, ph) for ph in phases}
    done = keep_finished(results_path, expected)
    todo = [ph for ph in phases if ph.key not in done]
    if done:
        log(f"bench: resuming; {len(done)} finished tier(s) kept: {', '.join(sorted(done))}")

    # the bar counts turns (one per request without --turns): the request list is wl.prompts, the
    # warm-up its first prompts
    warm = sum(1 + len(wl.prompts[j % len(wl.prompts)].followups) for j in range(cfg.warmup))
    total = sum(len(expected[ph.key]) * (wl.total_turns * cfg.repeats + warm) for ph in todo)
    bar = tqdm(total=total, desc="bench", unit="req", file=sys.stderr, dynamic_ncols=True,
               disable=(not sys.stderr.isatty()) if cfg.progress is None else not cfg.progress)
    try:
        for ph in todo:
            new = run_phase(backend, cfg, ph, wl, max_len, bar, fp_sha, log)
            append_lines(results_path, new)
            invocation["phases_run"].append(ph.key)
            atomic_write(setup_path, json.dumps(setup, indent=2))
    finally:
        bar.close()
    invocation["finished"] = utc_now()
    invocation["loadavg_end"] = loadavg()
    atomic_write(setup_path, json.dumps(setup, indent=2))
    lines, _ = read_results(results_path)
    wanted = {ph.key for ph in phases}
    lines = [ln for ln in lines if ln["phase"] in wanted]
    return write_report(out, setup, lines, cfg, weights_bytes=getattr(backend, "weights_bytes", None),
                        bandwidth_gbs=_bandwidth(cfg, backend))


def _bandwidth(cfg: BenchConfig, backend) -> float | None:
    if cfg.mem_bandwidth_gbs is not None:
        return cfg.mem_bandwidth_gbs
    if cfg.endpoint_mode:
        return None
    # measured here, after the timed phases (docs/MEASURING.md #8): a fixed default went stale
    # (15 GB/s assumed where 40-77 were measured, so fraction_of_bound read ~3x too high)
    return round(measure_bandwidth(backend.model.device), 1)
