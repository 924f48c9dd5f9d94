"""Mint stages 1-2 through the CLI: `draftsmith regen` killed and resumed, then `cache`.

- A regen subprocess is SIGKILLed mid-run; `--resume` then finishes it: every id exactly once,
  lines written before the kill unchanged, a half-written last line dropped and redone, the
  result identical to an uninterrupted run, and the unprocessable prompt in the errors file.
- On the default target: regen -> cache --estimate -> cache -> features equal the target's
  hidden states recomputed directly, and online features equal the cached ones.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from waiting import wait_until  # tests/waiting.py

from draftsmith.data.cache import FeatureCache, directory_bytes
from draftsmith.data.regen import errors_path, load_records

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "draftsmith", *args]


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True) if path.exists() else []


def _signal_after_lines(args: list[str], out: Path, n: int, sig: int, what: str, timeout: float) -> tuple[int, str]:
    """Run `draftsmith ARGS`, send it `sig` once `out` holds `n` lines and return (its returncode, its
    stderr). Polled every 10 ms: the signal must land mid-run (an early exit shows in the returncode
    the caller checks, with the stderr)."""
    proc = subprocess.Popen(_cli(*args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(_lines(out)) >= n or proc.poll() is not None, timeout=120, interval=0.01,
                   message=lambda: f"regen wrote {len(_lines(out))} line(s) of the {n} wanted before {what}")
    finally:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode()


def test_regen_sigkill_then_resume(tiny_model_dir, tmp_path):
    from draftsmith.data.sources import load_mix

    tiny = tiny_model_dir("llama", seed=11)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i:03d}", "messages": [
        {"role": "user", "content": f"Tell me about item {i}."},
        {"role": "assistant", "content": "an original answer that regen replaces"},
        {"role": "user", "content": "Shorter, please."}]} for i in range(30)]
    rows.append({"id": "huge", "prompt": "z" * 300})  # longer than --max-len: goes to the errors file
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "regen.jsonl"
    args = ["regen", "--target", str(tiny), "--mix", str(prompts), "--max-samples", "31", "--split", "train",
            "--max-new-tokens", "16", "--max-len", "200", "--batch-size", "2", "--seed", "7", "--out", str(out)]
    expected = {c.id for c in load_mix(str(prompts), split="train", max_samples=31, seed=7)}
    huge_id = next(i for i in expected if i.endswith("/huge"))

    rc, err = _signal_after_lines(args, out, 4, signal.SIGKILL, "the kill", timeout=30)
    assert rc == -signal.SIGKILL, f"regen ended before it could be killed: {err[-2000:]}"
    before = [ln for ln in _lines(out) if ln.endswith(b"\n")]
    assert 4 <= len(before) < len(expected) - 1
    with open(out, "ab") as f:  # a kill in the middle of a write leaves half a record
        f.write(before[-1][: len(before[-1]) // 2])

    done = subprocess.run(_cli(*args, "--resume"), env=ENV, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    after = _lines(out)
    recs = [json.loads(ln) for ln in after]  # every line is complete JSON (the half line is gone)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) and set(ids) == expected - {huge_id}
    assert after[: len(before)] == before  # finished ids' outputs unchanged
    errs = [json.loads(x) for x in errors_path(out).read_text().splitlines()]
    assert [e["id"] for e in errs] == [huge_id] and "context limit" in errs[0]["reason"]

    # A resumed run reproduces an uninterrupted one (per-answer seeds from seed, id, turn).
    clean = tmp_path / "clean.jsonl"
    from draftsmith.cli import main

    assert main([*args[:-1], str(clean), "--batch-size", "5"]) == 0
    assert {r["id"]: r for r in load_records(clean)} == {r["id"]: r for r in recs}


def test_endpoint_against_draftsmith_server(tiny_model_dir, tmp_path):
    """`regen --endpoint` against the project's own OpenAI-compatible server on loopback: the
    same answers as in process, and the last turn's token ids exactly as the engine wrote them
    (the server's `return_token_ids`; the random model's bytes are rarely valid UTF-8, so their
    text would not encode back to them)."""
    import threading

    import uvicorn

    from draftsmith.api import LLM
    from draftsmith.core.sampling import SamplingParams
    from draftsmith.data.regen import RegenConfig, run_regen, turn_seed
    from draftsmith.data.sources.conversation import Conversation
    from draftsmith.server.app import create_app

    tiny = tiny_model_dir("llama", seed=13)
    convs = [Conversation(id=f"e/{i}", source="t", split="train", messages=[
        {"role": "user", "content": f"Say something about {i}."}, {"role": "user", "content": "Again."}])
        for i in range(4)]
    llm = LLM(str(tiny), max_batch=4, max_len=256)
    refs = {}  # first answers, sampled in process with the seeds regen sends (before the server owns the engine)
    for c in convs:
        ids = llm.apply_chat_template([dict(c.messages[0])])
        sp = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8, seed=turn_seed(0, c.id, 0))
        out = llm.generate([ids], sp)[0]
        refs[c.id] = (out.text, out.token_ids)
    server = uvicorn.Server(uvicorn.Config(create_app(llm), host="127.0.0.1", port=0, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        wait_until(lambda: server.started or not th.is_alive(), timeout=60, message="the server did not start")
        assert server.started, "the server thread ended before the server started"
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
        cfg = RegenConfig(target=str(tiny), endpoint=url, concurrency=3, max_new_tokens=8, max_len=256,
                          retries=0, out=tmp_path / "e.jsonl", overwrite=True)
        s = run_regen(cfg, conversations=convs)
    finally:
        server.should_exit = True
        th.join(30)
    assert (s.written, s.errors) == (4, 0), errors_path(cfg.out).read_text() if s.errors else ""
    for r in load_records(cfg.out):
        assert r["target"]["served_model"] == llm.target.target_id
        text, _ = refs[r["id"]]
        assert r["messages"][1]["content"] == text  # same engine, same seed, same answer
        assert [t["answer_ids"] for t in r["turns"]] == ["text", "server"]
        ids = llm.apply_chat_template(r["messages"][:3])  # the second turn's prompt, as the server rendered it
        second = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8,
                                                    seed=turn_seed(0, r["id"], 1)))[0]
        n = r["turns"][1]["generated_tokens"]
        assert [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m][-n:] == second.token_ids  # the engine's own
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"] * 2 and len(r["turns"]) == 2


@pytest.mark.slow
def test_regen_then_cache_on_default_target(default_target_dir, tmp_path, capsys):
    """The real chain on the default target, with a tiny budget."""
    from draftsmith.cli import main
    from draftsmith.data.features import OnlineFeatures
    from draftsmith.models.target import load_target

    data = tmp_path / "regen.jsonl"
    assert main(["regen", "--mix", "humaneval:0.5,mtbench:0.5", "--max-samples", "2", "--max-new-tokens", "6",
                 "--max-len", "1024", "--batch-size", "2", "--out", str(data)]) == 0
    recs = load_records(data)
    assert len(recs) == 2 and all(r["target"]["id"] == "smollm2-135m" for r in recs)
    assert sorted(len(r["turns"]) for r in recs) == [1, 2]  # HumanEval: 1 turn, MT-Bench: 2 turns
    for r in recs:
        assert sum(r["loss_mask"]) == sum(t["generated_tokens"] for t in r["turns"])
    out = tmp_path / "cache"
    assert main(["cache", "--data", str(data), "--out", str(out), "--estimate", "--shard-tokens", "256"]) == 0
    est = int(capsys.readouterr().out.split(": ")[-1].split(" bytes")[0])
    assert not out.exists()
    # defaults: layers 1,14,27 (+ final), fp16 -- what --estimate sized
    assert main(["cache", "--data", str(data), "--out", str(out), "--shard-tokens", "256"]) == 0
    assert abs(est - directory_bytes(out)) / directory_bytes(out) < 0.05

    target = load_target("smollm2-135m", device="cpu")
    fc = FeatureCache(out).validate("smollm2-135m", target.weights_hash, (1, 14, 27), 576)
    assert fc.manifest["dtype"] == "fp16" and fc.manifest["shards"]
    on = OnlineFeatures(target, layer_ids=(1, 14, 27), dtype="fp16")
    m = target.model

    def close(a, b):  # fp16 storage: relative 2^-11 rounding
        return bool(((a.float() - b.float()).abs() <= 2e-3 * (1 + b.float().abs())).all())

    for r in recs:
        x = fc.features(r)
        o = m(torch.tensor([r["input_ids"]]), m.new_cache(1, len(r["input_ids"])), layer_ids=(1, 14, 27),
              compute_logits=False)
        assert close(x.final_hidden, o.final_hidden[0])
        assert all(close(x.hidden[i], o.hidden[i][0]) for i in (1, 14, 27))
        y = on.features(r)  # online, cast like the cache: the same numbers
        assert all(close(y.hidden[i], x.hidden[i]) for i in (1, 14, 27)) and close(y.final_hidden, x.final_hidden)

    # regen --features-out: the same conversations, their features recorded while answering.
    one = tmp_path / "one.jsonl"
    assert main(["regen", "--mix", "humaneval:0.5,mtbench:0.5", "--max-samples", "2", "--max-new-tokens", "6",
                 "--max-len", "1024", "--batch-size", "2", "--out", str(one), "--features-out", str(tmp_path / "one")]) == 0
    assert "features of 2 conversations recorded, 0 computed after" in capsys.readouterr().err
    rec1 = {r["id"]: r for r in load_records(one)}
    assert {r["id"]: r["input_ids"] for r in recs} == {k: r["input_ids"] for k, r in rec1.items()}
    fc1 = FeatureCache(tmp_path / "one").validate("smollm2-135m", target.weights_hash, (1, 14, 27), 576)
    assert fc1.manifest["complete"] and fc1.manifest["dtype"] == "fp16"
    for r in recs:
        a, b = fc1.features(r["id"]), fc.features(r["id"])
        assert a.input_ids.tolist() == r["input_ids"] and a.loss_mask.tolist() == b.loss_mask.tolist()
        assert close(a.final_hidden, b.final_hidden) and all(close(a.hidden[i], b.hidden[i]) for i in (1, 14, 27))


def test_regen_sigterm_closes_its_feature_cache_then_resume(tiny_model_dir, tmp_path):
    """SIGTERM (`kill`, a scheduler's preemption) is an interrupt: regen exits 143 with a line that
    says how to continue, and its --features-out cache holds every record the JSONL has (Python's
    default SIGTERM ended the process with the last shard unwritten: the cache lagged the JSONL
    and needed a cache pass). `--resume` then completes both."""
    from draftsmith.data.cache import read_manifest
    from draftsmith.data.sources import load_mix

    tiny = tiny_model_dir("llama", seed=11)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i:03d}", "prompt": f"Tell me about item {i}."}) + "\n"
                               for i in range(60)))
    out, feats = tmp_path / "regen.jsonl", tmp_path / "features"
    args = ["regen", "--target", str(tiny), "--mix", str(prompts), "--max-new-tokens", "24", "--max-len", "200",
            "--batch-size", "2", "--seed", "7", "--out", str(out), "--features-out", str(feats),
            "--feature-layers", "0,1", "--no-progress"]
    expected = {c.id for c in load_mix(str(prompts), split="train", seed=7)}  # (a prompt file's train split)
    rc, err = _signal_after_lines(args, out, 4, signal.SIGTERM, "SIGTERM", timeout=60)
    assert rc == 143, f"regen ended before SIGTERM or died of it: {rc} {err[-2000:]}"
    assert "draftsmith: terminated (SIGTERM)" in err and "--resume" in err
    written = [json.loads(ln)["id"] for ln in _lines(out) if ln.endswith(b"\n")]
    assert 4 <= len(written) < len(expected) - 1
    manifest = read_manifest(feats)
    # (a SIGTERM between a record's write and its features' leaves the cache one behind)
    assert not manifest["complete"] and len(written) - 1 <= manifest["num_samples"] <= len(written)

    done = subprocess.run(_cli(*args, "--resume"), env=ENV, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert {r["id"] for r in load_records(out)} == expected
    cache = FeatureCache(feats)
    assert read_manifest(feats)["complete"] and sorted(cache.sample_ids) == sorted(r["id"] for r in load_records(out))
