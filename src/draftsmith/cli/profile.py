"""`draftsmith profile`: what verification costs on this hardware (and the SPS(B) table)."""

from __future__ import annotations

import json

from draftsmith.cli.options import add_job, add_target_args, int_in, positive_int
from draftsmith.engine.speculative_config import MAX_SPECULATIVE_TOKENS
from draftsmith.errors import DraftsmithError

HELP = ("what a target forward of 1..64 tokens costs here, against the memory-bandwidth floor; "
        "stores the SPS(B) table the prefix scheduler uses")
EXAMPLE = "draftsmith profile --dtype bfloat16 --json"


def add_parser(sub) -> None:
    p = add_job(sub, "profile", HELP, EXAMPLE)
    add_target_args(p)
    p.add_argument("--max-batch", type=positive_int, default=8, help="rows of the SPS(B) table (as generate / serve)")
    p.add_argument("--num-speculative-tokens", "-k", type=int_in(1, MAX_SPECULATIVE_TOKENS), default=7, metavar="K",
                   help="longest verify block of the SPS(B) table (max-batch x (k + 1) tokens)")
    p.add_argument("--context-len", type=int, default=256,
                   help="cached tokens per row while timing (256: what the prefix scheduler profiles with, so "
                        "the table stored here is the one it reads)")
    p.add_argument("--repeats", type=positive_int, default=7, help="timed forwards per point (median)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    from draftsmith.models.loading import read_config
    from draftsmith.models.registry import resolve_target
    from draftsmith.models.target import load_target
    from draftsmith.policy.profile import ProfileConfig, load_or_profile
    from draftsmith.policy.roofline import runtime_profile

    if args.context_len < 0:
        raise DraftsmithError(f"--context-len must be >= 0, got {args.context_len}")
    # the forwards timed after the context: runtime_profile's up to 64 tokens, the table's up to k + 1
    widest = max(64, args.num_speculative_tokens + 1)
    ctx = read_config(resolve_target(args.target)[1]).max_position_embeddings
    if args.context_len + widest + 1 > ctx:  # (past it: positions the target never saw, minutes of attention)
        raise DraftsmithError(f"--context-len {args.context_len} leaves no room in the target's {ctx}-token context "
                              f"for the timed forwards (up to {widest} tokens after it); give at most "
                              f"{max(0, ctx - widest - 1)}")
    target = load_target(args.target, device=args.device, dtype=args.dtype, threads=args.threads)
    doc = {"target": target.target_id, **runtime_profile(target.model, context_len=args.context_len,
                                                          repeats=args.repeats)}
    cfg = ProfileConfig(max_batch=args.max_batch, max_k=args.num_speculative_tokens,
                        repeats=args.repeats, context_len=args.context_len)
    sps = load_or_profile(target.model, weights_hash=target.weights_hash, name=target.target_id,
                          config=cfg, refresh=True)
    doc["sps"] = sps.to_dict()
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"{doc['target']} on {doc['device']} ({doc['dtype']}, {doc['threads']} threads, "
          f"{doc['linear_backend']} linears): {doc['weight_bytes'] / 1e6:.0f} MB of weights per step, "
          f"read bandwidth {doc['bandwidth_gbs']:.1f} GB/s -> floor {doc['floor_ms']:.2f} ms/token")
    if "cpu_kernels" in doc:
        print(f"Draftsmith CPU kernels: {doc['cpu_kernels']}")
    print(f"decode {doc['decode_ms']:.2f} ms/token = {doc['decode_over_floor']:.2f}x the floor")
    print("tokens per forward  " + " ".join(f"{t:>6d}" for t in doc["tokens"]))
    print("step ms             " + " ".join(f"{t:6.2f}" for t in doc["step_ms"]))
    print("in decode steps     " + " ".join(f"{t:6.2f}" for t in doc["verify_in_decode_steps"]))
    return 0
