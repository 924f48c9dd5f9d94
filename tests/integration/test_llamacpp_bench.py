"""`draftsmith bench --peers llamacpp` on the default target: llama.cpp runs the packaged GGUF
rewritten in float32 and, greedy on the same prompt token ids, writes what our plain decoding
writes (the same weights). Needs the optional llama-cpp-python extra; skipped without it."""

from __future__ import annotations

import json

import pytest

from draftsmith.bench import BenchConfig, run_bench

pytest.importorskip("llama_cpp")


def test_llamacpp_peer_runs_the_same_weights(default_target_dir, tmp_path):
    cfg = BenchConfig(target="smollm2-135m", drafters=("ngram",), policy="fixed", workload="humaneval", concurrency=(1,),
                      requests=2, max_tokens=24, warmup=1, peers=("llamacpp",), dtype="float32",
                      out=tmp_path / "out", progress=False)
    rep = json.loads(run_bench(cfg, log=lambda m: None).read_text())
    peers = {p["label"]: p for p in rep["peers"]["peers"]}
    assert set(peers) == {"llamacpp:generate", "llamacpp:prompt-lookup"}
    for p in peers.values():
        assert p["system_tokens_per_s"] > 0 and p["output_tokens"] > 0
        assert p["info"]["gguf"].endswith("smollm2-135m.F32.gguf") and p["info"]["threads"] >= 1
        assert set(p["ours_vs_peer"]) == {"none", "ngram"}
        same = p["same_output_as_our_baseline"]
        # float32 on both sides: only a near-tie flipped by summation order may differ
        assert same["compared"] == 2 and same["equal"] >= 1
