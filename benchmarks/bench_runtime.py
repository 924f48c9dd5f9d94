"""Runtime benchmark (issue 11): what a target forward costs, before and after the linear-backend
change, in float32 and bfloat16, at 1 and 2 threads; and the OpenMP wait policy idle vs loaded.

Side by side in one process (docs/MEASURING.md): the "mkl" backend (the first path: fused [in, out]
weights through torch.matmul), "onednn" (weights prepacked once for oneDNN) and "kernels" (Draftsmith's
own few-row kernel, kernels/gemv.cpp, for the CPU's AVX-512 or AVX2; the default where it builds) are
loaded together and measured
interleaved, round by round; each number is the median over rounds of a
per-round median. Per configuration:
  - decode ms/token at batch 1 (one forward of one token after 200 cached, its argmax included: the engine's greedy round)
    and its ratio to the floor = weight bytes / read bandwidth (a torch `sum` over 256 MB, measured
    in the same run at the same thread count);
  - verify(K) = one forward of K tokens on one row, in decode steps, K = 2, 4, 8, 16;
  - steps/s at B = 1..64 rows of one token (decode batches, as a serving engine runs them).
Wait policy: child processes with each OpenMP setting (set before torch loads OpenMP) time
the default backend's fp32 decode at 2 threads: alone, beside N busy processes, and two decoding at once.

Writes benchmarks/results/runtime.json and the "Runtime" section of BENCHMARKS.md (on a CPU whose kernels
are built for AVX2: runtime-avx2.json and its own section, so both kinds of machine stay on record).

    .venv/bin/python benchmarks/bench_runtime.py [--rounds 3] [--repeats 5] [--load 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import torch

from draftsmith.kernels.build import cpu_kernels
from draftsmith.models.loading import load_decoder
from draftsmith.models.registry import resolve_target
from draftsmith.policy.roofline import measure_bandwidth, step_time, weight_bytes
from sections import cpu_kind, write_section

HERE = Path(__file__).resolve().parent
VERIFY = (2, 4, 8, 16)
ROWS = (1, 2, 4, 8, 16, 32, 64)
# (linear backend, dtype, variant): variant "auto" = the defaults, "unfused" = the "kernels" path with
# RoPE, SwiGLU and add + norm as torch's ops (Decoder.set_fused_ops_(False): the path before them),
# "per-op" = the fused ops called one by one from Python (no one-call layer: the path before it)
CONFIGS = [("mkl", "float32", "auto"), ("onednn", "float32", "auto"), ("kernels", "float32", "unfused"),
           ("kernels", "float32", "per-op"), ("kernels", "float32", "auto"), ("onednn", "bfloat16", "auto"),
           ("kernels", "bfloat16", "unfused"), ("kernels", "bfloat16", "per-op"), ("kernels", "bfloat16", "auto")]


def child_decode(repeats: int) -> None:
    """Print the median decode seconds of the default target (default backend, fp32, 2 threads)."""
    torch.set_num_threads(2)
    _, path = resolve_target("smollm2-135m")
    m = load_decoder(path, linear_backend="auto")
    t = [step_time(m, 1, 1, repeats=repeats) for _ in range(3)]
    print(json.dumps({"decode_s": statistics.median(t), "wait_policy": os.environ.get("OMP_WAIT_POLICY")}))


# OpenMP settings compared (libgomp, torch's OpenMP runtime): its default (spin ~300k iterations,
# then sleep), spin forever, sleep at once, and short spins.
WAIT_POLICIES = {
    "default (unset)": {},
    "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "GOMP_SPINCOUNT=3000 (draftsmith's default)": {"GOMP_SPINCOUNT": "3000"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
}


def _child(extra: dict, repeats: int) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.Popen([sys.executable, __file__, "--child-decode", "--repeats", str(repeats)],
                            env={**base, **extra}, stdout=subprocess.PIPE, text=True)


def _decode_s(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode:
        raise SystemExit(f"child decode failed with exit code {proc.returncode}")
    return json.loads(out.splitlines()[-1])["decode_s"]


def wait_policy(rounds: int, load: int, repeats: int) -> dict:
    """Per policy: decode alone ("idle"), beside `load` busy Python loops ("busy"), and two
    decoding processes at once ("pair", their mean)."""
    res: dict[str, list[float]] = {}
    spin = "import time\nt=time.time()\nwhile time.time()-t<600: pass"
    for _ in range(rounds):
        for name, extra in WAIT_POLICIES.items():
            res.setdefault(f"{name} idle", []).append(_decode_s(_child(extra, repeats)))
            pair = [_child(extra, repeats) for _ in range(2)]
            res.setdefault(f"{name} pair", []).append(statistics.mean(_decode_s(p) for p in pair))
            hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(load)]
            try:
                res.setdefault(f"{name} busy", []).append(_decode_s(_child(extra, repeats)))
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
    return {k: 1e3 * statistics.median(v) for k, v in res.items()}


def available_configs() -> list[tuple[str, str, str]]:
    """CONFIGS this machine runs: "kernels" where they build, bfloat16 on oneDNN where it takes it."""
    from draftsmith.models.linear import onednn_bf16

    st = cpu_kernels()
    return [c for c in CONFIGS if (c[0] != "kernels" or st.ok) and (c[1] != "bfloat16" or
            (st.bf16 if c[0] == "kernels" else onednn_bf16() if c[0] == "onednn" else True))]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(c: tuple[str, str, str]) -> str:
    """backend/dtype, plus /variant when it is not the default."""
    return "/".join(c if c[2] != "auto" else c[:2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--load", type=int, default=2, help="busy processes for the loaded wait-policy runs")
    ap.add_argument("--child-decode", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md and results/runtime.json alone")
    ap.add_argument("--wait-policy-only", action="store_true", help="only the OpenMP wait-policy runs")
    ap.add_argument("--keep-wait-policy", action="store_true",
                    help="reuse the wait-policy table of the last written run (results/runtime.json), labelled as such")
    args = ap.parse_args()
    if args.child_decode:
        return child_decode(args.repeats)

    if args.wait_policy_only:
        for k, v in wait_policy(max(1, args.rounds - 1), args.load, args.repeats).items():
            print(f"{k}: {v:.1f} ms")
        return
    _, path = resolve_target("smollm2-135m")
    models = {c: load_decoder(path, dtype=getattr(torch, c[1]), linear_backend=c[0]) for c in available_configs()}
    for (_, _, variant), m in models.items():
        if variant in ("unfused", "per-op"):
            m.set_fused_ops_(variant == "per-op", one_call_layers=False)
    result: dict = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "kernels": cpu_kernels().isa or None,
                                "torch": torch.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
                    "weight_bytes": {c[1]: weight_bytes(m) for c, m in models.items()}, "threads": {}}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        bw: list[float] = []
        raw: dict = {_key(c): {"decode": [], "verify": {k: [] for k in VERIFY}, "ratio": {k: [] for k in VERIFY},
                               "rows": {r: [] for r in ROWS}} for c in models}
        for rnd in range(args.rounds):
            bw.append(measure_bandwidth("cpu"))
            for c, m in models.items():
                r = raw[_key(c)]
                r["decode"].append(step_time(m, 1, 1, repeats=args.repeats))
                for k in VERIFY:  # each verify paired with a decode measured just before it
                    d, v = step_time(m, 1, 1, repeats=args.repeats), step_time(m, 1, k, repeats=args.repeats)
                    r["verify"][k].append(v)
                    r["ratio"][k].append(v / d)
                for n in ROWS:
                    r["rows"][n].append(step_time(m, n, 1, repeats=args.repeats))
                print(f"threads {threads} round {rnd + 1}: {_key(c)} decode {1e3 * r['decode'][-1]:.1f} ms", flush=True)
        gbs = statistics.median(bw)
        out = {"bandwidth_gbs": gbs, "configs": {}}
        for key, r in raw.items():
            dec = statistics.median(r["decode"])
            floor = result["weight_bytes"][key.split("/")[1]] / (gbs * 1e9)
            out["configs"][key] = {
                "decode_ms": 1e3 * dec, "floor_ms": 1e3 * floor, "over_floor": dec / floor,
                "verify_ms": {k: 1e3 * statistics.median(v) for k, v in r["verify"].items()},
                # median of paired ratios: the machine's drift between measurements cancels
                "verify_steps": {k: statistics.median(v) for k, v in r["ratio"].items()},
                "steps_per_s": {n: 1 / statistics.median(v) for n, v in r["rows"].items()},
                "raw_s": {"decode": r["decode"], "verify": r["verify"]},
            }
        result["threads"][threads] = out
    result["date"] = time.strftime("%Y-%m-%d")
    # one section and one JSON per kind of CPU kernel, so an AVX2 machine's run keeps the AVX-512 one
    # (AVX-512 with AMX: its own too; the bfloat16 linears run on another unit)
    tag, _ = cpu_kind()
    previous = HERE / "results" / f"runtime{tag}.json"
    if args.keep_wait_policy and previous.is_file() and "wait_policy_ms" in (old := json.loads(previous.read_text())):
        result["wait_policy_ms"] = old["wait_policy_ms"]
        result["wait_policy_from"] = old.get("wait_policy_from") or f"the run of {old.get('date', 'an earlier day')}"
    else:
        result["wait_policy_ms"] = wait_policy(max(1, args.rounds - 1), args.load, args.repeats)
    md = render(result, args)
    print(md)
    if not args.no_write:
        (HERE / "results").mkdir(exist_ok=True)
        previous.write_text(json.dumps(result, indent=1))
        marker = f"runtime{tag.replace('-', ':')}"
        write_section(f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->", md)


def render(res: dict, args) -> str:
    lines = [
        "## Runtime: what a target forward costs (issue 11)" + cpu_kind()[1],
        "",
        f"`benchmarks/bench_runtime.py --rounds {args.rounds} --repeats {args.repeats}` on {time.strftime('%Y-%m-%d')}, "
        f"smollm2-135m, {res['machine']['cpu']} ({res['machine']['cores']} cores; Draftsmith's kernels built for "
        f"{res['machine'].get('kernels') or 'none: they did not build'}), torch {res['machine']['torch']}, idle machine. "
        "\"mkl\" is the first path (fused weights through torch.matmul), \"onednn\" the weights prepacked "
        "once for oneDNN (the default until 2026-12-01), \"kernels\" Draftsmith's own few-row kernel "
        "(kernels/gemv.cpp, compiled once per machine; the default where it builds); \"kernels/…/unfused\" "
        "the same with RoPE, SwiGLU and the residual add + norm as torch's ops (the path before the fused kernels), "
        "\"kernels/…/per-op\" with the fused kernels called one by one from Python (the path before a layer's step "
        "became one kernel call). "
        "Interleaved in one process, medians over rounds; verify(K) in decode steps = the median of per-round "
        "ratios, each verify timed right after a decode step of its own. Floor = weight "
        "bytes read per step / read bandwidth measured in the same run at the same thread count.",
        "",
    ]
    for threads, out in res["threads"].items():
        lines += [f"### {threads} thread(s): read bandwidth {out['bandwidth_gbs']:.1f} GB/s", "",
                  "| backend / dtype | decode ms/token | floor ms | × floor | verify(2) | verify(4) | verify(8) | verify(16) |",
                  "|---|---|---|---|---|---|---|---|"]
        for key, c in out["configs"].items():
            v = c["verify_steps"]
            lines.append(f"| {key} | {c['decode_ms']:.1f} | {c['floor_ms']:.1f} | {c['over_floor']:.2f} | "
                         + " | ".join(f"{v[k]:.2f}" for k in VERIFY) + " |")
        lines += ["", "Steps/s at B rows of one token (decode batches):", "",
                  "| backend / dtype | " + " | ".join(f"B={n}" for n in ROWS) + " |",
                  "|---|" + "---|" * len(ROWS)]
        for key, c in out["configs"].items():
            lines.append(f"| {key} | " + " | ".join(f"{c['steps_per_s'][n]:.1f}" for n in ROWS) + " |")
        lines.append("")
    w = res["wait_policy_ms"]
    when = f" (from {res['wait_policy_from']}, not rerun)" if res.get("wait_policy_from") else ""
    lines += [f"OpenMP wait policy{when}, default-backend fp32 decode at 2 threads, ms/token (child processes): alone; "
              f"beside {args.load} busy Python loops; two decoding processes at once (their mean).", "",
              "| policy | alone | busy machine | two processes |", "|---|---|---|---|"]
    for pol in WAIT_POLICIES:
        lines.append(f"| {pol} | {w[pol + ' idle']:.1f} | {w[pol + ' busy']:.1f} | {w[pol + ' pair']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
