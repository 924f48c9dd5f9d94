"""Structured outputs with speculative decoding: what a JSON schema costs, whether drafting
still pays under it, and what the grammar's own drafts add (issues 11, 12).

    .venv/bin/python benchmarks/bench_structured.py [--prompts 8] [--max-tokens 128] [--no-write]

Held-out MT-Bench questions, each asked for a JSON answer under one of two schemas ("answer":
{"answer": ..., "keywords": [...]}; "record": six typed fields, most of the answer's tokens in
keys and punctuation, as tool calls and extraction are), chat template, greedy, batch 1, float32,
the default policy. Per prompt and schema, in a rotating order: plain decoding without the
schema (what the schema costs), plain decoding with it and no forced drafts (the baseline:
what an engine without them does), plain with the grammar's forced drafts
(core/grammar_drafts.py), n-gram prompt lookup and the built-in drafter without and with them
(drafts the grammar refuses are cut before the forward in every configuration), and the built-in
drafter with forced drafts but without grammar-masked drafting (core/draft_masks.py: every other
configuration of it drafts under the grammar). Torch threads pinned (no thread governor).
Reports ms per output token (median over prompts; each configuration's own tokens), the
speedup over the baseline (the ratio of per-prompt times over the same tokens, median and range),
τ, the drafter's and the grammar's drafts accepted / proposed, the time the grammar masks took
per verify block, and whether every output equals the baseline's (it must) and parses. Also the
mask time per block alone at batch 1 / 8 / 32. Writes benchmarks/results/bench_structured-KIND.json
and its BENCHMARKS.md section. Run on an idle machine.
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
from draftsmith.core.structured import grammar_bits, masked
from draftsmith.data.sources import MTBenchSource
from draftsmith.models.target import load_target

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"},
                                           "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
          "required": ["answer", "keywords"], "additionalProperties": False}
RECORD = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40}, "category": {"enum": ["writing", "roleplay", "reasoning", "math",
                                                                         "coding", "extraction", "stem", "humanities"]},
    "difficulty": {"enum": ["easy", "medium", "hard"]}, "needs_calculation": {"type": "boolean"},
    "expected_answer_words": {"type": "integer"}, "summary": {"type": "string", "maxLength": 80}},
    "required": ["topic", "category", "difficulty", "needs_calculation", "expected_answer_words", "summary"],
    "additionalProperties": False}
SCHEMAS = {"answer": (SCHEMA, '\n\nReply in JSON with the keys "answer" (your answer) and "keywords" (up to five key '
                              'words).'),
           "record": (RECORD, "\n\nDo not answer the question. Describe it as a JSON record with the keys topic, "
                              "category, difficulty, needs_calculation, expected_answer_words and summary.")}
BASELINE = "plain, no forced drafts"


class MaskClock:
    """Wraps the engine's grammar masks (`grammar_bits`, read before the forward, and `masked`,
    applied after it): the time they take per verify block."""

    def __init__(self) -> None:
        self.seconds, self.blocks = 0.0, 0

    def bits(self, seqs, drafts, lengths, V, executor):
        t0 = time.perf_counter()
        out = grammar_bits(seqs, drafts, lengths, V, executor)
        self.seconds += time.perf_counter() - t0
        self.blocks += 1
        return out

    def masked(self, logits, bits, inplace=False):
        t0 = time.perf_counter()
        out = masked(logits, bits, inplace)
        self.seconds += time.perf_counter() - t0
        return out

    def install(self) -> None:
        engine_mod.grammar_bits, engine_mod.masked = self.bits, self.masked


def prompts(n: int) -> list[tuple[str, str]]:
    out = []
    for c in MTBenchSource().conversations():
        if c.split == "heldout":
            out.append((c.id, next(m["content"] for m in c.messages if m["role"] == "user")))
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
        block = lambda: masked(logits, grammar_bits(seqs, drafts, [7] * B, V, g.executor)[0], inplace=True)  # noqa: E731
        block()  # as the engine, without logprobs
        t0 = time.perf_counter()
        for _ in range(10):
            block()
        out[B] = 1e3 * (time.perf_counter() - t0) / 10
    return out


def run_schema(configs: dict, schema: dict, ask: str, todo: list[tuple[str, str]], max_tokens: int) -> dict:
    """Every configuration on every prompt under one schema, in a rotating order per prompt."""
    spec = StructuredOutputsParams(json=schema)
    params = {True: SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=spec),
              False: SamplingParams(max_tokens=max_tokens, temperature=0.0)}
    names = list(configs)
    clocks = {n: MaskClock() for n in names}
    for llm, constrained in configs.values():  # first-call costs, the grammar's compilation, the scheduler's profile
        llm.chat([{"role": "user", "content": "Say hi." + ask}], SamplingParams(max_tokens=16, temperature=0.0,
                                                                              structured_outputs=spec))
    t_start, load0 = time.time(), os.getloadavg()[0]
    rows: dict[str, list[dict]] = {n: [] for n in names}
    for i, (pid, text) in enumerate(todo):
        for name in names[i % len(names):] + names[: i % len(names)]:
            llm, constrained = configs[name]
            clocks[name].install()
            t0 = time.perf_counter()
            (o,) = llm.chat([{"role": "user", "content": text + ask}], params[constrained], use_tqdm=False)
            wall = time.perf_counter() - t0
            st = o.outputs[0].stats
            rows[name].append({"prompt": pid, "tokens": len(o.token_ids), "wall_s": wall, "ids": o.token_ids,
                               "text": o.text, "tau": st.get("tau"), "finish": o.finish_reason,
                               "drafts": (st["draft_accepted"], st["draft_proposed"]),
                               "forced": (st["forced_accepted"], st["forced_proposed"])})
    engine_mod.grammar_bits, engine_mod.masked = grammar_bits, masked
    base = rows[BASELINE]
    out = {"schema": schema, "load_average": [load0, os.getloadavg()[0]], "wall_s": round(time.time() - t_start),
           "configs": {}}
    for name in names:
        rs, c = rows[name], clocks[name]
        ms = [1e3 * r["wall_s"] / max(1, r["tokens"]) for r in rs]
        same = [r["ids"] == b["ids"] for r, b in zip(rs, base)]
        ratio = [b["wall_s"] / r["wall_s"] for r, b, s in zip(rs, base, same) if s]
        parsed = sum(1 for r in rs if r["finish"] == "stop" and _parses(r["text"]))
        constrained = configs[name][1]
        total = lambda key, i: sum(r[key][i] for r in rs)  # noqa: E731
        out["configs"][name] = {
            "ms_per_token_p50": statistics.median(ms), "tokens": sum(r["tokens"] for r in rs),
            "speedup_p50": statistics.median(ratio) if ratio and constrained else None,
            "speedup_min": min(ratio) if ratio else None, "speedup_max": max(ratio) if ratio else None,
            "tau": statistics.median(r["tau"] for r in rs) if constrained else None,
            "drafts_accepted": total("drafts", 0), "drafts_proposed": total("drafts", 1),
            "forced_accepted": total("forced", 0), "forced_proposed": total("forced", 1),
            "outputs_equal_baseline": f"{sum(same)}/{len(same)}" if constrained else "–",
            "json_parses": f"{parsed}/{len(rs)}" if constrained else "–",
            "mask_ms_per_block": 1e3 * c.seconds / c.blocks if c.blocks and constrained else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    target = load_target("smollm2-135m", dtype="float32")
    threads = torch.get_num_threads()

    def llm(drafter: str = "none", forced_drafts: int = 16, grammar_masks: bool = True) -> LLM:
        out = LLM(target, drafter=drafter, forced_drafts=forced_drafts, threads=threads)
        if not grammar_masks:
            out.drafter.grammar_masks = False
        return out

    configs = {"plain, no schema": (llm(), False), BASELINE: (llm(forced_drafts=0), True),
               "plain": (llm(), True),
               "ngram, no forced drafts": (llm("ngram", forced_drafts=0), True),
               "ngram": (llm("ngram"), True),
               "dspark:smollm2-135m, no forced drafts": (llm("dspark:smollm2-135m", forced_drafts=0), True),
               "dspark:smollm2-135m, drafts not masked": (llm("dspark:smollm2-135m", grammar_masks=False), True),
               "dspark:smollm2-135m": (llm("dspark:smollm2-135m"), True)}
    todo = prompts(a.prompts)
    t_start = time.time()
    result = {"prompts": [p for p, _ in todo], "max_tokens": a.max_tokens, "torch_threads": threads,
              "schemas": {name: run_schema(configs, schema, ask, todo, a.max_tokens)
                          for name, (schema, ask) in SCHEMAS.items()},
              "mask_ms_per_block": mask_alone(configs["plain"][0]), "wall_s": round(time.time() - t_start)}
    tag, title = sections.cpu_kind()
    key = f"bench_structured{tag}"
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / f"benchmarks/results/{key}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    if a.no_write:
        return
    mk = result["mask_ms_per_block"]
    lines = [f"## Structured outputs with speculative decoding: JSON schemas and the grammar's own drafts "
             f"(issues 11, 12){title}", "",
             f"`benchmarks/bench_structured.py` (JSON: `benchmarks/results/{key}.json`): {len(todo)} held-out MT-Bench "
             f"questions, each asked for a JSON answer under two schemas: *answer* (`answer` string, `keywords` list "
             f"of up to 5) and *record* (six typed fields describing the question: strings, enums, a boolean, an "
             f"integer: most tokens are keys and punctuation, as in tool calls and extraction); chat template, "
             f"greedy, batch 1, float32, the default policy, {a.max_tokens} new tokens at most; per prompt and schema "
             f"the configurations in a rotating order; {result['wall_s']} s in all. Baseline: plain decoding under "
             f"the schema without forced drafts. Forced drafts (core/grammar_drafts.py): where the grammar forces "
             f"the next tokens they are the row's draft; drafts it refuses are cut before the forward in every "
             f"configuration; the built-in drafter drafts under the grammar (core/draft_masks.py) except in the "
             f"configuration that says *drafts not masked*; {threads} torch threads pinned. Speedup: "
             f"per prompt, the baseline's wall time over the configuration's (same tokens: outputs equal), median "
             f"(min–max). Drafts: accepted / proposed over all prompts, the drafter's and the grammar's (forced) apart."]
    for sname, r in result["schemas"].items():
        lines += ["", f"**{sname}** (load average {r['load_average'][0]:.2f} at the start, "
                      f"{r['load_average'][1]:.2f} at the end):", "",
                  "| configuration | ms/token (median) | speedup vs baseline | τ | drafter's drafts accepted | "
                  "forced drafts accepted | mask ms per block | outputs = baseline | JSON parses |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, c in r["configs"].items():
            sp = "–" if c["speedup_p50"] is None else f"{c['speedup_p50']:.2f} ({c['speedup_min']:.2f}–{c['speedup_max']:.2f})"
            tau = "–" if c["tau"] is None else f"{c['tau']:.2f}"
            mask = "–" if c["mask_ms_per_block"] is None else f"{c['mask_ms_per_block']:.2f}"
            dr = f"{c['drafts_accepted']}/{c['drafts_proposed']}" if c["drafts_proposed"] else "–"
            fo = f"{c['forced_accepted']}/{c['forced_proposed']}" if c["forced_proposed"] else "–"
            lines.append(f"| {name} | {c['ms_per_token_p50']:.1f} | {sp} | {tau} | {dr} | {fo} | {mask} "
                         f"| {c['outputs_equal_baseline']} | {c['json_parses']} |")
    lines += ["", f"The grammar masks alone (`grammar_bits` + `masked` in place, 8 positions a block, rows mid-answer, *answer* "
              f"schema): {mk[1]:.2f} ms at batch 1, {mk[8]:.2f} ms at batch 8, {mk[32]:.2f} ms at batch 32 per block."]
    sections.write_section(f"<!-- {key}:begin -->", f"<!-- {key}:end -->", "\n".join(lines))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
