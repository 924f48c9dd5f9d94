"""Two builds of the CPU attention kernel side by side in one process (issue 11).

    .venv/bin/python benchmarks/ab_attention.py --base REV [--threads 2] [--dtypes float32,bfloat16]
        [--tokens 1,8,16] [--context 300,800] [--rounds 9] [--heads 9,3] [--head-dim 64]

kernels/gemv.cpp at git revision REV ("base") and in the working tree ("tree") are compiled under
their own op namespaces (as benchmarks/ab_linears.py does) and loaded into one process. Shapes are
smollm2-135m's by default: 9 query heads, 3 kv heads of 64 (--heads 12,2 --head-dim 128:
Qwen2.5-Coder-1.5B's), a step of S tokens attending causally over a cache
of C earlier tokens, 30 layers with their own caches (what one target forward reads). Each number
is the median over rounds (the first dropped) of one pass over the 30 layers, in microseconds a
layer; the builds alternate which goes first. Every output of the two builds is compared bit for bit.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_linears import compile_as  # noqa: E402

LAYERS = 30


def one_pass(op, q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    for k, v in zip(ks, vs):
        out = op.attention(q, k, v, None, True, q.shape[-1] ** -0.5)
    return 1e6 * (time.perf_counter() - t0) / len(ks), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of kernels/gemv.cpp to compare with the working tree")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", default="1,8,16", help="tokens of the step (S)")
    ap.add_argument("--context", default="300,800", help="cached tokens before the step (C)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--heads", default="9,3", help="query heads, kv heads")
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    if not build.cpu_kernels().ok:
        sys.exit(f"the CPU kernels do not run here: {build.cpu_kernels().reason}")
    if a.rounds < 2:
        sys.exit("--rounds must be at least 2 (the first is dropped)")
    try:
        heads, kv_heads = (int(h) for h in a.heads.split(","))
    except ValueError:
        sys.exit(f"--heads wants two numbers, query heads and kv heads (e.g. 9,3), got {a.heads!r}")
    head_dim = a.head_dim
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        sys.exit(f"--heads {a.heads}: the query heads must be a positive multiple of the kv heads")
    if head_dim < 16 or head_dim % 16 or not (head_dim <= 128 or head_dim in (192, 256)):
        sys.exit(f"--head-dim {head_dim}: the step attention kernel takes 16, 32, ..., 128, 192 or 256")
    rel = build.SOURCE.relative_to(Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()))
    try:
        base_text = subprocess.check_output(["git", "show", f"{a.base}:{rel}"], text=True, stderr=subprocess.PIPE)
    except subprocess.CalledProcessError as e:
        sys.exit(f"no {rel} at revision {a.base!r}: {e.stderr.strip()}")
    with tempfile.TemporaryDirectory() as tmp:
        print(f"compiling kernels/gemv.cpp at {a.base} and in the working tree ...", file=sys.stderr)
        compile_as(base_text, "ds_abat_base", Path(tmp))
        compile_as(build.SOURCE.read_text(), "ds_abat_tree", Path(tmp))
        ops = {"base": torch.ops.ds_abat_base, "tree": torch.ops.ds_abat_tree}
        g = torch.Generator().manual_seed(0)
        contexts = [int(c) for c in a.context.split(",")]
        tokens = [int(s) for s in a.tokens.split(",")]
        print("| threads | dtype | cached | tokens | base us/layer | tree us/layer | tree / base | outputs |")
        print("|---|---|---|---|---|---|---|---|")
        for dtype_name in a.dtypes.split(","):
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
            cap = max(contexts) + max(tokens)
            kc = [torch.randn(1, kv_heads, cap, head_dim, generator=g).to(dtype) for _ in range(LAYERS)]
            vc = [torch.randn(1, kv_heads, cap, head_dim, generator=g).to(dtype) for _ in range(LAYERS)]
            for threads in (int(t) for t in a.threads.split(",")):
                torch.set_num_threads(threads)
                for C in contexts:
                    for S in tokens:
                        ks = [k.narrow(2, 0, C + S) for k in kc]  # the cache rows a step reads: a view, as in the model
                        vs = [v.narrow(2, 0, C + S) for v in vc]
                        q = torch.randn(1, S, heads, head_dim, generator=g).to(dtype).transpose(1, 2)
                        times: dict[str, list[float]] = {"base": [], "tree": []}
                        outs: dict[str, torch.Tensor] = {}
                        for rnd in range(a.rounds):
                            for name in (("base", "tree") if rnd % 2 else ("tree", "base")):
                                t, outs[name] = one_pass(ops[name], q, ks, vs)
                                times[name].append(t)
                        b, t = (statistics.median(times[n][1:]) for n in ("base", "tree"))
                        same = "bit-identical" if torch.equal(outs["base"], outs["tree"]) else "DIFFERENT"
                        print(f"| {threads} | {dtype_name} | {C} | {S} | {b:.1f} | {t:.1f} | {t / b:.2f} | {same} |",
                              flush=True)


if __name__ == "__main__":
    main()
