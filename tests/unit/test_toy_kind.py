"""Issue 14's registry contract: a drafter kind registered from one file (toy_kind.py) goes
through `draftsmith train`, `generate` and `eval` like a built-in kind, and shows up in
everything that lists kinds."""

from __future__ import annotations

import json

import pytest
import yaml

from draftsmith import cli
from draftsmith.data.sources.conversation import split_of
from draftsmith.drafters import registry
from standin_drafter import sequence_records  # noqa: E402  (tests/unit helper)
from toy_kind import register_toy  # noqa: E402


@pytest.fixture
def toy():
    kind = register_toy()
    yield kind
    registry.unregister("toy")


def test_a_toy_kind_trains_generates_and_evaluates(toy, tiny_model_dir, tmp_path, capsys):
    target = tiny_model_dir("llama", seed=0)
    data = sequence_records(tmp_path / "regen.jsonl", n=16, heldout=4)
    assert cli.main(["cache", "--target", str(target), "--data", str(data), "--layers", "0",
                     "--out", str(tmp_path / "cache"), "--dtype", "fp32", "--no-progress"]) == 0
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump({
        "target": str(target), "out": str(tmp_path / "run"), "drafter": {"kind": "toy"},
        "data": {"cache": str(tmp_path / "cache"), "max_len": 32},
        "train": {"batch_size": 2, "max_steps": 4, "save_every": 2, "progress": "off", "tensorboard": "off"}}))
    assert cli.main(["train", "--config", str(recipe)]) == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["kind"] == "toy" and saved["block_size"] == 1

    spec = f"toy:{tmp_path / 'run'}"
    capsys.readouterr()
    assert cli.main(["generate", "--target", str(target), "--drafter", spec, "--policy", "fixed", "--prompt", "ab",
                     "--max-new-tokens", "12", "--json"]) == 0
    spec_out = json.loads(capsys.readouterr().out)
    assert cli.main(["generate", "--target", str(target), "--prompt", "ab", "--max-new-tokens", "12", "--json"]) == 0
    plain_out = json.loads(capsys.readouterr().out)
    assert spec_out["results"][0]["token_ids"] == plain_out["results"][0]["token_ids"]  # greedy: lossless
    assert spec_out["stats"]["draft_proposed"] > 0  # the toy drafter really drafted

    ids = [f"p{i}" for i in range(4000) if split_of(f"file:prompts.jsonl/p{i}") == "heldout"][:2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"abc abc {i}"}) + "\n" for i in ids))
    assert cli.main(["eval", "--target", str(target), "--drafter", spec, "--tasks", str(prompts),
                     "--max-prompts", "2", "--max-new-tokens", "8", "--no-progress",
                     "--out", str(tmp_path / "eval")]) == 0
    (drafter,) = json.loads((tmp_path / "eval" / "report.json").read_text())["drafters"]
    assert drafter["kind"] == "toy" and drafter["overall"]["rounds"] > 0


def test_registered_kinds_reach_every_listing(toy):
    assert "toy:CKPT" in registry.usage() and "toy" in registry.trainable_kinds()
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "toy:CKPT" in help_text
    with pytest.raises(Exception, match="needs an argument"):
        registry.parse_spec("toy")
    with pytest.raises(Exception, match="did you mean 'ngram'"):
        registry.parse_spec("ngarm")
