"""Built-in drafters (drafters/builtin.py): `KIND:NAME` resolves to package data, loads like
any checkpoint, is integrity-checked, and never shadows a local directory. The shipped
drafters themselves are checked for what the package promises (size, files, 16-bit weights,
content hash, target)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftsmith import LLM, DraftsmithError, SamplingParams
from draftsmith.drafters import builtin, dspark, registry
from draftsmith.drafters.checkpoint import save_trained_drafter
from draftsmith.models.target import load_target
from draftsmith.tensorfile import HASH_KEY

MAX_BYTES = 20 * 1000 * 1000  # package data per built-in weights file


@pytest.fixture
def fake_root(tmp_path, monkeypatch, tiny_model_dir):
    """A built-in root holding one untrained DSpark drafter `dspark:tiny` for a tiny target."""
    target_dir = tiny_model_dir("llama", seed=0)
    target = load_target(str(target_dir))
    torch.manual_seed(0)
    model = dspark.build(target.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=8, max_anchors=4))
    root = tmp_path / "builtin"
    save_trained_drafter(model, root / "dspark" / "tiny", target.target_id, target.weights_hash)
    monkeypatch.setattr(builtin, "BUILTIN_ROOT", root)
    return root, target_dir, target


def test_builtin_name_resolves_loads_and_is_listed(fake_root, tmp_path, monkeypatch):
    root, target_dir, target = fake_root
    kind, arg = registry.parse_spec("dspark:tiny")
    assert kind.name == "dspark" and Path(arg) == root / "dspark" / "tiny"
    assert builtin.builtin_specs() == ["dspark:tiny"] and builtin.builtin_specs("eagle3") == []
    assert "built-in: dspark:tiny" in registry.usage()
    llm = LLM(str(target_dir), policy="fixed", drafter="dspark:tiny", num_speculative_tokens=3, max_len=64)
    plain = LLM(str(target_dir), max_len=64)
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert llm.generate(["hello"], p)[0].token_ids == plain.generate(["hello"], p)[0].token_ids
    assert llm.last_stats.draft_proposed > 0  # it drafted: the built-in was really loaded
    # a local directory of the same name wins (as with HF ids), and is read as a path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert registry.parse_spec("dspark:tiny")[1] == "tiny"


def test_unknown_names_and_missing_arguments_list_the_builtins(fake_root):
    with pytest.raises(DraftsmithError, match=r"no checkpoint directory 'nope'.*built-in: dspark:tiny"):
        registry.parse_spec("dspark:nope")
    with pytest.raises(DraftsmithError, match=r"needs an argument.*built-in: dspark:tiny"):
        registry.parse_spec("dspark")
    with pytest.raises(DraftsmithError, match="no checkpoint directory"):
        registry.parse_spec("eagle3:tiny")  # a DSpark built-in is not an EAGLE-3 one


def test_lookup_wraps_a_builtin_by_its_spec(fake_root):
    root, target_dir, target = fake_root
    kind, arg = registry.parse_spec("lookup:dspark:tiny")
    assert kind.name == "lookup" and arg == "dspark:tiny"
    llm = LLM(str(target_dir), policy="fixed", drafter="lookup:dspark:tiny", num_speculative_tokens=3, max_len=64)
    assert llm.drafter.name == "lookup+dspark"
    plain = LLM(str(target_dir), max_len=64)
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["hello hello hello", "xyz"]
    assert [o.token_ids for o in llm.generate(prompts, p)] == [o.token_ids for o in plain.generate(prompts, p)]
    from draftsmith.eval.runner import default_block_size, load_drafter

    loaded = load_drafter("lookup:dspark:tiny", target, 1, 64)  # eval / bench: the inner checkpoint's config
    assert loaded.checkpoint == root / "dspark" / "tiny" and default_block_size(loaded) == 3
    assert loaded.label == "lookup:tiny"
    for spec, message in (("lookup", "needs an argument"), ("lookup:none", "wraps a drafter"),
                          ("lookup:lookup:ngram", "wraps a drafter"), ("lookup:dspark:nope", "no checkpoint directory"),
                          ("lookup:nope", "unknown drafter kind 'nope'")):
        with pytest.raises(DraftsmithError, match=message):
            registry.parse_spec(spec)


def test_damaged_builtin_is_refused(fake_root, tiny_model_dir):
    root, target_dir, target = fake_root
    f = root / "dspark" / "tiny" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-20] ^= 0x01  # inside the last tensor's bytes
    f.write_bytes(bytes(data))
    with pytest.raises(DraftsmithError, match="content hash"):
        LLM(str(target_dir), policy="fixed", drafter="dspark:tiny", max_len=64)
    # weights without a content hash cannot be checked: refused
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(f))
    with pytest.raises(DraftsmithError, match="no content hash"):
        registry.parse_spec("dspark:tiny")
    # and a built-in for another target is refused like any checkpoint
    other = load_target(str(tiny_model_dir("llama", seed=1)))
    save_trained_drafter(dspark.build(target.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=8)),
                         root / "dspark" / "tiny", target.target_id, target.weights_hash)
    with pytest.raises(DraftsmithError, match="trained for target"):
        registry.build_drafter("dspark:tiny", other, 1, 64)


SHIPPED = [(d.parent.name, d) for d in sorted(builtin.BUILTIN_ROOT.glob("*/*")) if d.is_dir()]


@pytest.mark.parametrize("kind, d", SHIPPED, ids=[f"{k}:{d.name}" for k, d in SHIPPED])
def test_shipped_builtin_is_what_the_package_promises(kind, d):
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["kind"] == kind and cfg["target_id"] == d.name and cfg["target_weights_hash"]
    f = d / "model.safetensors"
    assert f.stat().st_size <= MAX_BYTES
    with safe_open(str(f), framework="pt") as fh:
        assert HASH_KEY in (fh.metadata() or {})
        floats = {fh.get_slice(k).get_dtype() for k in fh.keys()} - {"I64", "BOOL"}
    assert floats <= {"BF16", "F16"}, floats
    for name in ("recipe.yaml", "data_manifest.json", "TRAINING.md"):
        assert (d / name).is_file() and (d / name).stat().st_size > 0, name
    manifest = json.loads((d / "data_manifest.json").read_text())
    assert manifest["conversations"] >= 1 and manifest["files"], manifest
    if (d / "calibration.json").is_file():  # its STS says which rows it calibrates (greedy or sampled)
        from draftsmith.drafters.checkpoint import read_sts

        fit = read_sts(d)
        assert fit.regime in ("greedy", "sampled") and len(fit.temperatures) == cfg["block_size"]
        if d.name == "smollm2-135m" and kind == "dspark":
            assert fit.regime == "sampled"  # fitted at T = 1: greedy rows keep raw confidences


def test_calibrate_never_writes_into_the_package(fake_root, tmp_path):
    from draftsmith.eval.jobs import CalibrateOptions, run_calibrate

    root, target_dir, _ = fake_root
    with pytest.raises(DraftsmithError, match="built-in drafter .*copy"):
        run_calibrate(CalibrateOptions(target=str(target_dir), drafter="dspark:tiny", data=tmp_path / "h.jsonl"))
    assert not (root / "dspark" / "tiny" / "calibration.json").exists()


def test_the_default_target_has_a_builtin_dspark_drafter():
    """The package ships `dspark:smollm2-135m` (issue 12): it resolves, and `--help` names it."""
    assert "dspark:smollm2-135m" in builtin.builtin_specs("dspark")
    kind, arg = registry.parse_spec("dspark:smollm2-135m")
    assert Path(arg) == builtin.BUILTIN_ROOT / "dspark" / "smollm2-135m" and builtin.is_builtin(arg)
    assert "built-in: dspark:smollm2-135m" in registry.usage()
