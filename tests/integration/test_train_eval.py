"""Mint -> Verify on a tiny target with the real drafter kinds: train a few steps, calibrate, eval.

Numbers here are meaningless (a random 3-layer target, a few steps); the test checks the
jobs fit together: checkpoints load through drafters/checkpoint.py, STS lands in
calibration.json and eval uses it, reports and plots are written, foreign targets refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from standin_drafter import sequence_records  # noqa: E402

from draftsmith.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    from draftsmith.data.cache import CacheConfig, run_cache
    from draftsmith.data.sources.conversation import split_of
    from draftsmith.train.config import parse_config
    from draftsmith.train.trainer import Trainer

    target = tiny_model_dir("llama", seed=0)
    root = tmp_path_factory.mktemp("mint")
    regen = sequence_records(root / "regen.jsonl", n=24)
    run_cache(CacheConfig(target=str(target), data=regen, out=root / "cache", layers="0,1,2", dtype="fp16",
                          progress=False))
    runs = {}
    for kind, opts, dtype in [("dspark", {"num_layers": 1, "block_size": 4, "max_anchors": 6, "rank": 32,
                                          "draft_vocab_size": 128}, "fp32"),
                              ("eagle3", {"ttt_steps": 3, "draft_vocab_size": 128}, "bf16")]:  # bf16 autocast too
        raw = {"target": str(target), "out": str(root / kind), "drafter": {"kind": kind, **opts},
               "data": {"cache": str(root / "cache"), "max_len": 32},
               "train": {"batch_size": 4, "max_steps": 4, "save_every": 4, "lr": 3e-3, "progress": "off",
                         "dtype": dtype}}
        res = Trainer(parse_config(raw, num_layers=3)).fit()
        assert res.step == 4
        runs[kind] = root / kind
    from safetensors.torch import load_file

    # the trainer chose DSpark's draft vocabulary from the cached answers' token counts
    counts = torch.zeros(272, dtype=torch.long)
    for shard in (root / "cache").glob("*.safetensors"):
        part = load_file(str(shard))
        counts += torch.bincount(part["input_ids"].long()[part["loss_mask"].bool()], minlength=272)
    state = load_file(str(root / "dspark" / "model.safetensors"))
    t2d = state["backbone.vocab.t2d"]
    assert int(t2d.sum()) == 128 and not torch.equal(t2d, torch.arange(272) < 128)  # not the untouched default
    assert bool(t2d[counts.argsort(descending=True)[:10]].all())  # (the trainer counts train-split answers only)
    ids = [f"p{i}" for i in range(4000) if split_of(f"file:prompts.jsonl/p{i}") == "heldout"][:4]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"abc abc {i}"}) + "\n" for i in ids))
    return target, runs, prompts, root


def test_calibrate_then_eval(trained, capsys, tiny_model_dir):
    target, runs, prompts, root = trained
    common = ["--target", str(target), "--tasks", str(prompts), "--max-new-tokens", "12", "--max-prompts", "4",
              "--no-progress"]
    assert main(["calibrate", "--drafter", f"dspark:{runs['dspark']}", *common, "--json"]) == 0
    cal = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(cal["temperatures"]) == 4 and cal["rounds"] > 0
    assert json.loads((runs["dspark"] / "calibration.json").read_text())["temperatures"] == cal["temperatures"]

    out = root / "eval"
    assert main(["eval", "--drafter", f"dspark:{runs['dspark']}", "--drafter", f"eagle3:{runs['eagle3']}",
                 *common, "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    ds, ea = report["drafters"]
    assert report["split"] == "heldout" and ds["kind"] == "dspark" and ea["kind"] == "eagle3"
    for d in (ds, ea):
        o = d["overall"]
        assert o["rounds"] > 0 and len(o["conditional_acceptance"]) == d["block_size"]
        # τ is the committed tokens per round (bonus included), within [1, K + 1]; a report that
        # counted rounds or commits wrongly fails here (the old `tau >= 1` could not)
        assert o["tau"] == pytest.approx(o["committed"] / o["rounds"])
        assert 1.0 <= o["tau"] <= d["block_size"] + 1
    assert ds["block_size"] == 4 and ea["block_size"] == 3  # the checkpoints' block size / TTT depth
    assert ds["calibration"]["source"] == "calibration.json"
    assert ds["calibration"]["temperatures"] == pytest.approx(cal["temperatures"])
    assert ea["calibration"] is None  # EAGLE-3 has no confidence head
    for f in ("report.json", "report.md", "conditional_acceptance.png", "reliability-dspark_dspark.png",
              "threshold-dspark_dspark.png", "rounds-dspark_dspark.jsonl"):
        assert (out / f).is_file(), f
    md = (out / "report.md").read_text()
    assert "| dspark:dspark | all |" in md and "## Summary" in md
    width = None  # every table row has as many cells as its header (issue 15: 5 cells under 7 columns)
    for ln in md.splitlines():
        width = (ln.count("|") - 1 if width is None else width) if ln.startswith("|") else None
        assert width is None or ln.count("|") - 1 == width, ln

    # a checkpoint for another target is refused with one clear line
    other = tiny_model_dir("llama", seed=7)
    assert main(["eval", "--target", str(other), "--drafter", f"dspark:{runs['dspark']}", "--tasks", str(prompts),
                 "--out", str(root / "x")]) == 2
    assert "trained for target" in capsys.readouterr().err


def test_threshold_cuts_verification(trained):
    from draftsmith.eval.jobs import EvalOptions, run_eval

    target, runs, prompts, root = trained
    rep = run_eval(EvalOptions(target=str(target), drafters=(f"dspark:{runs['dspark']}",), tasks=(str(prompts),),
                               confidence_threshold=0.999, max_new_tokens=8, max_prompts=2, out=None,
                               progress=False))
    o = rep["drafters"][0]["overall"]
    assert o["verify_rate"] < 1.0 and o["proposed"] < o["drafted"]


def test_every_command_applies_the_same_target_rule(trained, tmp_path, tiny_model_dir, capsys):
    """drafters/checkpoint.check_target: the weights decide. The same weights under another
    directory name pass in generate, eval and calibrate alike; other weights are refused by all."""
    import shutil

    target, runs, prompts, root = trained
    renamed = tmp_path / "renamed-target"
    shutil.copytree(target, renamed)  # another target id, the same weights
    other = tiny_model_dir("llama", seed=7)  # the same shapes, other weights
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["dspark"], ckpt)  # calibrate writes into it
    spec = f"dspark:{ckpt}"
    jobs = {
        "generate": ["generate", "--drafter", spec, "--policy", "fixed", "--prompt", "abc", "--max-new-tokens", "4"],
        "eval": ["eval", "--drafter", spec, "--tasks", str(prompts), "--max-prompts", "1", "--max-new-tokens", "4",
                 "--no-progress", "--out", str(tmp_path / "eval"), "--overwrite"],  # (run twice into one --out)
        "calibrate": ["calibrate", "--drafter", spec, "--tasks", str(prompts), "--max-prompts", "1",
                      "--max-new-tokens", "4", "--no-progress"],
    }
    for name, argv in jobs.items():
        assert main([*argv, "--target", str(renamed)]) == 0, name
        capsys.readouterr()
        assert main([*argv, "--target", str(other)]) == 2, name
        assert "trained for target" in capsys.readouterr().err, name
