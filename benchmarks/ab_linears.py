"""Two builds of the CPU kernels side by side in one process: the target's linears (issue 11).

    .venv/bin/python benchmarks/ab_linears.py --base REV [--threads 1,2] [--dtypes float32,bfloat16]
        [--rows 1,2,4,8,16,32] [--rounds 7]

kernels/gemv.cpp at git revision REV ("base") and in the working tree ("tree") are compiled with
the flags kernels/build.py uses, each under its own op namespace, and loaded into one process. On
weights of smollm2-135m's linear shapes (30 layers of q/k/v, o, gate/up and down, distinct weights,
plus the 49,152 x 576 lm_head: the bytes one decode step streams), each build packing its own copy once
(its layout and its memory are part of the build), both builds run
every rows count, alternating which goes first round by round; each number is the median over
rounds (the first dropped) of one pass over all the linears, and "x one row" is that build's time
over its own one-row time. Both builds' outputs are compared bit for bit on the lm_head.
Machine drift between processes cancels; drift within the run hits both builds alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import torch

from draftsmith.kernels import build

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # [out, in]


def compile_as(source_text: str, namespace: str, work: Path) -> None:
    """Compile gemv.cpp's text with its ops registered under `namespace`, and load it."""
    src = work / f"{namespace}.cpp"
    src.write_text(source_text.replace("TORCH_LIBRARY(draftsmith, m)", f"TORCH_LIBRARY({namespace}, m)"))
    lib = work / f"{namespace}.so"
    cmd = build._command("g++", lib)
    cmd[cmd.index(str(build.SOURCE))] = str(src)
    cmd.insert(1, f"-I{build.SOURCE.parent}")  # simd.h
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"compiling the {namespace} build failed:\n{done.stderr[-2000:]}")
    torch.ops.load_library(str(lib))


def one_pass(op, packed: list[torch.Tensor], xs: dict[int, torch.Tensor], bf16: bool) -> float:
    t0 = time.perf_counter()
    for (n, k), w in zip(SHAPES, packed):
        if bf16:
            op.gemv_bf16(xs[k], w, n, k, None)
        else:
            op.gemv_f32(xs[k], w, n, None)
    return 1e3 * (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of kernels/gemv.cpp to compare with the working tree")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    if not build.cpu_kernels().ok:
        sys.exit(f"the CPU kernels do not run here: {build.cpu_kernels().reason}")
    rel = build.SOURCE.relative_to(Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()))
    try:
        base_text = subprocess.check_output(["git", "show", f"{a.base}:{rel}"], text=True, stderr=subprocess.PIPE)
    except subprocess.CalledProcessError as e:
        sys.exit(f"no {rel} at revision {a.base!r}: {e.stderr.strip()}")
    builds = {"base": "ds_ab_base", "tree": "ds_ab_tree"}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"compiling kernels/gemv.cpp at {a.base} and in the working tree ...", file=sys.stderr)
        compile_as(base_text, builds["base"], Path(tmp))
        compile_as(build.SOURCE.read_text(), builds["tree"], Path(tmp))
        ops = {name: getattr(torch.ops, ns) for name, ns in builds.items()}
        rows = [int(r) for r in a.rows.split(",")]
        g = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES]
        print(f"| threads | dtype | rows | base ms | tree ms | tree / base | base x one row | tree x one row |")
        print("|---|---|---|---|---|---|---|---|")
        for dtype in a.dtypes.split(","):
            bf16 = dtype == "bfloat16"
            if bf16 and not build.cpu_kernels().bf16:
                print(f"(bfloat16 skipped: this build has no bfloat16 linear kernel)", file=sys.stderr)
                continue
            # each build packs its own weights (the packing is part of a build: its layout, its memory)
            packed = {name: [op.pack_bf16(w.bfloat16()) if bf16 else op.pack_f32(w) for w in weights]
                      for name, op in ops.items()}
            for threads in (int(t) for t in a.threads.split(",")):
                torch.set_num_threads(threads)
                times: dict[tuple[str, int], list[float]] = {}
                for rnd in range(a.rounds):
                    for m in rows:
                        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
                              for k in (576, 1536)}
                        for name in (("base", "tree") if rnd % 2 else ("tree", "base")):
                            times.setdefault((name, m), []).append(one_pass(ops[name], packed[name], xs, bf16))
                med = {key: statistics.median(v[1:] if len(v) > 1 else v) for key, v in times.items()}
                for m in rows:
                    b, t = med[("base", m)], med[("tree", m)]
                    print(f"| {threads} | {dtype} | {m} | {b:.1f} | {t:.1f} | {t / b:.2f} | "
                          f"{b / med[('base', rows[0])]:.2f} | {t / med[('tree', rows[0])]:.2f} |", flush=True)
            x = torch.randn(8, 576, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
            outs = [ops[n].gemv_bf16(x, packed[n][-1], 49152, 576, None) if bf16
                    else ops[n].gemv_f32(x, packed[n][-1], 49152, None) for n in ("base", "tree")]
            del packed
            print(f"({dtype}: the two builds' lm_head outputs for 8 rows are "
                  f"{'bit-identical' if torch.equal(*outs) else 'DIFFERENT'})", file=sys.stderr)


if __name__ == "__main__":
    main()
