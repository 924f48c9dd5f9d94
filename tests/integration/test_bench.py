"""`draftsmith bench` end to end on tiny models (no wall-clock assertions; docs/MEASURING.md #7).

- In process: 2 tiers, none + ngram, HF peers (generate, prompt lookup, assistant): every
  report field is present, the numbers are consistent with each other and with the raw
  records (tokens/s × wall = tokens, τ = committed / rounds, P50 ≤ P95 ≤ P99, cost formula),
  greedy speculative outputs equal the baseline's, the PNGs are valid and non-empty.
- `--endpoint`: the same load generator against two of the project's servers on loopback
  (plain and n-gram); acceptance and τ come from their /metrics.
- `--turns 2`: each request a conversation whose second turn carries the first answer, in process
  (prefix caching on) and against servers; records, equality and prefix-cache counts per turn.
- A bench subprocess SIGKILLed after its first tier is on disk keeps that tier; `--resume`
  runs only the rest (and drops a torn line).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from waiting import wait_until  # tests/waiting.py

from draftsmith.bench import BenchConfig, run_bench
from draftsmith.bench.config import parse_endpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PCT = ("p50", "p95", "p99")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _prompts(tmp_path: Path, n: int = 6) -> Path:
    p = tmp_path / "prompts.jsonl"
    rows = [{"id": f"q{i}", "prompt": f"def add{i}(a, b): return a + b\ndef add{i}(a, b):"} for i in range(n)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    assert w > 100 and h > 100
    from PIL import Image

    with Image.open(path) as im:
        im.verify()


def _check_dist(d: dict) -> None:
    assert d["n"] > 0 and d["p50"] is not None
    assert d["p50"] <= d["p95"] <= d["p99"] <= d["max"] + 1e-12


def _check_row_consistency(r: dict) -> None:
    assert r["system_tokens_per_s"] * r["wall_s"] == pytest.approx(r["output_tokens"])
    assert r["output_tokens"] == sum(x["output_tokens"] for x in r["per_request"])
    for k in ("ttft_s", "itl_s", "e2e_s", "tpot_s"):
        _check_dist(r[k])
    for x in r["per_request"]:
        assert 0 < x["ttft"] <= x["e2e"]


def test_bench_tiny_end_to_end(tiny_model_dir, tmp_path):
    tiny = tiny_model_dir("llama", seed=21)
    assistant = tiny_model_dir("llama", seed=22, num_hidden_layers=1)
    out = tmp_path / "out"
    cfg = BenchConfig(target=str(tiny), drafters=("ngram",), policy="fixed", workload=str(_prompts(tmp_path)), concurrency=(1, 2),
                      requests=3, max_tokens=16, warmup=1, peers=("hf",), peer_assistant=str(assistant),
                      dollars_per_hour=2.5, out=out, progress=False)
    path = run_bench(cfg, log=lambda m: None)
    assert path == out / "report.json"
    rep = json.loads(path.read_text())

    # setup: versions, machine, load, model hash, drafters, prompts and split
    st = rep["setup"]
    assert {"draftsmith", "torch", "transformers", "python"} <= set(st["versions"])
    assert st["machine"]["cpu_count"] >= 1 and st["machine"]["cpu_model"] and st["machine"]["torch_threads"] >= 1
    assert len(rep["machine_load"]["loadavg_start"]) == 3 and len(rep["machine_load"]["loadavg_end"]) == 3
    assert st["target"]["weights_hash"] and st["target"]["parameters"] > 0
    assert [d["label"] for d in st["drafters"]] == ["none", "ngram"] and all("checkpoint" in d for d in st["drafters"])
    assert st["workload"]["split"] == "all" and len(st["workload"]["prompt_ids"]) == 3
    assert st["sampling"]["temperature"] == 0.0 and st["sampling"]["max_tokens"] == 16

    # tiers: every field, consistent numbers
    assert [t["concurrency"] for t in rep["tiers"]] == [1, 2]
    for t in rep["tiers"]:
        rows = {r["label"]: r for r in t["results"]}
        assert list(rows) == ["none", "ngram"]
        base, ng = rows["none"], rows["ngram"]
        for r in (base, ng):
            _check_row_consistency(r)
            assert r["per_user_tokens_per_s"]["mean"] > 0 and r["per_user_tokens_per_s"]["min"] > 0
            assert r["tau"] == pytest.approx(r["committed"] / r["rounds"])
            assert r["committed"] == r["output_tokens"]
            assert r["target_forwards_per_token"] == pytest.approx(r["target_forwards"] / r["output_tokens"])
            assert r["engine_steps_per_token"] > 0
            m = r["memory"]
            assert m["rss_bytes"] > 0 and m["kv_cache_bytes"] > 0 and m["kv_headroom_tokens"] > 0
            assert r["cost_per_1m_output_tokens"] == pytest.approx(2.5 / 3600 / r["system_tokens_per_s"] * 1e6)
            assert r["bandwidth_bound_tokens_per_s"] > 0 and r["fraction_of_bound"] > 0
            assert r["verdict"]["decision"] and r["verdict"]["reason"]
            assert r["loadavg_start"] and r["loadavg_end"]
        assert base["verdict"]["decision"] == "baseline" and base["acceptance_rate"] is None and base["tau"] == 1.0
        assert ng["draft_proposed"] > 0 and ng["acceptance_rate"] == pytest.approx(ng["draft_accepted"] / ng["draft_proposed"])
        assert ng["equality"] == {"checked": True, "compared": 3, "mismatches": 0, "mismatched_prompts": [],
                                  "against": "none"}
        assert ng["void"] is False
        assert ng["speedup"] == pytest.approx(ng["system_tokens_per_s"] / base["system_tokens_per_s"])
        assert ng["decode_speedup"] == pytest.approx(ng["decode_tokens_per_s"] / base["decode_tokens_per_s"])
        assert base["decode_speedup"] == 1.0 and 0 < base["prefill_time_share"] < 1
        assert ng["speedup_spread"]["n"] == (3 if t["concurrency"] == 1 else 1)  # per request at c1, else per run
        assert ng["per_request_speedup"]["n"] == 3
        expected = "no-go" if ng["speedup"] < 1 else "go"
        assert ng["verdict"]["decision"] == expected
        assert len(ng["per_position_acceptance"]) >= 1
    assert {(v["concurrency"], v["label"]) for v in rep["verdicts"]} == {(1, "none"), (1, "ngram"), (2, "none"), (2, "ngram")}
    assert any(h.startswith("ngram:") for h in rep["headline"])
    assert rep["acceptance_per_position"]["ngram"]

    # peers at concurrency 1 on the same prompts, measured inside tier 1
    peers = {p["label"]: p for p in rep["peers"]["peers"]}
    assert rep["peers"]["phase"] == "c1" and set(peers) == {"hf:generate", "hf:prompt-lookup", "hf:assistant"}
    for p in peers.values():
        assert p["system_tokens_per_s"] > 0 and set(p["ours_vs_peer"]) == {"none", "ngram"}
        _check_dist(p["e2e_s"])
        # HF greedy on the same weights gives the same tokens as our plain decoding
        assert p["same_output_as_our_baseline"]["equal"] == p["same_output_as_our_baseline"]["compared"] == 3

    # files
    for name in ("throughput_vs_concurrency.png", "latency_percentiles.png", "acceptance_per_position.png"):
        _check_png(out / name)
    md = (out / "report.md").read_text()
    for s in ("## Headline", "## Concurrency 1 (closed)", "## Concurrency 2 (closed)", "## Peers", "hf:assistant",
              "**baseline**", "## Per-position acceptance", "split **all**"):
        assert s in md
    width = None  # every table row has as many cells as its header (issue 15: 5 cells under 7 columns)
    for ln in md.splitlines():
        if not ln.startswith("|"):
            width = None
            continue
        cells = ln.count("|") - 1
        width = cells if width is None else width
        assert cells == width, ln
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((x["phase"], x["label"]) for x in lines) == sorted(
        [("c1", lab) for lab in ("none", "ngram", "hf:generate", "hf:prompt-lookup", "hf:assistant")]
        + [("c2", "none"), ("c2", "ngram")])


class _ThreadServer:
    def __init__(self, app) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), timeout=60,
                   message="the server did not start")
        assert self.server.started, "the server thread ended before the server started"
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_bench_endpoint_mode_against_our_servers(tiny_model_dir, tmp_path):
    from draftsmith.api import LLM
    from draftsmith.server.app import create_app

    tiny = str(tiny_model_dir("llama", seed=23))
    plain = LLM(tiny, drafter="none", max_batch=4, max_len=256)
    spec = LLM(tiny, drafter="ngram", policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=256)
    out = tmp_path / "out"
    with _ThreadServer(create_app(plain)) as u1, _ThreadServer(create_app(spec)) as u2:
        cfg = BenchConfig(workload=str(_prompts(tmp_path)), concurrency=(1, 2), requests=3, max_tokens=12, warmup=1,
                          endpoints=(parse_endpoint(f"none={u1}", 0), parse_endpoint(f"ngram={u2}/v1", 1)),
                          out=out, progress=False)
        rep = json.loads(run_bench(cfg, log=lambda m: None).read_text())
    assert rep["setup"]["mode"] == "endpoint" and rep["setup"]["target"]["served_models"]["ngram"] == Path(tiny).name
    for t in rep["tiers"]:
        rows = {r["label"]: r for r in t["results"]}
        base, ng = rows["none"], rows["ngram"]
        for r in (base, ng):
            _check_row_consistency(r)
            assert r["errors"] == 0 and r["counts_source"].startswith("server /metrics")
            assert r["tau"] == pytest.approx(r["committed"] / r["rounds"])
            # usage-reported tokens match the server's own generation counter difference
            assert r["output_tokens"] == sum(x["output_tokens"] for x in r["per_request"])
        assert base["draft_proposed"] == 0 and base["tau"] == pytest.approx(1.0)
        assert base["verdict"]["decision"] == "baseline"
        assert ng["draft_proposed"] > 0 and 0 <= ng["acceptance_rate"] <= 1 and ng["tau"] >= 1
        assert ng["equality"]["checked"] and ng["equality"]["mismatches"] == 0 and ng["equality"]["compared"] == 3
        assert ng["verdict"]["decision"] in ("go", "no-go")
    for name in ("throughput_vs_concurrency.png", "latency_percentiles.png", "acceptance_per_position.png"):
        _check_png(out / name)


def _conversations(tmp_path: Path, n: int = 3) -> Path:
    p = tmp_path / "chats.jsonl"
    rows = [{"id": f"c{i}", "messages": [
        {"role": "user", "content": f"def add{i}(a, b): return a + b\ndef add{i}(a, b):"},
        {"role": "assistant", "content": "(replaced by the target's answer)"},
        {"role": "user", "content": f"and sub{i}? def sub{i}(a, b):"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "a third turn --turns 2 leaves out"}]} for i in range(n)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _check_turns(r: dict, requests: int) -> dict[tuple[int, int], dict]:
    """Both turns of every request recorded; the second's prompt holds the first's."""
    recs = {(x["index"], x["turn"]): x for x in r["per_request"]}
    assert sorted(recs) == [(i, t) for i in range(requests) for t in (0, 1)]
    for i in range(requests):
        first, second = recs[(i, 0)], recs[(i, 1)]
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["output_tokens"] // 2
    (t1, t2) = r["by_turn"]
    assert (t1["turn"], t2["turn"]) == (1, 2) and t1["requests"] == t2["requests"] == requests
    assert t2["prompt_tokens"] == sum(recs[(i, 1)]["prompt_tokens"] for i in range(requests))
    return recs


def test_bench_turns_in_process_with_prefix_caching(tiny_model_dir, tmp_path):
    """--turns 2 --enable-prefix-caching in process: a conversation's second turn finds its first
    turn's prompt and answer in the prefix cache; every run starts with nothing cached (at
    concurrency 1 a run is one conversation: its first turn reuses nothing, whatever ran before);
    greedy outputs of every turn equal the baseline's."""
    out = tmp_path / "out"
    cfg = BenchConfig(target=str(tiny_model_dir("llama", seed=23)), drafters=("ngram",),
                      workload=str(_conversations(tmp_path)), concurrency=(1, 2), requests=3, max_tokens=10, warmup=1,
                      turns=2, enable_prefix_caching=True, control=True, out=out, progress=False)
    rep = json.loads(run_bench(cfg, log=lambda m: None).read_text())
    assert rep["setup"]["workload"]["turns"] == 2 and rep["setup"]["workload"]["total_turns"] == 6
    assert rep["setup"]["prefix_caching"] is True
    for t in rep["tiers"]:
        for r in t["results"]:
            _check_row_consistency(r)
            recs = _check_turns(r, 3)
            t1, t2 = r["by_turn"]
            assert 0 < t2["cached_tokens"] <= t2["prompt_tokens"]
            for i in range(3):  # most of turn 2's prompt (turn 1's prompt at least) came from the cache
                assert recs[(i, 1)]["cached_tokens"] >= recs[(i, 0)]["prompt_tokens"] - 2
            if t["concurrency"] == 1:
                assert t1["cached_tokens"] == 0
            if r["label"] != "none":
                assert r["equality"]["compared"] == 6 and r["equality"]["mismatches"] == 0
    md = (out / "report.md").read_text()
    assert "| config | turn | requests | TTFT ms P50/P95/P99 | prompt tokens | cached by the prefix cache |" in md
    assert "conversation of up to 2 user turns" in md


def test_bench_turns_against_servers(tiny_model_dir, tmp_path):
    """--turns 2 over HTTP: the second turn's messages carry the streamed first answer; the servers'
    usage gives prompt and cached tokens per turn; greedy outputs equal across the servers."""
    from draftsmith.api import LLM
    from draftsmith.server.app import create_app

    tiny = str(tiny_model_dir("llama", seed=23))
    plain = LLM(tiny, drafter="none", max_batch=2, max_len=256, enable_prefix_caching=True)
    spec = LLM(tiny, drafter="ngram", policy="fixed", num_speculative_tokens=4, max_batch=2, max_len=256,
               enable_prefix_caching=True)
    with _ThreadServer(create_app(plain)) as u1, _ThreadServer(create_app(spec)) as u2:
        cfg = BenchConfig(workload=str(_conversations(tmp_path, 2)), concurrency=(1,), requests=2, max_tokens=10,
                          warmup=0, turns=2, out=tmp_path / "out", progress=False,
                          endpoints=(parse_endpoint(f"none={u1}", 0), parse_endpoint(f"ngram={u2}", 1)))
        rep = json.loads(run_bench(cfg, log=lambda m: None).read_text())
    (t,) = rep["tiers"]
    rows = {r["label"]: r for r in t["results"]}
    for r in rows.values():
        assert r["errors"] == 0
        _check_turns(r, 2)
        assert r["by_turn"][1]["cached_tokens"] > 0  # usage.prompt_tokens_details.cached_tokens
    assert rows["ngram"]["equality"]["compared"] == 4 and rows["ngram"]["equality"]["mismatches"] == 0
    # the same conversations in process: each turn's prompt has the same tokens as the server saw
    # (the streamed answer went into the second turn's messages as the engine's decoded answer does)
    local = BenchConfig(target=tiny, drafters=(), workload=cfg.workload, concurrency=(1,), requests=2, max_tokens=10,
                        warmup=0, turns=2, out=tmp_path / "local", progress=False)
    (lt,) = json.loads(run_bench(local, log=lambda m: None).read_text())["tiers"]
    prompt = {(x["index"], x["turn"]): x["prompt_tokens"] for x in lt["results"][0]["per_request"]}
    assert {(x["index"], x["turn"]): x["prompt_tokens"] for x in rows["none"]["per_request"]} == prompt


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "draftsmith", "bench", *args]


def _phases_on_disk(path: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    if path.exists():
        for raw in path.read_bytes().splitlines(keepends=True):
            if raw.endswith(b"\n"):
                ln = json.loads(raw)
                out.setdefault(ln["phase"], set()).add(ln["label"])
    return out


def test_bench_sigkill_then_resume(tiny_model_dir, tmp_path, capsys):
    tiny = tiny_model_dir("llama", seed=24)
    out = tmp_path / "out"
    results = out / "results.jsonl"
    args = ["--target", str(tiny), "--drafter", "ngram", "--policy", "fixed", "--workload", str(_prompts(tmp_path)), "--concurrency",
            "1,2,4", "--requests", "4", "--max-tokens", "24", "--warmup", "0", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(_cli(*args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # polled every 5 ms: the kill must land while later tiers are still running (an early
        # exit is reported by the returncode check below, with the bench's stderr)
        wait_until(lambda: "c1" in _phases_on_disk(results) or proc.poll() is not None, timeout=300,
                   interval=0.005, message="the bench wrote no finished c1 tier")
    finally:
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"bench ended before it could be killed: {err.decode()[-2000:]}"
    kept = {k for k, v in _phases_on_disk(results).items() if v == {"none", "ngram"}}
    assert "c1" in kept and "c4" not in kept
    before = results.read_bytes()
    assert not (out / "report.json").exists()
    with open(results, "ab") as f:  # a kill in the middle of a write leaves half a line
        f.write(before.splitlines(keepends=True)[-1][:40])

    from draftsmith.cli import main  # the resume runs in process (saves an interpreter start)

    capsys.readouterr()
    assert main(["bench", *args, "--resume"]) == 0
    assert f"resuming; {len(kept)} finished tier(s) kept: {', '.join(sorted(kept))}" in capsys.readouterr().err
    after = results.read_bytes()
    assert after.startswith(before)  # finished tiers untouched, the torn line gone
    lines = [json.loads(x) for x in after.splitlines()]
    assert sorted((x["phase"], x["label"]) for x in lines) == sorted(
        (f"c{c}", lab) for c in (1, 2, 4) for lab in ("none", "ngram"))
    rep = json.loads((out / "report.json").read_text())
    assert [t["concurrency"] for t in rep["tiers"]] == [1, 2, 4]
    inv = rep["setup"]["invocations"]
    assert [i["resumed"] for i in inv] == [False, True] and sorted(inv[1]["phases_run"]) == sorted({"c1", "c2", "c4"} - kept)
    # a resume with other measured work is refused
    assert main(["bench", *[a if a != "24" else "8" for a in args], "--resume"]) == 2
    assert "max_tokens" in capsys.readouterr().err
