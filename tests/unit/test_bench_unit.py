"""bench building blocks: percentiles, aggregation from counts, verdicts, parsers, the results
file, /metrics differences, phase planning, and the in-process load generator on a tiny model
(closed loop and Poisson arrivals). No wall-clock assertions (docs/MEASURING.md #7)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from draftsmith.bench.config import Arrival, BenchConfig, parse_arrival, parse_concurrency, parse_endpoint
from draftsmith.bench.loadgen import (
    BenchRequest, counters_from_text, diff_counters, next_turn, poisson_offsets, run_engine,
)
from draftsmith.bench.metrics import RequestRecord, RunResult, distribution, percentile, spread, summarize
from draftsmith.bench.phases import plan_phases
from draftsmith.bench.results import read_results
from draftsmith.bench.verdict import verdict
from draftsmith.core.sampling import SamplingParams
from draftsmith.errors import DraftsmithError


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- metrics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("xs", [[1.0], [3.0, 1.0], [5, 1, 4, 2, 3], list(np.random.default_rng(0).exponential(size=37))])
def test_percentile_matches_numpy_linear(xs):
    for q in (0, 5, 50, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    d = distribution(xs)
    assert d["p50"] <= d["p95"] <= d["p99"] <= d["max"]
    assert percentile([], 50) is None and distribution([])["p50"] is None


def test_spread_ignores_missing():
    assert spread([None, 2.0, 1.0, 3.0, float("nan")]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([])["median"] is None


def _rec(i, tokens, e2e, ttft, *, proposed=0, accepted=0, rounds=None, deliveries=None, pp=(), pa=(), err=None):
    rounds = tokens if rounds is None else rounds
    return RequestRecord(index=i, prompt_id=f"p{i}", t_arrival=0.0, ttft=ttft, e2e=None if err else e2e,
                         deliveries=deliveries or [], output_tokens=tokens, output_sha="x", proposed=proposed,
                         accepted=accepted, rounds=rounds, committed=tokens, target_forwards=rounds + 1,
                         proposed_at=list(pp), accepted_at=list(pa), error=err)


def test_summarize_from_counts():
    a = _rec(0, 10, 1.0, 0.1, proposed=12, accepted=6, rounds=4, deliveries=[[0.3, 3], [0.6, 4]], pp=[4, 4, 4], pa=[3, 2, 1])
    b = _rec(1, 6, 0.5, 0.2, proposed=6, accepted=3, rounds=3, deliveries=[[0.3, 3]], pp=[3, 3], pa=[2, 1])
    failed = _rec(2, 0, 0.0, None, err="HTTP 500")
    s = summarize([RunResult([a, failed], wall_s=1.0, engine_steps=5, batched_forwards=6),
                   RunResult([b], wall_s=0.6, engine_steps=3, batched_forwards=4)])
    assert s["requests"] == 3 and s["errors"] == 1 and s["output_tokens"] == 16
    assert s["system_tokens_per_s"] * s["wall_s"] == pytest.approx(16)
    assert s["system_tokens_per_s_per_unit"] == [pytest.approx(10.0), pytest.approx(10.0)]
    assert s["tau"] == pytest.approx(16 / 7) and s["rounds"] == 7 and s["committed"] == 16
    assert s["acceptance_rate"] == pytest.approx(9 / 18)
    assert s["target_forwards_per_token"] == pytest.approx((5 + 4) / 16)
    assert s["engine_steps_per_token"] == pytest.approx(10 / 16)
    assert s["per_position_acceptance"] == pytest.approx([5 / 7, 3 / 7, 1 / 4])
    # inter-token samples: each delivery's gap split evenly over its tokens
    assert s["itl_s"]["n"] == 10 and s["itl_s"]["max"] == pytest.approx(0.15)
    assert s["tpot_s"]["p50"] == pytest.approx(statistics_median([(1.0 - 0.1) / 9, (0.5 - 0.2) / 5]))
    assert s["per_user_tokens_per_s"]["min"] == pytest.approx(10.0)
    for k in ("ttft_s", "itl_s", "e2e_s", "tpot_s"):
        d = s[k]
        assert d["p50"] <= d["p95"] <= d["p99"]


def statistics_median(xs):
    import statistics

    return statistics.median(xs)


def test_summarize_baseline_has_no_acceptance():
    s = summarize([RunResult([_rec(0, 5, 1.0, 0.1)], wall_s=1.0)])
    assert s["acceptance_rate"] is None and s["tau"] == 1.0 and s["per_position_acceptance"] == []


# ---- verdicts --------------------------------------------------------------------------------


def test_verdicts():
    base = {"system_tokens_per_s": 100.0}
    assert verdict({}, None, is_baseline=True)["decision"] == "baseline"
    assert verdict({"void": True, "void_reason": "2 of 8 differ"}, base) == {
        "decision": "void", "reason": "2 of 8 differ", "flags": []}
    v = verdict({"acceptance_rate": 0.2, "draft_proposed": 10, "speedup": 1.3}, base)
    assert v["decision"] == "go" and v["reason"] == "1.30× the baseline's tokens/s, acceptance 0.20"  # speed decides
    v = verdict({"acceptance_rate": 0.8, "draft_proposed": 10, "speedup": 0.9}, base)
    assert v["decision"] == "no-go" and "slower than the baseline: 0.90×" in v["reason"]
    v = verdict({"acceptance_rate": 0.3, "draft_proposed": 10, "speedup": 0.9}, base)
    assert v["decision"] == "no-go" and "acceptance 0.30" in v["reason"] and "slower" in v["reason"]
    assert verdict({"acceptance_rate": None, "draft_proposed": 0, "speedup": 1.2}, base)["decision"] == "no-go"
    # drafts proposed but none accepted (a scheduler that turned drafting off): a speedup is noise
    v = verdict({"acceptance_rate": 0.0, "draft_proposed": 1, "draft_accepted": 0, "speedup": 1.17}, base)
    assert v["decision"] == "no-go" and v["reason"].startswith("accepted none of its 1 draft tokens")
    v = verdict({"acceptance_rate": 0.7, "draft_proposed": 10, "speedup": 1.25}, base)
    assert v["decision"] == "go" and v["reason"].startswith("1.25×")
    assert verdict({"acceptance_rate": 0.7, "speedup": None}, None)["decision"] == "n/a"


def test_verdict_flags_what_cannot_be_trusted():
    """Fewer requests than the concurrency, a load above the core count, a speedup above τ:
    each is flagged in the reason and in "flags"; a clean measurement has none."""
    base = {"system_tokens_per_s": 100.0}
    clean = {"acceptance_rate": 0.7, "draft_proposed": 10, "speedup": 1.25, "tau": 2.0, "requests": 16,
             "concurrency": 4, "loadavg": 1.9, "cores": 2}
    assert verdict(clean, base)["flags"] == []
    v = verdict({**clean, "requests": 4, "concurrency": 16}, base)
    assert v["flags"] == ["only 4 requests for concurrency 16: the tier was not reached"] and "[only 4" in v["reason"]
    assert verdict({**clean, "loadavg": 5.0}, base)["flags"] == ["noisy: load average 5.0 on 2 cores"]
    v = verdict({**clean, "speedup": 2.86, "tau": 1.07}, base)
    assert v["decision"] == "go" and v["flags"][0].startswith("implausible: 2.86× with τ 1.07")
    assert verdict({**clean, "speedup": 2.1, "tau": 2.0}, base)["flags"] == []  # within the 10% slack
    assert verdict(clean, base, is_baseline=True)["flags"] == []
    # an endpoint without counters: speed alone decides
    assert verdict({"acceptance_rate": None, "draft_proposed": None, "speedup": 1.1}, base)["decision"] == "go"


def _row(label, speedup, decision, n, per_request=None, flags=()):
    return {"label": label, "kind": "baseline" if label == "none" else "inprocess", "system_tokens_per_s": 10 * speedup,
            "speedup": speedup, "acceptance_rate": None, "tau": None,
            "speedup_spread": {"n": n, "median": speedup, "min": speedup * 0.9 if n > 1 else speedup,
                               "max": speedup * 1.2 if n > 1 else speedup},
            "per_request_speedup": per_request, "verdict": {"decision": decision, "reason": "r", "flags": list(flags)}}


def _tiers(rows_by_c):
    return [{"concurrency": c, "arrival": "closed", "results": [_row("none", 1.0, "baseline", 0), *rows]}
            for c, rows in rows_by_c.items()]


def test_headline_cites_the_table_row_it_summarises():
    """Issue 15: the headline said 2.42× (one run at c4) while the detail table showed 2.70× (the
    per-request median of 4); the headline now quotes the row's own cell, its tier and n."""
    from draftsmith.bench.report_markdown import headline_bullets, headline_table, speedup_cell

    c4 = _row("ngram", 2.42, "go", 1, per_request={"n": 4, "median": 2.70, "min": 2.1, "max": 3.0},
              flags=["noisy: load average 5.0 on 2 cores"])
    tiers = _tiers({1: [_row("ngram", 1.5, "go", 4)], 4: [c4], 16: [_row("ngram", 0.8, "no-go", 1)]})
    (bullet,) = headline_bullets(tiers, None)
    assert speedup_cell(c4) == "2.42× (n=1)"
    assert bullet == ("ngram: pays up to concurrency 4 (best: concurrency 4: 2.42× (n=1) [noisy: load average 5.0 "
                      "on 2 cores]) and stops paying at concurrency 16: 0.80× (n=1)")
    table = headline_table({"tiers": tiers})
    for c, r in ((4, c4), (16, tiers[2]["results"][1])):  # each number cited is the table's cell for that row
        (line,) = [ln for ln in table.splitlines() if ln.startswith(f"| {c} | ngram |")]
        assert f"| {speedup_cell(r)} |" in line and f"concurrency {c}: {speedup_cell(r)}" in bullet
    assert "2.70" not in bullet
    (b,) = headline_bullets(_tiers({1: [_row("x", 0.7, "no-go", 4)], 4: [_row("x", 0.9, "no-go", 1)]}), None)
    assert b == "x: does not pay at any measured tier; its best is concurrency 4: 0.90× (n=1)"
    (b,) = headline_bullets(_tiers({1: [_row("x", 1.7, "go", 3)], 2: [_row("x", 1.1, "void", 1)]}), None)
    assert b == "x: pays at every measured tier; its least is concurrency 1: 1.70× (1.53–2.04, n=3); VOID at concurrency 2: r"


def test_report_markdown_tables_are_whole_and_the_speedup_cells_agree(tmp_path):
    from draftsmith.bench.report_markdown import render_markdown

    tiers = _tiers({1: [_row("ngram", 1.5, "go", 4, per_request={"n": 4, "median": 1.6, "min": 1.0, "max": 2.0})]})
    for t in tiers:
        for r in t["results"]:
            r.update(per_user_tokens_per_s={"mean": 1.0, "min": 0.5}, cost_per_1m_output_tokens=None, memory={},
                     bandwidth_bound_tokens_per_s=None, fraction_of_bound=None, equality={}, ttft_s=None, itl_s=None,
                     tpot_s=None, e2e_s=None, target_forwards_per_token=None, engine_steps_per_token=None,
                     decode_tokens_per_s=30.0, prefill_time_share=0.25,
                     decode_speedup=1.0 if r["kind"] == "baseline" else 1.1,
                     decode_speedup_spread={"n": 4, "median": 1.1, "min": 1.0, "max": 1.2})
    rep = {"setup": {"sampling": {"temperature": 0, "top_p": 1, "max_tokens": 8, "seed": 0}}, "tiers": tiers,
           "headline": ["h"], "machine_load": {"loadavg_start": None, "loadavg_end": None}, "definitions": {},
           "acceptance_per_position": {"ngram": [0.5, None]}, "plots": {"throughput": "t", "latency": "l",
                                                                       "acceptance": "a"}}
    md = render_markdown(rep)
    width = None
    for ln in md.splitlines():  # every table row has as many cells as its header
        width = (ln.count("|") - 1 if width is None else width) if ln.startswith("|") else None
        assert width is None or ln.count("|") - 1 == width, ln
    assert md.count("| 1.50× (1.35–1.80, n=4) |") == 2  # headline table and the tier's table: the same cell
    assert md.count("| 30.0 (1.10×, 1.00–1.20, n=4) |") == 2 and "| 0.25 |" in md  # decode phase, prefill share


# ---- parsing and config ------------------------------------------------------------------------


def test_parsers():
    assert parse_arrival("closed") == Arrival("closed")
    assert parse_arrival("Poisson:2.5") == Arrival("poisson", 2.5) and parse_arrival("poisson:2.5").label == "poisson:2.5"
    for bad in ("poisson", "poisson:0", "poisson:x", "burst"):
        with pytest.raises(DraftsmithError):
            parse_arrival(bad)
    assert parse_concurrency("16,1,4,4") == (1, 4, 16)
    for bad in ("", "1,0", "a"):
        with pytest.raises(DraftsmithError):
            parse_concurrency(bad)
    e = parse_endpoint("http://h:8000")
    assert (e.label, e.url) == ("endpoint", "http://h:8000/v1")
    e = parse_endpoint("none=http://h:8000/v1/", 1)
    assert (e.label, e.url) == ("none", "http://h:8000/v1")
    assert parse_endpoint("http://a=b/v1", 2).label == "endpoint-3"  # '=' in the URL is not a label
    with pytest.raises(DraftsmithError):
        parse_endpoint("ftp://x")


def test_config_validation():
    cfg = BenchConfig(drafters=("none", "ngram"), concurrency=(4, 1))
    assert cfg.drafters == ("ngram",) and cfg.concurrency == (1, 4) and cfg.config_labels == ("none", "ngram")
    for kw in ({"drafters": ("ngram", "ngram")}, {"requests": 0}, {"warmup": -1}, {"temperature": -1.0},
               {"split": "test"}, {"peers": ("vllm",)}, {"peer_assistant": "x"}, {"resume": True, "overwrite": True},
               {"endpoints": (parse_endpoint("http://a"),), "peers": ("hf",)}, {"dollars_per_hour": -1.0}):
        with pytest.raises(DraftsmithError):
            BenchConfig(**kw)
    a = BenchConfig(concurrency=(1, 2)).fingerprint(["p"], "h")
    assert a == BenchConfig(concurrency=(4,), dollars_per_hour=3.0).fingerprint(["p"], "h")  # tiers / cost may change
    assert a != BenchConfig(max_tokens=8).fingerprint(["p"], "h")


def test_plan_phases_places_peers_in_the_closed_loop_tier_1():
    keys = [(p.key, p.with_peers, p.tier) for p in plan_phases(BenchConfig(concurrency=(1, 4), peers=("hf",)))]
    assert keys == [("c1", True, True), ("c4", False, True)]
    ph = plan_phases(BenchConfig(concurrency=(4,), peers=("hf",)))
    assert [(p.key, p.concurrency, p.with_peers, p.tier) for p in ph] == [("peers", 1, True, False), ("c4", 4, False, True)]
    ph = plan_phases(BenchConfig(concurrency=(1,), peers=("hf",), arrival=Arrival("poisson", 1.0)))
    assert ph[0].key == "peers" and ph[0].arrival.mode == "closed"


def test_poisson_offsets_are_seeded():
    a = poisson_offsets(2000, 4.0, seed=3)
    assert a == poisson_offsets(2000, 4.0, seed=3) and a != poisson_offsets(2000, 4.0, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.25, rel=0.1)


def test_read_results_drops_a_torn_line(tmp_path):
    p = tmp_path / "results.jsonl"
    p.write_text(json.dumps({"phase": "c1"}) + "\n" + json.dumps({"phase": "c2"}) + "\n" + '{"phase": "c4", "x"')
    lines, good = read_results(p)
    assert [x["phase"] for x in lines] == ["c1", "c2"] and good == len(p.read_bytes().rsplit(b"\n", 1)[0]) + 1
    assert read_results(tmp_path / "missing.jsonl") == ([], 0)


def test_bench_refuses_existing_results_without_resume(tmp_path, capsys):
    from draftsmith.cli import main

    (tmp_path / "results.jsonl").write_text('{"phase": "c1"}\n')
    assert main(["bench", "--target", "nowhere", "--out", str(tmp_path)]) == 2
    assert "--resume" in capsys.readouterr().err



def test_bench_overwrite_keeps_the_earlier_results_when_the_workload_fails(tmp_path, monkeypatch):
    """bench --overwrite --workload <typo>: the earlier results were deleted, then the workload
    failed to load. Now they are deleted only once the workload has loaded."""
    from types import SimpleNamespace

    from draftsmith.bench import runner

    monkeypatch.setattr(runner, "InProcessBackend", lambda cfg, log: SimpleNamespace(
        tokenize=lambda text: [1] * len(text.split()), max_prompt_tokens=1000, weights_hash="h"))
    files = {"results.jsonl": '{"phase": "c1"}\n', "setup.json": "{}\n", "report.json": "{}\n", "report.md": "old\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cfg = BenchConfig(out=str(tmp_path), overwrite=True, workload=str(tmp_path / "no-such-workload.jsonl"))
    with pytest.raises(DraftsmithError):
        runner.run_bench(cfg, log=lambda s: None)
    assert {f.name: f.read_text() for f in tmp_path.iterdir()} == files


def test_bench_resume_refuses_another_machine_or_thread_count(tmp_path, monkeypatch):
    """A --resume whose measured work matches but whose threads (or CPU) differ from the run it
    continues is refused before anything is measured: its tiers would not be comparable."""
    from types import SimpleNamespace

    from draftsmith.bench import runner
    from draftsmith.bench.results import SETUP
    from draftsmith.bench.workload import load_workload

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"def f{i}(): pass"}) + "\n" for i in range(3)))
    backend = SimpleNamespace(tokenize=lambda messages: [1] * 8, max_prompt_tokens=1000, weights_hash="h", max_k=4,
                              model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=2048)))
    monkeypatch.setattr(runner, "InProcessBackend", lambda cfg, log: backend)
    out = tmp_path / "out"
    out.mkdir()
    cfg = BenchConfig(out=str(out), resume=True, workload=str(prompts), requests=3)
    wl = load_workload(cfg.workload, cfg.split, cfg.requests, backend.tokenize, 1000, turns=cfg.turns,
                       answer_tokens=cfg.max_tokens + 8)
    machine = runner.machine_info()
    setup = {"fingerprint": cfg.fingerprint([q.id for q in wl.prompts], "h"), "invocations": [],
             "machine": {**machine, "torch_threads": machine["torch_threads"] + 3}}
    (out / SETUP).write_text(json.dumps(setup))
    with pytest.raises(DraftsmithError, match="torch_threads .* then, .* now"):
        runner.run_bench(cfg, log=lambda s: None)
    assert json.loads((out / SETUP).read_text()) == setup  # nothing appended to the run it refused
    # the same machine resumes, and so does a setup.json that recorded fewer of these keys (older runs)
    for old in (dict(machine), {}, {"cpu_model": machine["cpu_model"]}):
        assert runner.check_same_machine(old, machine, out) is None
    with pytest.raises(DraftsmithError, match="cpu_model 'another' then"):
        runner.check_same_machine({"cpu_model": "another"}, machine, out)
    # a CPU run on a CUDA machine resumes with the GPU hidden (CUDA_VISIBLE_DEVICES=""): the GPU's facts
    # count only where a run measured on it, and then so does the device itself
    gpu_box = {**machine, "cuda": True, "gpu": "some GPU"}
    hidden = {**machine, "cuda": False}
    hidden.pop("gpu", None)
    assert runner.check_same_machine(gpu_box, hidden, out, ("cpu", "cpu")) is None
    with pytest.raises(DraftsmithError, match="cuda True then, False now"):
        runner.check_same_machine(gpu_box, hidden, out, ("cuda:0", "cpu"))
    with pytest.raises(DraftsmithError, match="device 'cpu' then, 'cuda:0' now"):
        runner.check_same_machine(gpu_box, gpu_box, out, ("cpu", "cuda:0"))


# ---- /metrics differences ------------------------------------------------------------------------


def test_counters_from_server_metrics():
    from draftsmith.server.metrics import ServerMetrics

    m = ServerMetrics("t", 4)
    before = counters_from_text(m.render())
    m.record_round_deltas(proposed=8, accepted=5, rounds=4, committed=9, pos_proposed=[4, 4], pos_accepted=[3, 2])
    m.record_tokens(0.1, None, 9)
    m.record_finished("length", 1.0)
    after = counters_from_text(m.render())
    d = diff_counters(before, after)
    assert (d["proposed"], d["accepted"], d["rounds"], d["committed"]) == (8, 5, 4, 9)
    assert d["position_proposed"] == [4, 4] and d["position_accepted"] == [3, 2]
    assert d["generation_tokens"] == 9 and d["target_forwards"] == 5
    s = summarize([RunResult([_rec(0, 9, 1.0, 0.1)], wall_s=1.0, counters=d)], counts_from_endpoint=d)
    assert s["tau"] == pytest.approx(9 / 4) and s["acceptance_rate"] == pytest.approx(5 / 8)
    assert s["counts_source"].startswith("server /metrics")
    assert counters_from_text("# nothing\nother_metric 1\n") is None
    assert "unavailable" in diff_counters(None, after)


def test_counters_from_a_vllm_server():
    """bench --endpoint against vLLM: its vllm:spec_decode_* counters, written here by
    prometheus_client as vLLM writes them (counters named without _total, labels model_name and
    engine, two engines summed, 0-based positions, _created series), read as the draftsmith_*
    ones: tau = vLLM's mean acceptance length; per-position acceptance only where every step
    proposed K (exact), not for n-gram's shorter drafts."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    reg = CollectorRegistry()
    lab = ["model_name", "engine"]
    c = {n: Counter(f"vllm:spec_decode_{n}", n, lab, registry=reg)
         for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "p", lab + ["position"], registry=reg)
    gen = Counter("vllm:generation_tokens", "g", lab, registry=reg)
    ok = Counter("vllm:request_success", "s", lab + ["finished_reason"], registry=reg)
    engines = (("m", "0"), ("m", "1"))
    for e in engines:  # (vLLM makes every series at start: per engine, each position of K = 3)
        for counter in (*c.values(), gen):
            counter.labels(*e).inc(0)
        for pos in range(3):
            per_pos.labels(*e, str(pos)).inc(0)
    before = counters_from_text(generate_latest(reg).decode())
    # the run: 10 steps on engine 0 and 6 on engine 1, each proposing K = 3
    for e, steps, acc_at in ((engines[0], 10, [8, 5, 2]), (engines[1], 6, [4, 1, 0])):
        c["num_drafts"].labels(*e).inc(steps)
        c["num_draft_tokens"].labels(*e).inc(3 * steps)
        c["num_accepted_tokens"].labels(*e).inc(sum(acc_at))
        for pos, a in enumerate(acc_at):
            per_pos.labels(*e, str(pos)).inc(a)
        gen.labels(*e).inc(steps + sum(acc_at))
        ok.labels(*e, "length").inc(2)
    d = diff_counters(before, counters_from_text(generate_latest(reg).decode()))
    assert d["source"].startswith("vLLM's /metrics")
    assert (d["proposed"], d["accepted"], d["rounds"], d["committed"]) == (48, 20, 16, 36)
    assert d["generation_tokens"] == 36 and d["target_forwards"] is None
    assert d["position_proposed"] == [16, 16, 16] and d["position_accepted"] == [12, 6, 2]
    s = summarize([RunResult([_rec(0, 36, 1.0, 0.1)], wall_s=1.0, counters=d)], counts_from_endpoint=d)
    assert s["tau"] == pytest.approx(1 + 20 / 16) and s["acceptance_rate"] == pytest.approx(20 / 48)
    assert s["per_position_acceptance"][0] == pytest.approx(12 / 16)
    # n-gram: a step may propose fewer than K: no per-position reading
    before = counters_from_text(generate_latest(reg).decode())
    c["num_drafts"].labels(*engines[0]).inc(4)
    c["num_draft_tokens"].labels(*engines[0]).inc(7)
    d = diff_counters(before, counters_from_text(generate_latest(reg).decode()))
    assert (d["rounds"], d["proposed"], d["position_proposed"], d["position_accepted"]) == (4, 7, [], [])
    # another model on the same /metrics (a router) is not this run's; a restart is no difference
    c["num_drafts"].labels("other", "0").inc(1000)
    after = counters_from_text(generate_latest(reg).decode(), model="m")
    assert after["rounds"] == 20 and counters_from_text(generate_latest(reg).decode())["rounds"] == 1020
    restarted = dict(after, rounds=3, proposed=9)
    assert diff_counters(after, restarted) == {"unavailable": "the server's counters went backwards during the run "
                                                              "(restarted?)"}


# An SGLang server's /metrics (--enable-metrics) as SGLang writes it: prometheus_client in
# multiprocess mode (labels sorted, no _created series), scheduler gauges labelled per rank,
# tokenizer counters labelled model_name / engine_type (and is_streaming on the token and request
# counts), sglang:spec_verify_calls_total counted per finished request. Shape as read in
# sgl-project/sglang python/sglang/srt/observability/metrics_collector.py at 016d8605.
def _sglang_metrics(*, gen=(900.0, 100.0), requests=(8.0, 2.0), verify: float | None = 300.0,
                    accept_length=2.9, accept_rate=0.48, other_model_verify=5000.0) -> str:
    def tok(streaming: str, model: str = "Qwen/Qwen3-8B") -> str:
        return f'engine_type="unified",is_streaming="{streaming}",model_name="{model}"'

    sched = 'engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    lines = [
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        f"sglang:num_running_reqs{{{sched}}} 0.0",
        "# HELP sglang:spec_accept_length Mean acceptance length of speculative decoding (accepted drafts + "
        "bonus token per forward).",
        "# TYPE sglang:spec_accept_length gauge",
        f"sglang:spec_accept_length{{{sched}}} {accept_length}",
        "# HELP sglang:spec_accept_rate Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).",
        "# TYPE sglang:spec_accept_rate gauge",
        f"sglang:spec_accept_rate{{{sched}}} {accept_rate}",
        "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
        "# TYPE sglang:generation_tokens_total counter",
        f'sglang:generation_tokens_total{{{tok("false")}}} {gen[1]}',
        f'sglang:generation_tokens_total{{{tok("true")}}} {gen[0]}',
        "# HELP sglang:num_requests_total Number of requests processed.",
        "# TYPE sglang:num_requests_total counter",
        f'sglang:num_requests_total{{{tok("false")}}} {requests[1]}',
        f'sglang:num_requests_total{{{tok("true")}}} {requests[0]}',
        "# HELP sglang:cached_tokens_total Number of cached prompt tokens by source (device/host/storage).",
        "# TYPE sglang:cached_tokens_total counter",
        'sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="Qwen/Qwen3-8B"} 4096.0',
        "# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds",
        "# TYPE sglang:e2e_request_latency_seconds histogram",
        f'sglang:e2e_request_latency_seconds_bucket{{{tok("true")},le="1.0"}} 3.0',
        f'sglang:e2e_request_latency_seconds_bucket{{{tok("true")},le="+Inf"}} {requests[0]}',
        f'sglang:e2e_request_latency_seconds_count{{{tok("true")}}} {requests[0]}',
        f'sglang:e2e_request_latency_seconds_sum{{{tok("true")}}} 41.5',
    ]
    if verify is not None:
        lines += ["# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.",
                  "# TYPE sglang:spec_verify_calls_total counter",
                  f'sglang:spec_verify_calls_total{{engine_type="unified",model_name="Qwen/Qwen3-8B"}} {verify}',
                  # another model behind the same /metrics (a router): not this run's
                  f'sglang:spec_verify_calls_total{{engine_type="unified",model_name="other"}} {other_model_verify}']
    return "\n".join(lines) + "\n"


def test_counters_from_an_sglang_server():
    """bench --endpoint against SGLang (--speculative-algorithm EAGLE3 --enable-metrics): rounds =
    the difference of sglang:spec_verify_calls_total, committed = that of generation tokens less
    one (prefill) token per request, so tau = the run's tokens per verify step; SGLang counts no
    proposed drafts: no acceptance rate, no positions; its acceptance gauges go along as read
    after the run, not differenced (2.9 / 0.48 here, not the run's 3.0)."""
    model = "Qwen/Qwen3-8B"
    before = counters_from_text(_sglang_metrics(), model=model)
    assert before["names"] == "sglang" and before["rounds"] == 300 and before["generation_tokens"] == 1000
    # the run: 4 streamed requests, 400 tokens (4 from their prefills), 132 verify steps
    after = counters_from_text(_sglang_metrics(gen=(1300.0, 100.0), requests=(12.0, 2.0), verify=432.0,
                                               accept_length=3.4, accept_rate=0.6, other_model_verify=9000.0),
                               model=model)
    d = diff_counters(before, after)
    assert d["source"].startswith("SGLang's /metrics") and "gauges" in d["source"]
    assert (d["proposed"], d["accepted"], d["rounds"], d["committed"]) == (None, None, 132, 396)
    assert d["generation_tokens"] == 400 and d["target_forwards"] == 132 + 4 and d["engine_steps"] is None
    assert d["position_proposed"] == [] and d["position_accepted"] == []
    assert d["gauges"] == {"sglang:spec_accept_length": [3.4], "sglang:spec_accept_rate": [0.6]}
    s = summarize([RunResult([_rec(i, 100, 1.0, 0.1) for i in range(4)], wall_s=1.0, counters=d)],
                  counts_from_endpoint=d)
    assert s["tau"] == pytest.approx(396 / 132) and s["acceptance_rate"] is None
    assert s["counts_source"].startswith("SGLang's /metrics")
    assert s["target_forwards_per_token"] == pytest.approx(136 / 400) and s["per_position_acceptance"] == []
    # without the model filter the other model's verify steps would be summed in
    assert counters_from_text(_sglang_metrics(), model=None)["rounds"] == 5300
    # the first speculative request finished during the run: no verify series before it (0)
    first = diff_counters(counters_from_text(_sglang_metrics(verify=None), model=model), after)
    assert first["rounds"] == 432 and first["committed"] == 396


def test_sglang_endpoint_through_tier_lines_and_report():
    """An SGLang configuration's line and report row: tau from the counters, acceptance None,
    the verdict and the markdown tables written without an acceptance rate."""
    from types import SimpleNamespace

    from draftsmith.bench.phases import Phase
    from draftsmith.bench.report import build_row
    from draftsmith.bench.report_markdown import headline_table
    from draftsmith.bench.tier_lines import phase_lines as _phase_lines

    model = "Qwen/Qwen3-8B"
    s0 = counters_from_text(_sglang_metrics(), model=model)
    s1 = counters_from_text(_sglang_metrics(gen=(1100.0, 100.0), requests=(10.0, 2.0), verify=350.0), model=model)
    s2 = counters_from_text(_sglang_metrics(gen=(1300.0, 100.0), requests=(12.0, 2.0), verify=400.0), model=model)
    units = [diff_counters(s0, s1), diff_counters(s1, s2)]  # two interleaving units: 198 / 50 and 198 / 50
    recs = [RequestRecord(index=i, prompt_id=f"p{i}", t_arrival=0.0, ttft=0.1, e2e=1.0, deliveries=[[0.1, 4]],
                          output_tokens=100, output_sha="a") for i in range(2)]
    plain = SimpleNamespace(label="none", kind="endpoint", info={})
    eagle = SimpleNamespace(label="eagle3", kind="endpoint", info={})
    missing = {"unavailable": "SGLang's /metrics has no sglang:spec_verify_calls_total counter"}
    runs = {"none": [RunResult(recs, wall_s=2.0, counters=missing)] * 2,
            "eagle3": [RunResult(recs, wall_s=1.0, counters=c) for c in units]}
    lines = _phase_lines(BenchConfig(endpoints=(parse_endpoint("none=http://a"), parse_endpoint("eagle3=http://b", 1))),
                         Phase("c2", 2, Arrival(), False, True), [plain, eagle], runs, {"none": {}, "eagle3": {}},
                         "t0", [0.0, 0.0, 0.0], "fp", False, lambda m: None)
    line = {ln["label"]: ln for ln in lines}["eagle3"]
    s = line["summary"]
    assert (s["rounds"], s["committed"], s["draft_proposed"], s["acceptance_rate"]) == (100, 396, None, None)
    assert s["tau"] == pytest.approx(3.96) and s["counts_source"].startswith("SGLang's /metrics")
    assert line["units"][0]["counters"]["gauges"]["sglang:spec_accept_length"] == [2.9]
    assert line["verdict"]["decision"] == "go"
    row = build_row(line, weights_bytes=None, bandwidth_gbs=None, dollars_per_hour=None)
    table = headline_table({"tiers": [{"concurrency": 2, "results": [row]}]})
    assert "| 2 | eagle3 |" in table and "| – | 3.96 |" in table


def test_sglang_counters_backwards_gauge_only_and_none():
    """Negative cases: counters that went backwards (a restart) give no difference; an SGLang
    without the verify counter (older, or nothing decoded speculatively) gives no counts, only its
    gauges named as such in the reason; a server with neither vLLM's nor SGLang's metrics, none."""
    model = "Qwen/Qwen3-8B"
    before = counters_from_text(_sglang_metrics(), model=model)
    restarted = counters_from_text(_sglang_metrics(gen=(40.0, 0.0), requests=(1.0, 0.0), verify=12.0), model=model)
    assert diff_counters(before, restarted) == {"unavailable": "the server's counters went backwards during the "
                                                               "run (restarted?)"}
    fewer_verify = counters_from_text(_sglang_metrics(gen=(1300.0, 100.0), requests=(12.0, 2.0), verify=299.0),
                                      model=model)
    assert "went backwards" in diff_counters(before, fewer_verify)["unavailable"]
    lost = counters_from_text(_sglang_metrics(gen=(1300.0, 100.0), requests=(12.0, 2.0), verify=None), model=model)
    assert "went backwards" in diff_counters(before, lost)["unavailable"]
    # gauge only: nothing differenced, nothing derived from the gauges
    old_before = counters_from_text(_sglang_metrics(verify=None), model=model)
    old_after = counters_from_text(_sglang_metrics(gen=(1300.0, 100.0), requests=(12.0, 2.0), verify=None,
                                                   accept_length=3.1, accept_rate=0.52), model=model)
    assert old_after["rounds"] is None
    d = diff_counters(old_before, old_after)
    assert set(d) == {"unavailable", "gauges"} and "no sglang:spec_verify_calls_total" in d["unavailable"]
    assert "sglang:spec_accept_length 3.1" in d["unavailable"] and "not this run" in d["unavailable"]
    # neither: no reading, and the reason names SGLang's metrics too
    plain = "# HELP process_resident_memory_bytes x\n# TYPE process_resident_memory_bytes gauge\n" \
            "process_resident_memory_bytes 1.2e9\nhttp_requests_total{path=\"/v1\"} 3.0\n"
    assert counters_from_text(plain, model=model) is None
    assert "sglang:*" in diff_counters(None, counters_from_text(plain))["unavailable"]


def test_sglang_metrics_as_prometheus_multiprocess_writes_them(tmp_path, monkeypatch):
    """The reading of what prometheus_client's multiprocess collector writes for SGLang (two
    tokenizer processes: their counters summed; a scheduler gauge kept per rank, mostrecent)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, values
    from prometheus_client.multiprocess import MultiProcessCollector

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    pid = {"now": 101}
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda: pid["now"]))
    tok = {"model_name": "m", "engine_type": "unified"}
    sched = {"model_name": "m", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
    gen = Counter("sglang:generation_tokens_total", "g", [*tok, "is_streaming"], registry=None)
    req = Counter("sglang:num_requests_total", "r", [*tok, "is_streaming"], registry=None)
    verify = Counter("sglang:spec_verify_calls_total", "v", list(tok), registry=None)
    length = Gauge("sglang:spec_accept_length", "l", list(sched), multiprocess_mode="mostrecent", registry=None)

    def scrape() -> dict:
        reg = CollectorRegistry()
        MultiProcessCollector(reg, path=str(tmp_path))
        return counters_from_text(generate_latest(reg).decode(), model="m")

    length.labels(**sched).set(1.0)  # (a series is written once set: the scheduler's first report)
    before = scrape()
    assert before["rounds"] is None and before["generation_tokens"] == 0
    for p, (tokens, steps) in ((101, (60, 20)), (102, (33, 10))):  # two tokenizer processes
        pid["now"] = p
        gen.labels(**tok, is_streaming="true").inc(tokens)
        req.labels(**tok, is_streaming="true").inc(1)
        verify.labels(**tok).inc(steps)
    length.labels(**dict(sched, dp_rank="1")).set(2.5)
    d = diff_counters(before, scrape())
    assert (d["rounds"], d["committed"], d["generation_tokens"], d["target_forwards"]) == (30, 91, 93, 32)
    assert d["gauges"] == {"sglang:spec_accept_length": [1.0, 2.5]}


# ---- the in-process load generator on a tiny model ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine_factory(tiny_model_dir):
    from draftsmith.drafters.registry import build_drafter
    from draftsmith.engine.engine import Engine, EngineConfig
    from draftsmith.models.target import eos_token_ids, load_target
    from draftsmith.policy.fixed import FixedK

    target = load_target(str(tiny_model_dir("llama", seed=5)))

    def make(drafter: str, max_batch: int):
        d = build_drafter(drafter, target, max_batch, 128)
        return Engine(target.model, target.tokenizer, d, FixedK(4 if drafter != "none" else 0),
                      EngineConfig(max_batch=max_batch, max_len=128), eos_token_ids=eos_token_ids(target))

    return target, make


def _requests(target, n, max_tokens=12):
    out = []
    for i in range(n):
        ids = target.tokenizer(f"abc abc abc {i} abc", add_special_tokens=False)["input_ids"]
        out.append(BenchRequest(i, f"p{i}", ({"role": "user", "content": "x"},), tuple(ids),
                                SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=i)))
    return out


def test_run_engine_closed_loop_records(tiny_engine_factory):
    target, make = tiny_engine_factory
    reqs = _requests(target, 5)
    done = []
    base = run_engine(make("none", 2), reqs, 2, None, done.append)
    spec = run_engine(make("ngram", 2), reqs, 2, None)
    assert len(done) == 5 and [r.index for r in base.records] == list(range(5))
    for res in (base, spec):
        for r in res.records:
            assert r.ok and 0 < r.ttft <= r.e2e and r.output_tokens == r.committed
            first = r.output_tokens - sum(n for _, n in r.deliveries)  # tokens that came with the first delivery
            assert first >= 1 and all(g >= 0 for g, _ in r.deliveries)
            assert r.target_forwards == r.rounds + 1  # prefill + one forward per round
        assert res.engine_steps <= res.batched_forwards <= 2 * res.engine_steps
    assert [r.output_sha for r in base.records] == [r.output_sha for r in spec.records]  # greedy: lossless
    assert all(r.proposed == 0 and r.rounds == r.output_tokens for r in base.records)
    s = summarize([spec])
    assert s["tau"] == pytest.approx(s["committed"] / s["rounds"]) and s["draft_proposed"] > 0
    for res in (base, spec):  # the decode phase: the steps' time less the engine's prefill time
        # prefill stops before a prompt's last token, so rounds deliver every output token
        assert res.decode_tokens == sum(r.output_tokens for r in res.records)
        assert res.decode_s > 0 and res.prefill_s > 0 and res.decode_s + res.prefill_s <= res.wall_s + 1e-9
        d = summarize([res])
        assert d["decode_tokens_per_s"] == pytest.approx(res.decode_tokens / res.decode_s)
        assert d["prefill_time_share"] == pytest.approx(res.prefill_s / res.wall_s)


def test_the_engine_times_its_prefill_apart_from_its_rounds(tiny_engine_factory):
    """engine.prefill_s grows only in steps that admit a request: a step of running rows alone
    adds nothing, however long it takes."""
    target, make = tiny_engine_factory
    engine = make("ngram", 2)
    (req,) = _requests(target, 1, max_tokens=6)
    assert engine.prefill_s == 0.0
    engine.add_request(list(req.token_ids), req.params)
    engine.step()  # admits (prefill) and runs the first round
    after_admit = engine.prefill_s
    assert after_admit > 0
    while engine.has_unfinished():
        engine.step()
    assert engine.prefill_s == after_admit


def test_summarize_pools_the_decode_phase_and_omits_it_where_unmeasured():
    a = RunResult([_rec(0, 10, 1.0, 0.1)], wall_s=1.0, decode_s=0.5, decode_tokens=8, prefill_s=0.4)
    b = RunResult([_rec(1, 10, 1.0, 0.1)], wall_s=2.0, decode_s=1.5, decode_tokens=6, prefill_s=0.5)
    s = summarize([a, b])
    assert s["decode_tokens_per_s"] == pytest.approx(14 / 2.0)  # pooled: tokens over time, not a mean of rates
    assert s["decode_tokens_per_s_per_unit"] == [pytest.approx(16.0), pytest.approx(4.0)]
    assert s["prefill_time_share"] == pytest.approx(0.9 / 3.0)
    # an endpoint run (or a peer) has no engine steps to split: nothing is made up
    s = summarize([a, RunResult([_rec(1, 10, 1.0, 0.1)], wall_s=2.0)])
    assert s["decode_tokens_per_s"] is None and s["decode_tokens_per_s_per_unit"] is None
    assert s["prefill_time_share"] is None


def test_decode_cells_print_the_ratio_and_its_spread_like_the_speedup_cells():
    from draftsmith.bench.report_markdown import decode_cell

    assert decode_cell({"kind": "baseline", "decode_tokens_per_s": 40.0, "decode_speedup": 1.0}) == "40.0"
    row = {"kind": "drafter", "decode_tokens_per_s": 50.0, "decode_speedup": 1.25,
           "decode_speedup_spread": {"n": 3, "median": 1.2, "min": 1.1, "max": 1.4}}
    assert decode_cell(row) == "50.0 (1.25×, 1.10–1.40, n=3)"
    assert decode_cell({**row, "decode_speedup_spread": {"n": 1, "min": 1.25, "max": 1.25}}) == "50.0 (1.25×, n=1)"
    assert decode_cell({"kind": "peer", "decode_tokens_per_s": None}) == "–"  # peers and servers: not measured


def test_run_engine_conversations_send_the_answer_in_the_next_turn(tiny_engine_factory):
    """A request with follow-up turns: each turn is a record; the next turn's prompt is
    tokenize(messages + the decoded answer + the next user message), sent by the same user
    (closed loop at concurrency 1: the two conversations' turns never overlap)."""
    target, make = tiny_engine_factory
    seen: list[list[dict]] = []

    def tokenize(msgs):
        seen.append(msgs)
        return target.tokenizer("\n".join(m["content"] for m in msgs), add_special_tokens=False)["input_ids"]

    reqs = [replace(r, followups=("and again?", "once more")) for r in _requests(target, 2, max_tokens=6)]
    engine = make("none", 1)
    res = run_engine(engine, reqs, 1, None, tokenize=tokenize)
    alone = make("none", 1)  # the first answer, decoded by the engine, is what the second turn carries
    seq = alone.add_request(list(reqs[0].token_ids), reqs[0].params)
    while alone.has_unfinished():
        alone.step()
    assert seen[0][-2]["content"] == alone.decode(seq.output_ids) and seq.output_ids
    assert [(r.index, r.turn) for r in res.records] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    by = {(r.index, r.turn): r for r in res.records}
    assert all(by[(i, t)].t_arrival >= by[(i, t - 1)].t_arrival + by[(i, t - 1)].e2e - 1e-9
               for i in (0, 1) for t in (1, 2))
    assert len(seen) == 4 and [m["content"] for m in seen[0]][-1] == "and again?"
    assert seen[0][-2]["role"] == "assistant" and seen[1][-1]["content"] == "once more"
    assert seen[1][:len(seen[0])] == seen[0]
    assert [r.prompt_tokens for r in res.records[:3]] == [len(reqs[0].token_ids), *(len(tokenize(m)) for m in seen[:2])]
    # the answer in the prompt is the engine's own decoding of the first turn's output
    first = run_engine(make("none", 1), reqs[:1], 1, None, tokenize=tokenize)
    assert first.records[0].output_sha == by[(0, 0)].output_sha
    # a turn that outgrows the context is a failed record, and the run goes on
    long = [replace(reqs[0], followups=("x " * 300,)), reqs[1]]
    res = run_engine(make("none", 1), long, 1, None, tokenize=tokenize)
    assert [(r.index, r.turn, r.ok) for r in res.records] == [(0, 0, True), (0, 1, False), (1, 0, True), (1, 1, True),
                                                             (1, 2, True)]
    assert res.records[1].error.startswith("turn 2: ") and res.records[1].prompt_tokens > 128
    with pytest.raises(DraftsmithError, match="need `tokenize`"):
        run_engine(make("none", 1), reqs, 1, None)
    nxt = next_turn(reqs[0], "ANSWER")
    assert nxt.turn == 1 and nxt.followups == ("once more",) and nxt.token_ids is None
    assert [m["content"] for m in nxt.messages][-2:] == ["ANSWER", "and again?"]


def test_conversations_keep_their_slot_under_poisson_arrivals(tiny_engine_factory):
    """Poisson arrivals with conversations, 2 slots, 3 conversations arriving at once: a
    conversation's next turn goes in when its previous answer ends, ahead of the third arrival,
    which waits for a whole conversation to end; with prefix caching the next turn finds its
    conversation's KV in the row it left."""
    from draftsmith.engine.engine import Engine, EngineConfig
    from draftsmith.models.target import eos_token_ids
    from draftsmith.drafters.registry import build_drafter
    from draftsmith.policy.fixed import FixedK

    target, _ = tiny_engine_factory
    engine = Engine(target.model, target.tokenizer, build_drafter("none", target, 2, 128), FixedK(0),
                    EngineConfig(max_batch=2, max_len=128, enable_prefix_caching=True),
                    eos_token_ids=eos_token_ids(target))
    tok = lambda msgs: target.tokenizer("\n".join(m["content"] for m in msgs), add_special_tokens=False)["input_ids"]  # noqa: E731
    msgs = [({"role": "user", "content": f"abc abc abc {i} abc"},) for i in range(3)]
    reqs = [replace(r, messages=m, token_ids=tuple(tok(list(m))), followups=("and again?",))
            for r, m in zip(_requests(target, 3, max_tokens=6), msgs)]
    res = run_engine(engine, reqs, 2, [0.0, 0.0, 0.0], tokenize=tok)
    by = {(r.index, r.turn): r for r in res.records}
    assert sorted(by) == [(i, t) for i in range(3) for t in (0, 1)] and all(r.ok for r in res.records)
    end = {k: r.t_arrival + r.e2e for k, r in by.items()}
    for i in (0, 1, 2):
        assert by[(i, 1)].t_arrival == pytest.approx(end[(i, 0)], abs=1e-6)
        assert by[(i, 1)].cached_tokens >= len(reqs[i].token_ids) - 2  # its first prompt, from the row it left
    first_token = by[(2, 0)].t_arrival + by[(2, 0)].ttft
    assert first_token >= min(end[(0, 1)], end[(1, 1)]) - 1e-6  # it waited for a conversation, not a turn


def test_turns_config_and_workload_errors(tmp_path):
    from draftsmith.bench.workload import load_workload

    with pytest.raises(DraftsmithError, match="--peers measures single-turn"):
        BenchConfig(turns=2, peers=("hf",))
    with pytest.raises(DraftsmithError, match="start the server with it"):
        BenchConfig(endpoints=(parse_endpoint("none=http://a"),), enable_prefix_caching=True)
    with pytest.raises(DraftsmithError, match="turns must be a positive integer"):
        BenchConfig(turns=0)
    for k in (0, 65, 1000):  # (K = 1000 profiled 1000-token verify blocks for minutes)
        with pytest.raises(DraftsmithError, match="num_speculative_tokens must be in 1..64"):
            BenchConfig(num_speculative_tokens=k)
    from draftsmith.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "-k", "1000"])
    assert build_parser().parse_args(["bench", "-k", "64"]).num_speculative_tokens == 64
    assert BenchConfig(turns=2).fingerprint(["p"], "h") != BenchConfig().fingerprint(["p"], "h")
    # runs written before --turns resume: the default fingerprint has no new keys, old records load
    assert not {"turns", "enable_prefix_caching"} & set(BenchConfig().fingerprint(["p"], "h"))
    old = RequestRecord.from_json({"index": 0, "prompt_id": "p", "t_arrival": 0.0, "ttft": 0.1, "e2e": 1.0,
                                   "deliveries": [], "output_tokens": 3, "output_sha": "s", "finish_reason": "length",
                                   "error": None, "proposed": None, "accepted": None, "rounds": None,
                                   "committed": None, "target_forwards": None, "proposed_at": [], "accepted_at": []})
    assert old.turn == 0 and old.prompt_tokens is None and "by_turn" not in summarize([RunResult([old], 1.0)])
    single = tmp_path / "single.jsonl"
    single.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    with pytest.raises(DraftsmithError, match="has a second user turn"):
        load_workload(str(single), None, 2, turns=2)
    multi = tmp_path / "multi.jsonl"
    multi.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "u1"}, {"role": "user",
                     "content": "u2"}, {"role": "user", "content": "u3"}]}) + "\n"
                     + json.dumps({"id": "b", "prompt": "only one"}) + "\n"
                     + json.dumps({"id": "c", "messages": [{"role": "user", "content": "u1"}, {"role": "user",
                                   "content": "v"}]}) + "\n")
    wl = load_workload(str(multi), None, 4, turns=2)
    assert [p.followups for p in wl.prompts] == [("u2",), (), ("v",), ("u2",)] and wl.total_turns == 7
    tok = lambda msgs: list(range(sum(len(m["content"]) + 2 for m in msgs)))  # noqa: E731  (4 tokens for "u1")
    wl = load_workload(str(multi), None, 2, tokenize=tok, max_prompt_tokens=20, turns=3, answer_tokens=10)
    # a: 4 + (2 + 4) + (2 + 4) template tokens + 2 answers of 10 = 36 > 20; c: 4 + 2 + 3 + 10 = 19
    assert [(p.id, p.longest_prompt) for p in wl.prompts] == [("file:multi.jsonl/b", 10), ("file:multi.jsonl/c", 19)]
    assert wl.skipped == [{"id": "file:multi.jsonl/a", "reason": "turn 3's prompt could reach 36 tokens > 20"}]


def test_goodput_counts_requests_meeting_every_slo():
    from draftsmith.bench.config import parse_goodput
    from draftsmith.bench.report import goodput

    assert parse_goodput(["ttft:500", "tpot:50"]) == (("ttft", 500.0), ("tpot", 50.0))
    assert parse_goodput("e2el:2000,ttft:1e3") == (("e2el", 2000.0), ("ttft", 1000.0))
    for bad, why in (("ttft", "METRIC:MILLISECONDS"), ("itl:5", "METRIC:MILLISECONDS"), ("tpot:-1", "positive"),
                     ("ttft:1 ttft:2", "twice")):
        with pytest.raises(DraftsmithError, match=why):
            parse_goodput(bad)
    with pytest.raises(DraftsmithError, match="METRIC:MILLISECONDS"):
        BenchConfig(goodput=(("ttfb", 5.0),))
    with pytest.raises(DraftsmithError, match="at least one"):
        parse_goodput([""])
    for given in (("ttft:500",), {"ttft": 500}, (("ttft", 500),), "ttft:500"):
        assert BenchConfig(goodput=given).goodput == (("ttft", 500.0),)
    assert BenchConfig(goodput=(("ttft", 5.0),)).fingerprint(["p"], "h") == BenchConfig().fingerprint(["p"], "h")

    def rec(ttft, e2e, n, error=None):
        return {"ttft": ttft, "e2e": e2e, "output_tokens": n, "error": error}

    recs = [rec(0.2, 1.2, 21),   # ttft 200 ms, tpot 50 ms: meets both
            rec(0.6, 1.6, 21),   # ttft 600 ms: misses ttft
            rec(0.1, 2.1, 21),   # tpot 100 ms: misses tpot
            rec(0.3, 0.3, 1),    # one token: no tpot to miss
            rec(None, None, 0, error="HTTP 500")]  # failed: meets none
    g = goodput(recs, 2.0, {"ttft": 500.0, "tpot": 50.0})
    assert (g["met"], g["requests"], g["fraction"], g["requests_per_s"]) == (2, 5, 0.4, 1.0)
    assert goodput(recs, 2.0, {"e2el": 1500.0})["met"] == 2  # 1.2 s and 0.3 s
    assert goodput(recs, 2.0, {"ttft": 1e9, "tpot": 1e9, "e2el": 1e9})["met"] == 4


def test_run_engine_poisson_arrivals(tiny_engine_factory):
    target, make = tiny_engine_factory
    reqs = _requests(target, 4, max_tokens=6)
    offsets = [0.0, 0.02, 0.04, 0.3]
    res = run_engine(make("none", 1), reqs, 1, offsets)
    for r, off in zip(res.records, offsets):
        assert r.t_arrival == pytest.approx(off) and r.ttft <= r.e2e
    assert res.wall_s >= 0.3  # the last request cannot arrive before its offset
    # with one row, a request arriving while another runs queues: its TTFT includes the wait
    assert all(math.isfinite(r.e2e) for r in res.records)


# ---- tier lines: an endpoint without counters; Poisson arrivals through run_bench ------------------


def test_endpoint_without_counters_reports_unavailable():
    from types import SimpleNamespace

    from draftsmith.bench.phases import Phase
    from draftsmith.bench.tier_lines import phase_lines as _phase_lines

    def run(tps_scale: float, sha: str, counters):
        recs = [RequestRecord(index=i, prompt_id=f"p{i}", t_arrival=0.0, ttft=0.1, e2e=1.0 / tps_scale,
                              deliveries=[[0.1, 4]], output_tokens=5, output_sha=sha) for i in range(2)]
        return RunResult(recs, wall_s=2.0 / tps_scale, counters=counters)

    none = SimpleNamespace(label="none", kind="endpoint", info={})
    other = SimpleNamespace(label="vllm", kind="endpoint", info={})
    missing = {"unavailable": "the server exposes no draftsmith_* counters on /metrics"}
    runs = {"none": [run(1.0, "a", missing)], "vllm": [run(1.5, "a", missing)]}
    lines = _phase_lines(BenchConfig(endpoints=(parse_endpoint("none=http://a"), parse_endpoint("vllm=http://b", 1))),
                         Phase("c2", 2, Arrival(), False, True), [none, other], runs, {"none": {}, "vllm": {}},
                         "t0", [0.0, 0.0, 0.0], "fp", False, lambda m: None)
    v = {ln["label"]: ln for ln in lines}["vllm"]
    assert v["summary"]["acceptance_rate"] is None and v["summary"]["tau"] is None
    assert v["summary"]["counts_source"].startswith("unavailable: the server exposes no draftsmith_")
    assert v["speedup"] == pytest.approx(1.5) and v["equality"]["mismatches"] == 0
    assert v["verdict"]["decision"] == "go"  # speed alone decides when acceptance is unknown


def test_hf_peer_loads_without_a_progress_bar_in_a_log(tiny_model_dir, capsys):
    """Issue 15: stderr not a terminal (capsys: a log file): transformers' "Loading weights"
    bar would land there as `\r`-joined redraws; it is off, and its switch is restored."""
    from transformers.utils import logging as hf_logging

    from draftsmith.bench.peers import _load_hf

    path = tiny_model_dir("llama", seed=7)
    capsys.readouterr()  # (making the tiny model draws a bar of its own)
    enabled = hf_logging.is_progress_bar_enabled()
    _load_hf(path, torch.device("cpu"), torch.float32)
    err = capsys.readouterr().err
    assert "\r" not in err and "Loading weights" not in err, err[-300:]
    assert hf_logging.is_progress_bar_enabled() == enabled


def test_run_bench_poisson_tier(tiny_model_dir, tmp_path):
    from draftsmith.bench import run_bench

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"x{i}", "prompt": f"x = {i}; x = {i}; x ="}) + "\n" for i in range(3)))
    cfg = BenchConfig(target=str(tiny_model_dir("llama", seed=7)), drafters=("ngram",), workload=str(prompts),
                      concurrency=(2,), requests=3, max_tokens=8, warmup=0, arrival=parse_arrival("poisson:50"),
                      out=tmp_path / "out", progress=False)
    rep = json.loads(run_bench(cfg, log=lambda m: None).read_text())
    (tier,) = rep["tiers"]
    assert tier["arrival"] == "poisson:50" and rep["setup"]["arrival"] == "poisson:50"
    expected = poisson_offsets(3, 50.0, seed=0 * 7919 + 2)
    for r in tier["results"]:
        assert [x["t_arrival"] for x in r["per_request"]] == pytest.approx(expected, abs=1e-6)
        assert r["interleaving"]["unit"] == "request list"


def test_control_is_plain_decoding_measured_again_and_reported_as_the_noise(tiny_model_dir, tmp_path):
    """`--control` (the A/A control): plain decoding runs a second time as a configuration of its
    own, interleaved with the others; its outputs are checked like a drafter's, its verdict is
    "control", and the headline reports its ratio as the run's noise."""
    from draftsmith.bench import run_bench
    from draftsmith.bench.config import CONTROL

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"x{i}", "prompt": f"x = {i}; x = {i}; x ="}) + "\n" for i in range(3)))
    cfg = BenchConfig(target=str(tiny_model_dir("llama", seed=7)), drafters=("ngram",), workload=str(prompts),
                      concurrency=(1,), requests=3, max_tokens=8, warmup=0, control=True, out=tmp_path / "out",
                      progress=False, goodput=(("ttft", 1e7), ("tpot", 1e7)))
    assert cfg.config_labels == ("none", "ngram", CONTROL)
    rep = json.loads(run_bench(cfg, log=lambda m: None).read_text())
    (tier,) = rep["tiers"]
    rows = {r["label"]: r for r in tier["results"]}
    ctl = rows[CONTROL]
    assert ctl["kind"] == "control" and ctl["verdict"]["decision"] == "control"
    assert ctl["equality"]["checked"] and ctl["equality"]["compared"] == 3 and ctl["equality"]["mismatches"] == 0
    assert ctl["speedup"] is not None and ctl["speedup_spread"]["n"] == 3  # one ratio per interleaved request
    assert ctl["draft_proposed"] == 0 and rows["ngram"]["verdict"]["decision"] in ("go", "no-go")
    (line,) = [h for h in rep["headline"] if h.startswith("A/A control")]
    assert "concurrency 1:" in line and not any(h.startswith(CONTROL) for h in rep["headline"])
    assert "**control**" in (tmp_path / "out" / "report.md").read_text()
    # --goodput with SLOs every request meets: goodput = requests / wall, its ratio to the baseline's
    for r in tier["results"]:
        g = r["goodput"]
        assert g["met"] == g["requests"] == 3 and g["requests_per_s"] == pytest.approx(3 / r["wall_s"])
        if r["label"] != "none":
            assert g["vs_baseline"] == pytest.approx(rows["none"]["wall_s"] / r["wall_s"])
    assert any(h.startswith("goodput (ttft ≤ 1e+07 ms, tpot ≤ 1e+07 ms)") for h in rep["headline"])
    assert "| config | goodput req/s (ttft ≤ 1e+07 ms, tpot ≤ 1e+07 ms) |" in (tmp_path / "out" / "report.md").read_text()
    assert [d["label"] for d in rep["setup"]["drafters"]] == ["none", "ngram", CONTROL]


def test_control_is_refused_where_it_cannot_run():
    with pytest.raises(DraftsmithError, match="--control measures the in-process"):
        BenchConfig(endpoints=(parse_endpoint("none=http://a"),), control=True)
    with pytest.raises(DraftsmithError, match="not a drafter"):
        BenchConfig(drafters=("ngram", "control"))
    assert BenchConfig(control=True).fingerprint(["p"], "h") != BenchConfig().fingerprint(["p"], "h")


# ---- --json-schema: structured traffic ------------------------------------------------------

RECORD = {"type": "object", "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["x", "ok"], "additionalProperties": False}


def test_json_schema_config_errors_and_fingerprint():
    with pytest.raises(DraftsmithError, match="--json-schema is not JSON"):
        BenchConfig(json_schema="{nope")
    with pytest.raises(DraftsmithError, match="must be a JSON object"):
        BenchConfig(json_schema="[1, 2]")
    with pytest.raises(DraftsmithError, match="cannot be combined with --peers"):
        BenchConfig(json_schema=json.dumps(RECORD), peers=("hf",))
    cfg = BenchConfig(json_schema=json.dumps(RECORD))
    assert cfg.schema == RECORD and cfg.fingerprint(["p"], "h")["json_schema"] == RECORD
    assert "json_schema" not in BenchConfig().fingerprint(["p"], "h")


def test_bench_with_a_json_schema_constrains_every_request(tiny_model_dir, tmp_path, monkeypatch):
    """In-process: every request (warm-up included) carries the schema as structured outputs, the
    answers keep to it, and the report says so."""
    from draftsmith.bench import run_bench
    from draftsmith.engine.engine import Engine

    seen = []
    real = Engine.add_request

    def spy(self, prompt_ids, params, *a, **kw):
        seen.append(params.structured_outputs)
        req = real(self, prompt_ids, params, *a, **kw)
        outputs.append(req)
        return req

    outputs: list = []
    monkeypatch.setattr(Engine, "add_request", spy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"x{i}", "prompt": f"x = {i}; ok ="}) + "\n" for i in range(3)))
    cfg = BenchConfig(target=str(tiny_model_dir("llama", seed=7)), drafters=("ngram",), workload=str(prompts),
                      concurrency=(1,), requests=3, max_tokens=24, warmup=1, out=tmp_path / "out", progress=False,
                      json_schema=json.dumps(RECORD))
    rep = json.loads(run_bench(cfg, log=lambda m: None).read_text())
    assert len(seen) == 2 * (3 + 1) and all(so is not None and json.loads(so.json) == RECORD for so in seen)
    from draftsmith.core.structured import Grammars, StructuredOutputsParams
    from draftsmith.models.target import load_target

    target = load_target(cfg.target)
    g = Grammars(target.tokenizer, target.model.config.vocab_size, [target.tokenizer.eos_token_id])
    for req in outputs:  # each answer is a prefix of a record the schema allows, whole where it stopped
        assert len(req.output_ids) > 3
        assert g.matcher(StructuredOutputsParams(json=RECORD)).validate_tokens(req.output_ids) == len(req.output_ids)
        if req.finish_reason == "stop":
            rec = json.loads(req.text)
            assert set(rec) == {"x", "ok"} and isinstance(rec["x"], int) and isinstance(rec["ok"], bool)
    assert rep["setup"]["sampling"]["json_schema"] == RECORD
    assert "every answer keeps to a JSON schema" in (tmp_path / "out" / "report.md").read_text()


def test_endpoint_requests_ask_for_the_schema_as_response_format():
    import asyncio

    import httpx

    from draftsmith.bench.loadgen import _stream_one
    from draftsmith.core.structured import StructuredOutputsParams

    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunk = {"choices": [{"index": 0, "delta": {"content": "{}"}, "finish_reason": "stop"}]}
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    req = BenchRequest(0, "p0", ({"role": "user", "content": "hi"},), [1, 2],
                       SamplingParams(max_tokens=4, temperature=0.0, seed=3,
                                      structured_outputs=StructuredOutputsParams(json=json.dumps(RECORD))))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await _stream_one(client, "http://x/v1", "m", req, 0.0, 0.0)

    rec, text = asyncio.run(go())
    assert rec.error is None and text == "{}"
    assert bodies[0]["response_format"] == {"type": "json_schema", "json_schema": {"name": "bench", "schema": RECORD}}
    plain = replace(req, params=SamplingParams(max_tokens=4, temperature=0.0))
    bodies.clear()

    async def go_plain():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await _stream_one(client, "http://x/v1", "m", plain, 0.0, 0.0)

    asyncio.run(go_plain())
    assert "response_format" not in bodies[0]


# ---- bad input: --endpoint and --out, refused before anything is measured or written -------------

from http.server import SimpleHTTPRequestHandler  # noqa: E402

from fake_http import JsonHandler, serve as _serve  # noqa: E402


class _Quiet(SimpleHTTPRequestHandler):
    """A plain web server (python -m http.server), no access log."""

    def log_message(self, *a):
        pass


class _Server(JsonHandler):
    """An OpenAI-compatible server listing the model `m`: a chat request for another model is its
    404; with `fail` every request for `m` is a 500 (a server that breaks after the probe)."""

    fail = False

    def do_GET(self):
        if self.path != "/v1/models":
            return self.send_error(404)
        self._send(200, {"object": "list", "data": [{"id": "m"}]})

    def do_POST(self):
        req = self.read_json()
        if req["model"] != "m":
            return self._send(404, {"error": {"message": f"The model `{req['model']}` does not exist."}})
        if self.fail:
            return self._send(500, {"error": {"message": "the engine died"}})
        self._send(200, {"choices": [{"index": 0, "finish_reason": "length",
                                      "message": {"role": "assistant", "content": "ok"}}]})


def _bench_argv(tmp_path, url, *more):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x0", "prompt": "hi"}) + "\n")
    return ["bench", "--endpoint", url, "--workload", str(prompts), "--concurrency", "1", "--requests", "1",
            "--warmup", "0", "--max-tokens", "2", "--no-table", "--no-progress", "--out", str(tmp_path / "b"), *more]


def test_an_endpoint_that_is_no_openai_server_or_lacks_the_model_is_one_line(tmp_path, capsys):
    """bench --endpoint at a plain web server printed httpx's two-line error (404 ... For more
    information check: ...); --endpoint-model naming a model the server lacks ran, failed every
    request without a reason and exited 0. Now one line each, before --out is created."""
    from draftsmith.cli import main

    web, web_url = _serve(lambda *a, **k: _Quiet(*a, directory=str(tmp_path), **k))
    srv, url = _serve(_Server)
    try:
        for argv, says in (
                ([web_url], f"--endpoint {web_url}/v1: GET {web_url}/v1/models answered HTTP 404 (File not found), "
                            "so there is no model name to send; give an OpenAI-compatible server's URL"),
                ([web_url, "--endpoint-model", "m"], f"--endpoint {web_url}/v1: POST {web_url}/v1/chat/completions "
                                                     "answered HTTP 501"),
                ([url, "--endpoint-model", "x"], "answered HTTP 404 ({\"error\": {\"message\": \"The model `x` does "
                                                 "not exist.\"}})")):
            capsys.readouterr()
            assert main(_bench_argv(tmp_path, *argv)) == 2
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and err.startswith("draftsmith: error: ") and says in err, err
            assert not (tmp_path / "b").exists()
    finally:
        for s in (web, srv):
            s.shutdown()
            s.server_close()


def test_a_bench_in_which_every_request_failed_is_an_error_with_the_first_reason(tmp_path, capsys):
    """A server that answers the probe but fails every request: 'bench: report -> ...' and exit 0,
    the reason only inside the report; now the report, then the first reason in one line, exit 2."""
    from draftsmith.cli import main

    srv, url = _serve(_Server)
    _Server.fail = True
    try:
        assert main(_bench_argv(tmp_path, url)) == 2
    finally:
        _Server.fail = False
        srv.shutdown()
        srv.server_close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("draftsmith: error: every request failed (1); the first: HTTP 500: ")
    assert "the engine died" in err[-1] and err[-1].endswith(f"(all in {tmp_path / 'b' / 'report.json'})")
    assert (tmp_path / "b" / "report.json").is_file()


@pytest.mark.parametrize("files,what", [
    (("checkpoint-00000002/", "metrics.jsonl", "config.json", "model.safetensors"), r"a training run \(checkpoint-00000002\)"),
    (("report.json", "report.md", "rounds-ngram.jsonl"), r"an eval report \(rounds-ngram\.jsonl\)"),
    (("regen.jsonl", "regen.jsonl.errors.jsonl"), r"a data file \(a regen output or prompts\) \(regen\.jsonl\)"),
    (("manifest.json", "shard-00000.safetensors"), r"a feature cache \(manifest\.json\)"),
])
@pytest.mark.parametrize("flag", [(), ("--overwrite",), ("--resume",)])
def test_out_that_is_another_jobs_directory_is_refused(tmp_path, capsys, files, what, flag):
    """bench --out DIR where DIR is a train run, an eval report, a regen output's directory or a
    feature cache wrote report.json / report.md / PNGs among its files (--overwrite deleted an
    eval's report.json and report.md first). Refused before the endpoint is asked (nothing listens)."""
    from draftsmith.cli import main

    out = tmp_path / "job"
    out.mkdir()
    for name in files:
        (out / name).mkdir() if name.endswith("/") else (out / name).write_text("x")
    before = sorted(p.name for p in out.iterdir())
    assert main(["bench", "--endpoint", "http://127.0.0.1:9", "--out", str(out), *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(rf"--out {re.escape(str(out))} holds {what}, another job's output; bench would write its "
                     r"files among it\. Give a new or empty directory$", err), err
    assert sorted(p.name for p in out.iterdir()) == before and (out / files[-1]).exists()
