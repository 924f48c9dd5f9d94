"""Structured outputs with speculative decoding: what a JSON schema costs and whether drafting
still pays under it (issues 11, 12).

    .venv/bin/python benchmarks/bench_structured.py [--prompts 8] [--max-tokens 128] [--no-write]

Held-out MT-Bench questions, each asked for a JSON answer ({"answer": ..., "keywords": [...]},
the schema below), chat template, greedy, batch 1, float32, the default policy. Per prompt, in
a rotating order: plain decoding without the schema (what the schema costs), plain decoding
with it, the built-in drafter with it, n-gram prompt lookup with it. Reports ms per output
token (median over prompts; each configuration's own tokens), the speedup over plain with the
schema (the ratio of per-prompt times over the same tokens, median and range), τ, the share of
drafts the grammar refused, the time the grammar masks took per verify block, and whether the
speculative outputs equal plain's under the schema (they must) and parse. Also the mask time
per block alone at batch 1 / 8 / 32. Writes benchmarks/results/bench_structured-KIND.json and its
BENCHMARKS.md section. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import sections

import draftsmith  # noqa: F401  (OpenMP settings before torch)
import draftsmith.engine.engine as engine_mod
import torch

from draftsmith import LLM, SamplingParams, StructuredOutputsParams
from draftsmith.core.request import Request
from draftsmith.core.structured import constrain
from draftsmith.data.sources import MTBenchSource
from draftsmith.models.target import load_target

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"},
                                           "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
          "required": ["answer", "keywords"], "additionalProperties": False}
ASK = '\n\nReply in JSON with the keys "answer" (your answer) and "keywords" (up to five key words).'


class MaskClock:
    """Wraps the engine's `constrain`: the time it takes per verify block, and drafts it refused."""

    def __init__(self) -> None:
        self.seconds, self.blocks, self.drafts, self.refused = 0.0, 0, 0, 0

    def __call__(self, logits, seqs, drafts, lengths, executor, inplace=False):
        t0 = time.perf_counter()
        out = constrain(logits, seqs, drafts, lengths, executor, inplace)
        self.seconds += time.perf_counter() - t0
        self.blocks += 1
        if drafts is not None:
            for b, s in enumerate(seqs):
                if s.grammar is not None and lengths[b]:
                    d = drafts[b, : lengths[b]].tolist()
                    self.drafts += len(d)
                    self.refused += len(d) - min(len(d), s.grammar.validate_tokens(d))
        return out


def prompts(n: int) -> list[tuple[str, str]]:
    out = []
    for c in MTBenchSource().conversations():
        if c.split == "heldout":
            out.append((c.id, next(m["content"] for m in c.messages if m["role"] == "user") + ASK))
        if len(out) == n:
            break
    return out


def mask_alone(llm: LLM) -> dict[int, float]:
    """ms per verify block of 8 positions for B rows under SCHEMA, mid-answer (drafts all valid),
    masked in place as the engine does where no row asks for logprobs."""
    g = llm.engine.grammars
    spec = StructuredOutputsParams(json=SCHEMA)
    ids = llm.encode('{"answer": "The capital of France is Paris, a city on the Seine.", "keywords": ["Paris"]}')
    V = llm.target.model.config.vocab_size
    out = {}
    for B in (1, 8, 32):
        seqs = []
        for b in range(B):
            m = g.matcher(spec)
            m.consume_tokens(ids[: 2 + b % 6])
            seqs.append(Request(f"r{b}", [1], SamplingParams(), None, grammar=m))
        drafts = torch.tensor([ids[2 + b % 6: 2 + b % 6 + 7] for b in range(B)])
        logits = torch.randn(B, 8, V)
        constrain(logits, seqs, drafts, [7] * B, g.executor, inplace=True)  # as the engine, without logprobs
        t0 = time.perf_counter()
        for _ in range(10):
            constrain(logits, seqs, drafts, [7] * B, g.executor, inplace=True)
        out[B] = 1e3 * (time.perf_counter() - t0) / 10
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    target = load_target("smollm2-135m", dtype="float32")
    spec = StructuredOutputsParams(json=SCHEMA)
    free = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    json_sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, structured_outputs=spec)
    configs = {"plain, no schema": (LLM(target), free), "plain": (LLM(target), json_sp),
               "dspark:smollm2-135m": (LLM(target, drafter="dspark:smollm2-135m"), json_sp),
               "ngram": (LLM(target, drafter="ngram"), json_sp)}
    names = list(configs)
    clocks = {n: MaskClock() for n in names}
    for llm, sp in configs.values():  # first-call costs, the grammar's compilation, the scheduler's profile
        llm.chat([{"role": "user", "content": "Say hi." + ASK}], SamplingParams(max_tokens=16, temperature=0.0,
                                                                              structured_outputs=sp.structured_outputs))
    t_start, load0 = time.time(), os.getloadavg()[0]
    rows: dict[str, list[dict]] = {n: [] for n in names}
    todo = prompts(a.prompts)
    for i, (pid, text) in enumerate(todo):
        for name in names[i % len(names):] + names[: i % len(names)]:
            llm, sp = configs[name]
            engine_mod.constrain = clocks[name]
            t0 = time.perf_counter()
            (o,) = llm.chat([{"role": "user", "content": text}], sp)
            wall = time.perf_counter() - t0
            rows[name].append({"prompt": pid, "tokens": len(o.token_ids), "wall_s": wall, "ids": o.token_ids,
                               "text": o.text, "tau": o.outputs[0].stats.get("tau"), "finish": o.finish_reason})
    engine_mod.constrain = constrain
    base = rows["plain"]
    result = {"prompts": [p for p, _ in todo], "max_tokens": a.max_tokens, "schema": SCHEMA,
              "torch_threads": torch.get_num_threads(), "load_average": [load0, os.getloadavg()[0]],
              "wall_s": round(time.time() - t_start), "mask_ms_per_block": mask_alone(configs["plain"][0]), "configs": {}}
    for name in names:
        rs, c = rows[name], clocks[name]
        ms = [1e3 * r["wall_s"] / max(1, r["tokens"]) for r in rs]
        same = [r["ids"] == b["ids"] for r, b in zip(rs, base)]
        ratio = [b["wall_s"] / r["wall_s"] for r, b, s in zip(rs, base, same) if s]
        parsed = sum(1 for r in rs if r["finish"] == "stop" and _parses(r["text"]))
        result["configs"][name] = {
            "ms_per_token_p50": statistics.median(ms), "tokens": sum(r["tokens"] for r in rs),
            "speedup_p50": statistics.median(ratio) if ratio and name != "plain, no schema" else None,
            "speedup_min": min(ratio) if ratio else None, "speedup_max": max(ratio) if ratio else None,
            "tau": statistics.median(r["tau"] for r in rs) if name not in ("plain", "plain, no schema") else None,
            "outputs_equal_plain": f"{sum(same)}/{len(same)}" if name != "plain, no schema" else "–",
            "json_parses": f"{parsed}/{len(rs)}" if name != "plain, no schema" else "–",
            "refused_drafts": f"{c.refused}/{c.drafts}" if c.drafts else "–",
            "mask_ms_per_block": 1e3 * c.seconds / c.blocks if c.blocks else None}
    tag, title = sections.cpu_kind()
    key = f"bench_structured{tag}"
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / f"benchmarks/results/{key}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "schema"}, indent=1))
    if a.no_write:
        return
    mk = result["mask_ms_per_block"]
    lines = [f"## Structured outputs with speculative decoding: a JSON schema (issues 11, 12){title}", "",
             f"`benchmarks/bench_structured.py` (JSON: `benchmarks/results/{key}.json`): {len(todo)} held-out MT-Bench "
             f"questions asking for a JSON answer (`answer` string, `keywords` list of up to 5), chat template, "
             f"greedy, batch 1, float32, the default policy, {a.max_tokens} new tokens at most; per prompt the four "
             f"configurations in a rotating order. Speedup: per prompt, plain-with-schema's wall time over the "
             f"configuration's (same tokens: outputs equal), median (min–max). Load average "
             f"{result['load_average'][0]:.2f} at the start, {result['load_average'][1]:.2f} at the end; "
             f"{result['wall_s']} s in all.", "",
             "| configuration | ms/token (median) | speedup vs plain with the schema | τ | drafts the grammar refused "
             "| mask ms per block | outputs = plain | JSON parses |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result["configs"].items():
        sp = "–" if r["speedup_p50"] is None else f"{r['speedup_p50']:.2f} ({r['speedup_min']:.2f}–{r['speedup_max']:.2f})"
        tau = "–" if r["tau"] is None else f"{r['tau']:.2f}"
        mask = "–" if r["mask_ms_per_block"] is None else f"{r['mask_ms_per_block']:.2f}"
        lines.append(f"| {name} | {r['ms_per_token_p50']:.1f} | {sp} | {tau} | {r['refused_drafts']} | {mask} "
                     f"| {r['outputs_equal_plain']} | {r['json_parses']} |")
    lines += ["", f"The grammar masks alone (`constrain` in place, 8 positions a block, rows mid-answer): "
              f"{mk[1]:.2f} ms at batch 1, {mk[8]:.2f} ms at batch 8, {mk[32]:.2f} ms at batch 32 per block."]
    sections.write_section(f"<!-- {key}:begin -->", f"<!-- {key}:end -->", "\n".join(lines))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
