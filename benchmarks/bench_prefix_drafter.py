"""Multi-turn chat with the built-in DSpark drafter: prefix caching on vs off (issues 11, 12).

    .venv/bin/python benchmarks/bench_prefix_drafter.py [--conversations 8] [--max-tokens 128]
        [--concurrency 1] [--drafter dspark:smollm2-135m] [--dtype float32] [--no-write]

Held-out MT-Bench conversations (two user turns each), greedy, the default policy: turn 1 answers
the first question, turn 2's prompt is the chat template over [question 1, the answer, question 2].
`--concurrency C` keeps C conversations in flight (closed loop: a conversation's second turn is
sent when its first is answered; the engines have C rows). Four configurations, each its own
engine over one loaded target:

- plain decoding, prefix caching off and on;
- the drafter, prefix caching off (before this change, the only way to run a feature-fed drafter)
  and on (its rows keep the drafter's context with the KV: drafters/feature_queue.py).

One process; every wave of C conversations runs through all four in an order that rotates from one
wave to the next, so drift on a shared VM touches them alike. Per configuration: turn 2's time to
first token (its prefill), the prompt tokens prefilled, each turn's decode tokens/s, the
conversation's wall time, the wave's output tokens per second (both turns, prefill included), τ;
× plain = that rate ÷ plain decoding's without prefix caching, per wave. The outputs of the two
drafter configurations are compared with plain decoding's under the same prefix-caching setting.
Writes its section of BENCHMARKS.md (per CPU kind, concurrency and drafter) and
benchmarks/results/bench_prefix_drafter[-cC][-drafter][-kind].json (no drafter part for the built-in).
Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import re
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
DEFAULT_DRAFTER = "dspark:smollm2-135m"


def conversations(n: int) -> list[tuple[str, str, str]]:
    out = []
    for c in MTBenchSource().conversations():
        users = [m["content"] for m in c.messages if m["role"] == "user"]
        if c.split == "heldout" and len(users) >= 2:
            out.append((c.id, users[0], users[1]))
        if len(out) == n:
            break
    return out


def turn_stats(llm: LLM, s, t_added: float, ids: list[int]) -> dict:
    """One finished turn: its timings from when it was added, its tokens, its rounds."""
    done = s.stats.t_finish
    first = s.stats.t_first_token if s.stats.t_first_token is not None else done
    return {"ttft_s": first - t_added, "wall_s": done - t_added, "decode_s": done - first,
            "decode_tokens": max(0, len(s.output_ids) - 1), "prompt_tokens": len(ids),
            "cached_tokens": int(s.stats.cached_tokens), "rounds": s.stats.rounds, "committed": s.stats.committed,
            "t_added": t_added, "t_finish": done, "text": llm.engine.decode(s.output_ids), "ids": list(s.output_ids)}


def run_wave(llm: LLM, convs: list[tuple[str, str, str]], params: SamplingParams) -> tuple[list[list[dict]], float]:
    """Every conversation of `convs` in flight at once (closed loop): its first turn from the start,
    its second turn as soon as its first is answered. → ([turn 1, turn 2] per conversation, wall s)."""
    eng = llm.engine
    out: list[list[dict]] = [[{}, {}] for _ in convs]
    live: dict[str, tuple] = {}

    def add(i: int, turn: int, msgs: list[dict]) -> None:
        ids = llm.apply_chat_template(msgs)
        s = eng.add_request(ids, params)
        live[s.request_id] = (i, turn, msgs, s, time.perf_counter(), ids)

    t0 = time.perf_counter()
    for i, (_, q1, _) in enumerate(convs):
        add(i, 0, [{"role": "user", "content": q1}])
    while live:
        eng.step()
        for rid, (i, turn, msgs, s, t_added, ids) in list(live.items()):
            if s.finished:
                del live[rid]
                out[i][turn] = turn_stats(llm, s, t_added, ids)
                if turn == 0:
                    add(i, 1, msgs + [{"role": "assistant", "content": out[i][0]["text"]},
                                      {"role": "user", "content": convs[i][2]}])
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, default=1, help="conversations in flight per engine (its rows)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    target = load_target("smollm2-135m", dtype=args.dtype)
    C = args.concurrency
    configs = {
        "plain": LLM(target, max_batch=C, enable_prefix_caching=False),
        "plain + prefix caching": LLM(target, max_batch=C, enable_prefix_caching=True),
        f"{args.drafter}": LLM(target, drafter=args.drafter, max_batch=C, enable_prefix_caching=False),
        f"{args.drafter} + prefix caching": LLM(target, drafter=args.drafter, max_batch=C, enable_prefix_caching=True),
    }
    assert configs[f"{args.drafter} + prefix caching"].engine.prefix_caching, "the drafter refused prefix caching"
    names = list(configs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    convs = conversations(args.conversations)
    warm = conversations(args.conversations + 1)[-1]
    for llm in configs.values():  # first-call costs and the scheduler's profile out of the timings
        run_wave(llm, [(warm[0], warm[1][:200], warm[2][:200])], SamplingParams(max_tokens=16, temperature=0.0))
    t_start = time.time()
    load0 = _load()
    results: dict[str, list[list[dict]]] = {n: [] for n in names}
    waves: dict[str, list[float]] = {n: [] for n in names}  # output tokens/s of each wave
    for w, k in enumerate(range(0, len(convs), C)):
        wave = convs[k: k + C]
        order = names[w % len(names):] + names[: w % len(names)]
        for name in order:
            got, wall = run_wave(configs[name], wave, params)
            results[name] += got
            waves[name].append(sum(t["decode_tokens"] + 1 for c in got for t in c) / wall)
        print([c[0] for c in wave], {n: round(waves[n][-1], 2) for n in names}, flush=True)
    load1 = _load()

    def med(name: str, turn: int, key: str) -> float:
        return statistics.median(c[turn][key] for c in results[name])

    base = names[0]
    rows = []
    for name in names:
        conv_wall = [c[1]["t_finish"] - c[0]["t_added"] for c in results[name]]
        ratio = [x / b for b, x in zip(waves[base], waves[name])]
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
    result = {"conversations": [c[0] for c in convs], "concurrency": C, "max_tokens": args.max_tokens,
              "drafter": args.drafter, "wave_tokens_per_s": waves,
              "dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows,
              "load_average": [load0, load1], "wall_s": round(time.time() - t_start),
              "per_conversation": {n: [[{k: v for k, v in t.items() if k not in ("text", "ids")} for t in c]
                                       for c in rs] for n, rs in results.items()}}
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    # one section per CPU kind, concurrency and drafter (the built-in's is the unnamed one)
    named = "" if args.drafter == DEFAULT_DRAFTER else "-" + re.sub(r"[^A-Za-z0-9.]+", "-", args.drafter).strip("-")
    key = f"bench_prefix_drafter{'' if C == 1 else f'-c{C}'}{named}{tag}"
    (ROOT / f"benchmarks/results/{key}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows, indent=1))
    if args.no_write:
        return
    at = "batch 1" if C == 1 else f"concurrency {C}"
    how = ("each conversation runs through all four in a rotating order" if C == 1 else
           f"the conversations go in waves of {C} in flight at once (closed loop: a conversation's second turn is "
           f"sent when its first is answered), each wave through all four in a rotating order")
    unit = "conversation" if C == 1 else "wave"
    heading = "" if C == 1 else f", {at}"
    lines = [f"## Multi-turn chat with the built-in drafter: prefix caching on vs off{heading} (issues 11, 12){title}", "",
             f"`benchmarks/bench_prefix_drafter.py --concurrency {C}` (JSON: `benchmarks/results/{key}.json`): "
             f"{len(convs)} held-out MT-Bench conversations, two user turns each (turn 2's prompt = the chat template "
             f"over question 1, the answer, question 2), {at}, greedy, {args.max_tokens} new tokens per turn, "
             f"{args.dtype} target at {result['threads']} threads, the default policy. One process, one loaded target, "
             f"four engines; {how}. Medians over conversations; × plain = the {unit}'s output tokens/s (both turns, "
             f"prefill included) ÷ plain's, per {unit} (min–max). Load "
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
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    sections.write_section(begin, end, "\n".join(lines))


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


if __name__ == "__main__":
    main()
