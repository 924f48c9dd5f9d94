"""Multi-turn chat with the built-in DSpark drafter: prefix caching on vs off (issues 11, 12).

    .venv/bin/python benchmarks/bench_prefix_drafter.py [--conversations 8] [--max-tokens 128]
        [--drafter dspark:smollm2-135m] [--dtype float32] [--no-write]

Held-out MT-Bench conversations (two user turns each) at batch 1, greedy, the default policy:
turn 1 answers the first question, turn 2's prompt is the chat template over [question 1, the
answer, question 2]. Four configurations, each its own engine over one loaded target:

- plain decoding, prefix caching off and on;
- the drafter, prefix caching off (before this change, the only way to run a feature-fed drafter)
  and on (its rows keep the drafter's context with the KV: drafters/feature_queue.py).

One process; every conversation runs through all four in an order that rotates from one
conversation to the next, so drift on a shared VM touches them alike. Per configuration: turn 2's
time to first token (its prefill), the prompt tokens prefilled, each turn's decode tokens/s, the
conversation's wall time and output tokens per second (both turns, prefill included), τ; × plain =
that rate ÷ plain decoding's without prefix caching, per conversation. The outputs of the two
drafter configurations are compared with plain decoding's under the same prefix-caching setting.
Writes its section of BENCHMARKS.md (per CPU kind) and benchmarks/results/bench_prefix_drafter[-kind].json.
Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import sections

import draftsmith  # noqa: F401  (OpenMP settings before torch)
import torch

from draftsmith import LLM, SamplingParams
from draftsmith.data.sources import MTBenchSource
from draftsmith.models.target import load_target

ROOT = Path(__file__).resolve().parents[1]


def conversations(n: int) -> list[tuple[str, str, str]]:
    out = []
    for c in MTBenchSource().conversations():
        users = [m["content"] for m in c.messages if m["role"] == "user"]
        if c.split == "heldout" and len(users) >= 2:
            out.append((c.id, users[0], users[1]))
        if len(out) == n:
            break
    return out


def run_turn(llm: LLM, ids: list[int], params: SamplingParams) -> dict:
    eng = llm.engine
    s = eng.add_request(ids, params)
    t0 = time.perf_counter()
    while not s.finished:
        eng.step()
    t1 = time.perf_counter()
    first = s.stats.t_first_token if s.stats.t_first_token is not None else t1
    decode_tokens = max(0, len(s.output_ids) - 1)
    return {"ttft_s": first - t0, "wall_s": t1 - t0, "decode_s": t1 - first, "decode_tokens": decode_tokens,
            "prompt_tokens": len(ids), "cached_tokens": int(s.stats.cached_tokens), "rounds": s.stats.rounds,
            "committed": s.stats.committed, "text": llm.engine.decode(s.output_ids), "ids": list(s.output_ids)}


def run_conversation(llm: LLM, q1: str, q2: str, params: SamplingParams) -> list[dict]:
    m1 = [{"role": "user", "content": q1}]
    t1 = run_turn(llm, llm.apply_chat_template(m1), params)
    m2 = m1 + [{"role": "assistant", "content": t1["text"]}, {"role": "user", "content": q2}]
    t2 = run_turn(llm, llm.apply_chat_template(m2), params)
    return [t1, t2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="dspark:smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    target = load_target("smollm2-135m", dtype=args.dtype)
    configs = {
        "plain": LLM(target, max_batch=1, enable_prefix_caching=False),
        "plain + prefix caching": LLM(target, max_batch=1, enable_prefix_caching=True),
        f"{args.drafter}": LLM(target, drafter=args.drafter, max_batch=1, enable_prefix_caching=False),
        f"{args.drafter} + prefix caching": LLM(target, drafter=args.drafter, max_batch=1, enable_prefix_caching=True),
    }
    assert configs[f"{args.drafter} + prefix caching"].engine.prefix_caching, "the drafter refused prefix caching"
    names = list(configs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    convs = conversations(args.conversations)
    warm = conversations(args.conversations + 1)[-1]
    for llm in configs.values():  # first-call costs and the scheduler's profile out of the timings
        run_conversation(llm, warm[1][:200], warm[2][:200], SamplingParams(max_tokens=16, temperature=0.0))
    t_start = time.time()
    load0 = _load()
    results: dict[str, list[list[dict]]] = {n: [] for n in names}
    for i, (cid, q1, q2) in enumerate(convs):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            results[name].append(run_conversation(configs[name], q1, q2, params))
        print(cid, {n: round(sum(t["wall_s"] for t in results[n][-1]), 2) for n in names}, flush=True)
    load1 = _load()

    def med(name: str, turn: int, key: str) -> float:
        return statistics.median(c[turn][key] for c in results[name])

    base = names[0]
    rows = []
    for name in names:
        conv_wall = [sum(t["wall_s"] for t in c) for c in results[name]]
        ratio = [_tps(c) / _tps(b) for b, c in zip(results[base], results[name])]
        decode_rate = [[t["decode_tokens"] / t["decode_s"] for t in c if t["decode_s"] > 0] for c in results[name]]
        committed = sum(t["committed"] for c in results[name] for t in c)
        rounds = sum(t["rounds"] for c in results[name] for t in c)
        same_as = "plain + prefix caching" if "prefix caching" in name else "plain"
        equal = sum(c[k]["ids"] == r[k]["ids"] for c, r in zip(results[name], results[same_as]) for k in (0, 1))
        equal_s = "–" if name.startswith("plain") else f"{equal}/{2 * len(convs)} vs {same_as}"
        rows.append({
            "config": name,
            "turn2_ttft_ms": 1e3 * med(name, 1, "ttft_s"),
            "turn2_prefilled": statistics.median(t[1]["prompt_tokens"] - t[1]["cached_tokens"] for t in results[name]),
            "turn2_prompt": statistics.median(t[1]["prompt_tokens"] for t in results[name]),
            "turn1_decode_tps": statistics.median(r[0] for r in decode_rate),
            "turn2_decode_tps": statistics.median(r[1] for r in decode_rate),
            "conversation_s": statistics.median(conv_wall),
            "speedup": statistics.median(ratio), "speedup_min": min(ratio), "speedup_max": max(ratio),
            "tau": committed / rounds if rounds else None,
            "outputs_equal": equal_s,
        })
    tag, title = sections.cpu_kind()
    result = {"conversations": [c[0] for c in convs], "max_tokens": args.max_tokens, "drafter": args.drafter,
              "dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows,
              "load_average": [load0, load1], "wall_s": round(time.time() - t_start),
              "per_conversation": {n: [[{k: v for k, v in t.items() if k not in ("text", "ids")} for t in c]
                                       for c in rs] for n, rs in results.items()}}
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / f"benchmarks/results/bench_prefix_drafter{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows, indent=1))
    if args.no_write:
        return
    lines = [f"## Multi-turn chat with the built-in drafter: prefix caching on vs off (issues 11, 12){title}", "",
             f"`benchmarks/bench_prefix_drafter.py` (JSON: `benchmarks/results/bench_prefix_drafter{tag}.json`): "
             f"{len(convs)} held-out MT-Bench conversations, two user turns each (turn 2's prompt = the chat template "
             f"over question 1, the answer, question 2), batch 1, greedy, {args.max_tokens} new tokens per turn, "
             f"{args.dtype} target at {result['threads']} threads, the default policy. One process, one loaded target, "
             f"four engines; each conversation runs through all four in a rotating order. Medians over conversations; "
             f"× plain = the conversation's output tokens/s (both turns, prefill included) ÷ plain's, per conversation "
             f"(min–max). Load "
             f"average {load0:.2f} at the start, {load1:.2f} at the end; {result['wall_s']} s in all.", "",
             "| configuration | turn 2 prompt tokens | prefilled | turn 2 TTFT ms | decode tok/s turn 1 / 2 | "
             "conversation s | × plain | τ | outputs equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = "–" if r["tau"] is None or "plain" in r["config"] else f"{r['tau']:.2f}"
        lines.append(f"| {r['config']} | {r['turn2_prompt']:.0f} | {r['turn2_prefilled']:.0f} | "
                     f"{r['turn2_ttft_ms']:.0f} | {r['turn1_decode_tps']:.1f} / {r['turn2_decode_tps']:.1f} | "
                     f"{r['conversation_s']:.2f} | {r['speedup']:.2f} ({r['speedup_min']:.2f}–{r['speedup_max']:.2f}) | "
                     f"{tau} | {r['outputs_equal']} |")
    begin, end = f"<!-- bench_prefix_drafter{tag}:begin -->", f"<!-- bench_prefix_drafter{tag}:end -->"
    sections.write_section(begin, end, "\n".join(lines))


def _tps(conv: list[dict]) -> float:
    """A conversation's output tokens per second of wall time (both turns, prefill included)."""
    return sum(t["decode_tokens"] + 1 for t in conv) / sum(t["wall_s"] for t in conv)


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


if __name__ == "__main__":
    main()
