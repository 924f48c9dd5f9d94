"""`run_bench(config) -> report.json path`: plan the tiers, run them interleaved, stream the
results to disk, write the report.

Within a tier every configuration runs the same requests (same prompts, same seeds, same
arrival schedule) back to back, in alternating order per interleaving unit (A B C, C B A,
…; docs/MEASURING.md #1). A unit is one request at concurrency 1 in a closed loop (so the ratio's
spread is per prompt), else the whole request list; `repeats` repeats the units.
HF peers (`--peers hf`) join the concurrency-1 closed-loop tier as extra configurations; if
there is no such tier, a `peers` phase (concurrency 1, closed loop) runs ours and theirs.

Files in `out`:
    setup.json     the full setup + the fingerprint a --resume must match + one entry per invocation
    results.jsonl  one JSON line per finished (tier, configuration), written when its tier ends
                   (a tier's configurations are only comparable measured together)
    report.json, report.md, *.png   (bench/report.py)
An interrupted run keeps every finished tier; `--resume` skips them and reruns a tier that
was cut short as a whole.
"""

from __future__ import annotations

import datetime as _dt
import gc
import hashlib
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftsmith.bench.config import BASELINE, Arrival, BenchConfig
from draftsmith.bench.loadgen import (
    BenchRequest, diff_counters, endpoint_model, poisson_offsets, run_endpoint, run_engine, scrape_counters,
)
from draftsmith.bench.metrics import RunResult, spread, summarize
from draftsmith.bench.verdict import verdict
from draftsmith.bench.workload import Workload, load_workload
from draftsmith.core.sampling import SamplingParams
from draftsmith.errors import DraftsmithError
from draftsmith.engine.builder import build_engine
from draftsmith.models.prompts import encode_messages
from draftsmith.policy.fixed import FixedK
from draftsmith.policy.roofline import measure_bandwidth

FORMAT_VERSION = 1
RESULTS = "results.jsonl"
SETUP = "setup.json"


@dataclass(frozen=True)
class Phase:
    key: str  # "c4" for a tier, "peers" for the peers-only phase
    concurrency: int
    arrival: Arrival
    with_peers: bool
    tier: bool  # part of the concurrency sweep


def plan_phases(cfg: BenchConfig) -> list[Phase]:
    closed = cfg.arrival.mode == "closed"
    phases = [Phase(f"c{c}", c, cfg.arrival, bool(cfg.peers) and c == 1 and closed, True) for c in cfg.concurrency]
    if cfg.peers and not any(p.with_peers for p in phases):
        phases.insert(0, Phase("peers", 1, Arrival("closed"), True, False))
    return phases


# ---- machine facts -----------------------------------------------------------------------------


def _proc_kb(field: str, path: str = "/proc/self/status") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict:
    import torch

    info = {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "mem_total_bytes": _proc_kb("MemTotal", "/proc/meminfo"),
            "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_mem_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def versions() -> dict:
    import torch
    import transformers

    import draftsmith

    return {"draftsmith": draftsmith.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ---- configurations -------------------------------------------------------------------------------


class EngineRunner:
    """One in-process configuration: a drafter + policy on an Engine over the shared target."""

    def __init__(self, label: str, kind: str, engine, info: dict) -> None:
        self.label, self.kind, self.engine, self.info = label, kind, engine, info

    def run(self, requests, concurrency, offsets, on_done) -> RunResult:
        return run_engine(self.engine, requests, concurrency, offsets, on_done)


class EndpointRunner:
    kind = "endpoint"

    def __init__(self, label: str, url: str, model: str, timeout: float) -> None:
        self.label, self.url, self.model, self.timeout = label, url, model, timeout
        self.info = {"url": url, "model": model}

    def run(self, requests, concurrency, offsets, on_done) -> RunResult:
        before = scrape_counters(self.url)
        res = run_endpoint(self.url, self.model, requests, concurrency, offsets, self.timeout, on_done)
        res.counters = diff_counters(before, scrape_counters(self.url))
        return res


class InProcessBackend:
    def __init__(self, cfg: BenchConfig, log: Callable[[str], None]) -> None:
        from draftsmith.eval.runner import default_block_size, load_drafter
        from draftsmith.models.target import eos_token_ids, load_target

        self.cfg = cfg
        self.target = load_target(cfg.target, device=cfg.device, dtype=cfg.dtype)
        self.eos = eos_token_ids(self.target)
        self.model = self.target.model
        self.peers: list | None = None
        self.drafters: dict[str, dict] = {}
        for spec in cfg.drafters:  # resolve (and validate) every drafter before measuring anything
            loaded = load_drafter(spec, self.target, 1, 64)
            k = cfg.num_speculative_tokens or default_block_size(loaded, fallback=5)
            self.drafters[spec] = {
                "label": spec, "spec": spec, "kind": loaded.kind, "num_speculative_tokens": k, "policy": cfg.policy,
                "checkpoint": str(Path(loaded.checkpoint).resolve()) if loaded.checkpoint else None,
                "checkpoint_config": loaded.config or None,
                "calibration_temperatures": list(loaded.temperatures) if loaded.temperatures else None,
            }
            del loaded
        self.max_k = max([d["num_speculative_tokens"] for d in self.drafters.values()] + [0])
        ctx = self.model.config.max_position_embeddings
        self.max_prompt_tokens = cfg.max_prompt_tokens or max(1, ctx - cfg.max_tokens - self.max_k - 2)
        params = sum(p.numel() for p in self.model.parameters())
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.target_info = {
            "id": self.target.target_id, "path": str(self.target.path), "weights_hash": self.target.weights_hash,
            "dtype": str(self.model.dtype).removeprefix("torch."), "device": str(self.model.device),
            "parameters": params, "weights_bytes": self.weights_bytes, "max_position_embeddings": ctx,
            "eos_token_ids": list(self.eos), "model_type": self.model.config.model_type,
        }

    @property
    def weights_hash(self) -> str:
        return self.target.weights_hash

    def tokenize(self, messages: list[dict]) -> list[int]:
        return encode_messages(self.target.tokenizer, messages)

    def runners(self, phase: Phase, max_len: int) -> list:
        C = phase.concurrency
        out: list = []
        shared_cache = None
        for label in self.cfg.config_labels:
            if label == BASELINE:
                engine = build_engine(self.target, "none", FixedK(0), 0, C, max_len, cache=shared_cache)
                kind = "baseline"
                info = {"label": BASELINE, "spec": BASELINE, "kind": "none", "num_speculative_tokens": 0,
                        "policy": "none", "checkpoint": None}
            else:
                info = self.drafters[label]
                # Configurations never run at the same time and every run leaves all rows free,
                # so they share one target KV cache (rows are reset on admission).
                engine = build_engine(self.target, label, self.cfg.policy, info["num_speculative_tokens"], C, max_len,
                                      cache=shared_cache)
                kind = "drafter"
            shared_cache = engine.cache
            out.append(EngineRunner(label, kind, engine, info))
        if phase.with_peers:
            if self.peers is None:
                from draftsmith.bench.peers import build_hf_peers

                self.peers = build_hf_peers(self.target, self.eos, self.cfg.peer_lookup_tokens, self.cfg.peer_assistant)
            out.extend(self.peers)
        return out

    def memory(self, runner) -> dict:
        import torch

        m: dict[str, Any] = {"rss_bytes": _proc_kb("VmRSS"), "process_peak_rss_bytes": _proc_kb("VmHWM"),
                             "peak_rss_scope": "process lifetime (VmHWM)"}
        engine = getattr(runner, "engine", None)
        bpt = (2 * self.model.config.num_layers * self.model.config.num_kv_heads * self.model.config.head_dim
               * self.model.dtype.itemsize)
        m["kv_bytes_per_token"] = bpt
        if engine is not None:
            m["kv_cache_bytes"] = getattr(engine.cache, "bytes", None)
            m["kv_cache_rows"] = getattr(engine.cache, "max_rows", None)
            m["kv_cache_max_len"] = getattr(engine.cache, "max_len", None)
        if self.model.device.type == "cuda":
            dev = self.model.device
            free, total = torch.cuda.mem_get_info(dev)
            cached_free = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            m["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
            m["cuda_total_bytes"] = total
            m["kv_headroom_bytes"] = free + cached_free
            m["kv_headroom_source"] = "cuda free + allocator-cached"
        else:
            m["kv_headroom_bytes"] = _proc_kb("MemAvailable", "/proc/meminfo")
            m["kv_headroom_source"] = "host MemAvailable"
        if m.get("kv_headroom_bytes") is not None:
            m["kv_headroom_tokens"] = int(m["kv_headroom_bytes"] // bpt)
        return m

    def reset_peak(self) -> None:
        import torch

        if self.model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.model.device)

    def release(self, runners: list) -> None:
        import torch

        for r in runners:
            if hasattr(r, "engine"):
                r.engine = None
        runners.clear()
        gc.collect()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def setup(self) -> dict:
        return {"mode": "in-process", "target": self.target_info, "drafters": [
            {"label": BASELINE, "spec": BASELINE, "kind": "none", "num_speculative_tokens": 0, "policy": None,
             "checkpoint": None},
            *self.drafters.values()]}


class EndpointBackend:
    weights_hash = None
    max_prompt_tokens = None
    peers = None

    def __init__(self, cfg: BenchConfig, log: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.endpoints = []
        for e in cfg.endpoints:
            model = cfg.endpoint_model or endpoint_model(e.url)
            self.endpoints.append((e, model))

    tokenize = None

    def runners(self, phase: Phase, max_len: int) -> list:
        return [EndpointRunner(e.label, e.url, model, self.cfg.request_timeout) for e, model in self.endpoints]

    def memory(self, runner) -> dict:
        return {"rss_bytes": _proc_kb("VmRSS"), "rss_scope": "the bench client process, not the server"}

    def reset_peak(self) -> None:
        pass

    def release(self, runners: list) -> None:
        runners.clear()

    def setup(self) -> dict:
        return {"mode": "endpoint", "target": {"id": ", ".join(sorted({m for _, m in self.endpoints})),
                                               "weights_hash": None, "served_models": {e.label: m for e, m in self.endpoints}},
                "drafters": [{"label": e.label, "spec": e.url, "kind": "endpoint", "checkpoint": None,
                              "served_model": m} for e, m in self.endpoints]}


# ---- results file ---------------------------------------------------------------------------------


def read_results(path: Path) -> tuple[list[dict], int]:
    """Complete lines of results.jsonl and the byte length they span (a torn last line is not)."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    lines, good = [], 0
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            break
        good += len(raw)
    return lines, good


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _append_lines(path: Path, lines: list[dict]) -> None:
    blob = "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines)
    with open(path, "a") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def _fingerprint_sha(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


# ---- one tier ---------------------------------------------------------------------------------


def _requests(cfg: BenchConfig, wl: Workload, n: int, index_base: int = 0) -> list[BenchRequest]:
    out = []
    for j in range(n):
        p = wl.prompts[j % len(wl.prompts)]
        seed = cfg.seed * 1_000_003 + index_base + j
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed)
        out.append(BenchRequest(j, p.id, p.messages, p.token_ids, params))
    return out


def _sum_counters(runs: list[RunResult]) -> dict | None:
    cs = [r.counters for r in runs if r.counters is not None]
    if not cs:
        return None
    bad = next((c for c in cs if "unavailable" in c), None)
    if bad is not None:
        return {"unavailable": bad["unavailable"]}
    out: dict[str, Any] = {"source": cs[0].get("source")}
    for k in ("proposed", "accepted", "rounds", "committed", "generation_tokens", "engine_steps", "target_forwards"):
        vals = [c.get(k) for c in cs]
        out[k] = None if any(v is None for v in vals) else sum(vals)
    for k in ("position_proposed", "position_accepted"):
        width = max(len(c[k]) for c in cs)
        out[k] = [sum(c[k][i] for c in cs if i < len(c[k])) for i in range(width)]
    out["server_rss_bytes"] = cs[-1].get("server_rss_bytes")
    return out


def run_phase(backend, cfg: BenchConfig, phase: Phase, wl: Workload, max_len: int, bar, fp_sha: str,
              log: Callable[[str], None]) -> list[dict]:
    started, load0 = _now(), loadavg()
    runners = backend.runners(phase, max_len)
    try:
        C, N = phase.concurrency, cfg.requests
        reqs = _requests(cfg, wl, N)
        closed = phase.arrival.mode == "closed"
        offsets = None if closed else poisson_offsets(N, phase.arrival.rate, cfg.seed * 7919 + C)

        def tick(label: str):
            def f(_rec) -> None:
                bar.set_description_str(f"bench {phase.key} {label}", refresh=False)
                bar.update(1)
            return f

        # warm-up (docs/MEASURING.md #4): unmeasured requests per configuration, at this tier's concurrency
        if cfg.warmup:
            warm = _requests(cfg, wl, cfg.warmup, index_base=10_000_000)
            for r in runners:
                r.run(warm, 1 if r.kind == "peer" else min(C, cfg.warmup), None, tick(r.label))
        per_request_units = closed and C == 1
        unit_lists = [[i] for i in range(N)] if per_request_units else [list(range(N))]
        units = unit_lists * cfg.repeats
        runs: dict[str, list[RunResult]] = {r.label: [] for r in runners}
        mem: dict[str, dict] = {}
        for u, idx in enumerate(units):
            order = runners if u % 2 == 0 else list(reversed(runners))
            sub = [reqs[i] for i in idx]
            offs = None if offsets is None else [offsets[i] - offsets[idx[0]] for i in idx]
            for r in order:
                backend.reset_peak()
                res = r.run(sub, C, offs, tick(r.label))
                runs[r.label].append(res)
                m = backend.memory(r)
                prev = mem.get(r.label)
                if prev and prev.get("cuda_peak_allocated_bytes") is not None:
                    m["cuda_peak_allocated_bytes"] = max(m["cuda_peak_allocated_bytes"], prev["cuda_peak_allocated_bytes"])
                mem[r.label] = m
        return _phase_lines(cfg, phase, runners, runs, mem, started, load0, fp_sha, per_request_units, log)
    finally:
        backend.release(runners)


def _phase_lines(cfg, phase, runners, runs, mem, started, load0, fp_sha, per_request_units, log) -> list[dict]:
    labels = [r.label for r in runners]
    base_label = BASELINE if BASELINE in labels else None
    summaries = {}
    for r in runners:
        counters = _sum_counters(runs[r.label]) if r.kind == "endpoint" else None
        if counters is not None and "unavailable" in counters:
            s = summarize(runs[r.label])
            for k in ("draft_proposed", "draft_accepted", "rounds", "committed", "acceptance_rate", "tau",
                      "target_forwards", "target_forwards_per_token"):
                s[k] = None
            s.update(position_proposed=[], position_accepted=[], per_position_acceptance=[],
                     counts_source=f"unavailable: {counters['unavailable']}")
        else:
            s = summarize(runs[r.label], counts_from_endpoint=counters)
        if counters is not None and counters.get("server_rss_bytes") is not None:
            mem[r.label]["server_rss_bytes"] = counters["server_rss_bytes"]
        summaries[r.label] = s
    greedy = cfg.temperature == 0
    lines = []
    finished, load1 = _now(), loadavg()
    for r in runners:
        s = summaries[r.label]
        line: dict[str, Any] = {
            "format_version": FORMAT_VERSION, "fingerprint": fp_sha, "phase": phase.key, "tier": phase.tier,
            "concurrency": phase.concurrency, "arrival": phase.arrival.label, "label": r.label, "kind": r.kind,
            "info": r.info, "started": started, "finished": finished, "loadavg_start": load0, "loadavg_end": load1,
            "interleaving": {"unit": "request" if per_request_units else "request list", "units": len(runs[r.label]),
                             "order": "alternating (A B C, C B A, ...)", "position_in_order": labels.index(r.label)},
            "units": [{"wall_s": x.wall_s, "engine_steps": x.engine_steps, "batched_forwards": x.batched_forwards,
                       "counters": x.counters, "records": [rec.to_json() for rec in x.records]}
                      for x in runs[r.label]],
            "summary": s, "memory": mem.get(r.label, {}),
        }
        # equality with the baseline, request by request in the same unit (T = 0 only)
        eq: dict[str, Any] = {"checked": False}
        if base_label is not None and r.label != base_label:
            if greedy:
                compared, mism = 0, []
                for ub, ux in zip(runs[base_label], runs[r.label]):
                    bmap = {rec.index: rec.output_sha for rec in ub.records if rec.ok}
                    for rec in ux.records:
                        if rec.ok and rec.index in bmap:
                            compared += 1
                            if rec.output_sha != bmap[rec.index]:
                                mism.append(rec.prompt_id)
                eq = {"checked": True, "compared": compared, "mismatches": len(mism), "mismatched_prompts": mism[:20],
                      "against": base_label}
            else:
                eq = {"checked": False, "reason": "temperature > 0: outputs are equal in distribution, not per seed"}
        line["equality"] = eq
        # speed relative to the baseline at this tier
        if base_label is not None and r.label != base_label:
            b = summaries[base_label]
            bt, xt = b.get("system_tokens_per_s"), s.get("system_tokens_per_s")
            line["speedup"] = xt / bt if bt and xt else None
            unit_ratios = [(x / y) if x and y else None for x, y in
                           zip(s["system_tokens_per_s_per_unit"], b["system_tokens_per_s_per_unit"])]
            line["speedup_spread"] = spread(unit_ratios)
            be = {(u, rec.index): rec.e2e / max(rec.output_tokens, 1)
                  for u, run in enumerate(runs[base_label]) for rec in run.records if rec.ok}
            per_req = [be[(u, rec.index)] / (rec.e2e / max(rec.output_tokens, 1))
                       for u, run in enumerate(runs[r.label]) for rec in run.records
                       if rec.ok and (u, rec.index) in be and rec.e2e]
            line["per_request_speedup"] = spread(per_req)
        else:
            line["speedup"] = 1.0 if r.label == base_label else None
            line["speedup_spread"] = None
            line["per_request_speedup"] = None
        void_reasons = []
        if r.kind != "peer" and eq.get("mismatches"):
            void_reasons.append(f"{eq['mismatches']} of {eq['compared']} greedy outputs differ from the baseline's")
        if s["errors"]:
            void_reasons.append(f"{s['errors']} of {s['requests']} requests failed")
        line["void"] = bool(void_reasons)
        line["void_reason"] = "; ".join(void_reasons) or None
        if r.kind == "peer":
            line["verdict"] = {"decision": "peer", "reason": "reference point (another toolkit)"}
        else:
            loads = [x[0] for x in (load0, load1) if x]
            row = {**s, "speedup": line["speedup"], "void": line["void"], "void_reason": line["void_reason"],
                   "concurrency": phase.concurrency, "loadavg": max(loads) if loads else None,
                   "cores": os.cpu_count()}
            line["verdict"] = verdict(row, summaries.get(base_label) if base_label else None,
                                      is_baseline=r.label == base_label)
        lines.append(line)
    parts = []
    for ln in lines:
        tps = ln["summary"]["system_tokens_per_s"]
        sp = ln["speedup"]
        parts.append(f"{ln['label']} {tps:.1f} tok/s" + (f" ({sp:.2f}×, {ln['verdict']['decision']})"
                                                          if sp is not None and ln['label'] != base_label else "")
                     if tps else f"{ln['label']} (no tokens)")
    log(f"bench: {phase.key} ({phase.arrival.label}) done: " + "; ".join(parts))
    return lines


# ---- the job --------------------------------------------------------------------------------------


def _default_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _config_json(cfg: BenchConfig) -> dict:
    d = asdict(cfg)
    d["out"] = str(cfg.out)
    d["arrival"] = cfg.arrival.label
    return d


def run_bench(config: BenchConfig, log: Callable[[str], None] | None = None) -> Path:
    """Run (or resume) the bench described by `config`; write the report; return report.json's path.

    report.md and the PNG plots are written next to it (see bench/report.py).
    """
    from tqdm import tqdm

    from draftsmith.bench import report as R

    cfg = config
    log = log or _default_log
    out = cfg.out
    results_path, setup_path = out / RESULTS, out / SETUP
    existing, _ = read_results(results_path)
    if (existing or setup_path.exists()) and not (cfg.resume or cfg.overwrite):
        raise DraftsmithError(f"{out} already holds bench results; pass --resume to continue them or "
                              "--overwrite to start again")
    if cfg.resume and not setup_path.exists():
        log(f"bench: nothing to resume in {out}; starting a new run")
    out.mkdir(parents=True, exist_ok=True)
    if cfg.overwrite:
        for name in (RESULTS, SETUP, *R.OUTPUT_FILES):
            (out / name).unlink(missing_ok=True)

    t_start, load_start = _now(), loadavg()
    backend = EndpointBackend(cfg, log) if cfg.endpoint_mode else InProcessBackend(cfg, log)
    wl = load_workload(cfg.workload, cfg.split, cfg.requests, backend.tokenize, backend.max_prompt_tokens)
    fp = cfg.fingerprint([p.id for p in wl.prompts], backend.weights_hash)
    fp_sha = _fingerprint_sha(fp)
    max_len = 0
    if not cfg.endpoint_mode:
        longest = max(len(p.token_ids) for p in wl.prompts)
        max_len = min(backend.model.config.max_position_embeddings, longest + cfg.max_tokens + backend.max_k + 2)

    invocation = {"started": t_start, "loadavg_start": load_start, "resumed": False, "phases_run": [],
                  "argv": list(sys.argv), "pid": os.getpid()}
    if setup_path.exists():
        setup = json.loads(setup_path.read_text())
        old = setup.get("fingerprint", {})
        if old != fp:
            diff = sorted(k for k in set(old) | set(fp) if old.get(k) != fp.get(k))
            raise DraftsmithError(f"--resume: {out} was measured with a different setup (differs in: "
                                  f"{', '.join(diff)}); use another --out or --overwrite")
        invocation["resumed"] = True
        setup["config"] = _config_json(cfg)  # the tier list (and report-only inputs) may differ
    else:
        setup = {
            "format_version": FORMAT_VERSION, "created": t_start, "fingerprint": fp, "fingerprint_sha": fp_sha,
            "config": _config_json(cfg), "versions": versions(), "machine": machine_info(),
            **backend.setup(),
            "workload": {"name": cfg.workload, "split": wl.split, "prompt_ids": [p.id for p in wl.prompts],
                         "unique_prompts": len(wl.prompts) - wl.reused, "reused_prompts": wl.reused,
                         "skipped_prompts": wl.skipped, "max_prompt_tokens": backend.max_prompt_tokens,
                         "engine_max_len": max_len or None,
                         "prompt_sources": sorted({p.source for p in wl.prompts})},
            "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens,
                         "seed": cfg.seed, "per_request_seed": "seed * 1000003 + request index"},
            "arrival": cfg.arrival.label, "warmup": cfg.warmup, "repeats": cfg.repeats,
            "invocations": [],
        }
    setup["invocations"].append(invocation)
    _atomic_write(setup_path, json.dumps(setup, indent=2))

    # keep complete tiers only (a tier cut short is measured again, all its configurations together)
    phases = plan_phases(cfg)
    lines, good = read_results(results_path)
    expected = {}
    for ph in phases:
        labels = list(cfg.config_labels)
        if ph.with_peers:
            from draftsmith.bench.peers import HF_ASSISTANT, HF_GENERATE, HF_LOOKUP

            labels += [HF_GENERATE, HF_LOOKUP] + ([HF_ASSISTANT] if cfg.peer_assistant else [])
        expected[ph.key] = set(labels)
    by_phase: dict[str, dict[str, dict]] = {}
    for ln in lines:
        by_phase.setdefault(ln["phase"], {})[ln["label"]] = ln
    done = {k for k, v in by_phase.items() if k in expected and set(v) >= expected[k]}
    keep = [ln for ln in lines if ln["phase"] in done or ln["phase"] not in expected]
    if len(keep) != len(lines) or (results_path.exists() and good != results_path.stat().st_size):
        _atomic_write(results_path, "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in keep))
    todo = [ph for ph in phases if ph.key not in done]
    if done:
        log(f"bench: resuming; {len(done)} finished tier(s) kept: {', '.join(sorted(done))}")

    def n_configs(ph: Phase) -> int:
        return len(expected[ph.key])

    total = sum(n_configs(ph) * (cfg.requests * cfg.repeats + cfg.warmup) for ph in todo)
    bar = tqdm(total=total, desc="bench", unit="req", file=sys.stderr, dynamic_ncols=True,
               disable=(not sys.stderr.isatty()) if cfg.progress is None else not cfg.progress)
    try:
        for ph in todo:
            new = run_phase(backend, cfg, ph, wl, max_len, bar, fp_sha, log)
            _append_lines(results_path, new)
            invocation["phases_run"].append(ph.key)
            _atomic_write(setup_path, json.dumps(setup, indent=2))
    finally:
        bar.close()
    invocation["finished"] = _now()
    invocation["loadavg_end"] = loadavg()
    _atomic_write(setup_path, json.dumps(setup, indent=2))
    lines, _ = read_results(results_path)
    wanted = {ph.key for ph in phases}
    lines = [ln for ln in lines if ln["phase"] in wanted]
    return R.write_report(out, setup, lines, cfg, weights_bytes=getattr(backend, "weights_bytes", None),
                          bandwidth_gbs=_bandwidth(cfg, backend))


def _bandwidth(cfg: BenchConfig, backend) -> float | None:
    if cfg.mem_bandwidth_gbs is not None:
        return cfg.mem_bandwidth_gbs
    if cfg.endpoint_mode:
        return None
    # measured here, after the timed phases (docs/MEASURING.md #8): a fixed default went stale
    # (15 GB/s assumed where 40-77 were measured, so fraction_of_bound read ~3x too high)
    return round(measure_bandwidth(backend.model.device), 1)
