"""Bad input to `draftsmith train` found by hunt 55: each case was a traceback, a confusing
error or a silently replaced drafter, and is now one line naming what to change."""

from __future__ import annotations

import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.train.config import apply_overrides, parse_config

from standin_drafter import CATALOGUE


def _raw(*overrides):
    raw = {"target": "t", "out": "runs/x", "drafter": {"kind": "head", "layer_ids": [0, 2], "block_size": 3},
           "data": {"cache": "cache/"}, "train": {"lr": 1e-3}}
    return apply_overrides(raw, list(overrides))


@pytest.mark.parametrize("override,expect", [
    # OverflowError tracebacks (the step count from epochs / the budget) ...
    ("train.epochs=inf", r"train\.epochs: Input should be a finite number"),
    ("train.budget_minutes=inf", r"train\.budget_minutes: Input should be a finite number"),
    # ... a nan loss at step 1 ...
    ("train.lr=inf", r"train\.lr: Input should be a finite number"),
    ("train.weight_decay=.inf", r"train\.weight_decay: Input should be a finite number"),
    # ... torch's ValueError from AdamW
    ("train.betas=[2, 0.95]", r"train\.betas\.0: Input should be less than 1"),
    ("train.betas=[0.9, -0.1]", r"train\.betas\.1: Input should be greater than or equal to 0"),
])
def test_non_finite_or_out_of_range_optimizer_numbers_are_one_line(override, expect):
    with pytest.raises(DraftsmithError, match=expect):
        parse_config(_raw(override), CATALOGUE, source="recipe.yaml")


def test_grad_clip_inf_still_means_no_clipping():
    assert parse_config(_raw("train.grad_clip=inf"), CATALOGUE).train.grad_clip == float("inf")


@pytest.mark.parametrize("budget", ["inf", "nan"])
def test_budget_must_be_finite(budget, tmp_path, capsys):
    """--budget inf was an OverflowError traceback; --budget nan named train.budget_minutes."""
    from draftsmith.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("out: runs/x\ndrafter: {kind: dspark}\ndata: {cache: c}\n")
    assert main(["train", "--config", str(recipe), "--budget", budget]) == 2
    assert capsys.readouterr().err.strip() == (f"draftsmith: error: --budget must be a positive number of minutes, "
                                                f"got {budget}")


def test_progress_and_tensorboard_take_on_and_off_as_written():
    """train.progress=off (or `tensorboard: off` in a recipe): YAML reads off as false, and the
    error said "Input should be 'auto', 'on' or 'off' (got False)" for the value it asked for."""
    cfg = parse_config(_raw("train.progress=off", "train.tensorboard=on"), CATALOGUE)
    assert (cfg.train.progress, cfg.train.tensorboard) == ("off", "on")
    cfg = parse_config(_raw("train.progress=yes", "train.tensorboard=no"), CATALOGUE)
    assert (cfg.train.progress, cfg.train.tensorboard) == ("on", "off")
    with pytest.raises(DraftsmithError, match=r"train\.progress: Input should be 'auto', 'on' or 'off' \(got 'loud'\)"):
        parse_config(_raw("train.progress=loud"), CATALOGUE)


def _drafter_dir(d):
    d.mkdir(parents=True)
    files = {"config.json": '{"kind": "head"}\n', "model.safetensors": "weights", "calibration.json": "{}\n"}
    for name, text in files.items():
        (d / name).write_text(text)
    return files


def _cfg(out, **train):
    return parse_config(_raw(f"out={out}", *(f"train.{k}={v}" for k, v in train.items())), CATALOGUE)


@pytest.mark.parametrize("resume", [False, True])
def test_out_that_is_a_drafter_directory_is_not_replaced(tmp_path, resume):
    """train out=DIR where DIR is a drafter but no run (an export / import --out, a copy of a
    built-in): its model.safetensors and config.json were replaced at the first checkpoint and its
    calibration.json deleted, silently. Refused before anything loads (the target 't' does not
    exist: the error would be another without the check)."""
    from draftsmith.train.trainer import Trainer

    out = tmp_path / "drafter"
    files = _drafter_dir(out)
    with pytest.raises(DraftsmithError, match=r"holds a drafter \(config\.json, model\.safetensors, "
                                              r"calibration\.json\) that is no training run's"):
        Trainer(_cfg(out), CATALOGUE, resume=resume).fit()
    assert {f.name: f.read_text() for f in out.iterdir()} == files


def test_overwrite_does_not_delete_the_weights_init_from_reads(tmp_path):
    """out=DIR train.init_from=DIR --overwrite (fine-tune in place): --overwrite deleted the files
    init_from was about to read, then the run failed."""
    from draftsmith.train.trainer import Trainer

    out = tmp_path / "run"
    files = _drafter_dir(out)
    (out / "checkpoint-00000004").mkdir()
    for init in (str(out), f"head:{out}", str(out / "checkpoint-00000004")):
        with pytest.raises(DraftsmithError, match=r"is in out=.*which --overwrite empties first"):
            Trainer(_cfg(out, init_from=init), CATALOGUE, overwrite=True).fit()
        assert {f.name: f.read_text() for f in out.iterdir() if f.is_file()} == files


def test_resume_of_another_kinds_run_says_which_recipe_to_use(tmp_path):
    """train --resume with a dflash recipe on a dspark run said 'use --drafter dspark:...' (a flag
    of generate / serve, not train); now it names both kinds and what to do, before the target loads."""
    from draftsmith.train.trainer import Trainer

    out = tmp_path / "run"
    ck = out / "checkpoint-00000002"
    (ck / "train_state").mkdir(parents=True)
    (ck / "train_state" / "state.pt").write_bytes(b"")
    (ck / "model.safetensors").write_bytes(b"")
    (ck / "config.json").write_text(json.dumps({"kind": "dspark", "target_id": "t", "target_weights_hash": "h"}))
    with pytest.raises(DraftsmithError) as e:
        Trainer(_cfg(out), CATALOGUE, resume=True).fit()
    assert str(e.value) == (f"cannot resume from {ck}: it is a dspark run, and this recipe trains head; resume with "
                            "the recipe that run used, or give a new out=")


def test_a_diverged_loss_is_the_one_line_error_alone(monkeypatch):
    """train.lr=1e30: the 'loss is nan' error came after torch's UserWarning and its source line
    ('Converting a tensor with requires_grad=True to a scalar ...'): three lines before the one."""
    import types
    import warnings

    import torch

    from draftsmith.train.trainer import Trainer

    t = Trainer.__new__(Trainer)
    t.cfg = types.SimpleNamespace(train=types.SimpleNamespace(seed=0))
    t.info = types.SimpleNamespace(rank=0, device=torch.device("cpu"))
    t.bf16 = False
    t.data = types.SimpleNamespace(batch=lambda step: None)
    w = torch.ones((), requires_grad=True)
    t.wrapped = lambda batch, gen: (w * float("nan"), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DraftsmithError, match=r"^loss is nan at step 1; lower train\.lr"):
            t._forward_backward(1)


@pytest.mark.parametrize("argv,overrides,resume", [
    # KEY=VALUE on both sides of an option: "unrecognized arguments: out=r1"
    (["a.b=1", "--config", "r.yaml", "out=r1"], ["a.b=1", "out=r1"], False),
    (["--config", "r.yaml", "out=r1", "--resume", "train.lr=1", "train.max_steps=3"],
     ["out=r1", "train.lr=1", "train.max_steps=3"], True),
    # `--resume KEY=VALUE` went first, so an earlier value of the same key won
    (["--config", "r.yaml", "train.max_steps=5", "--resume", "train.max_steps=6"],
     ["train.max_steps=5", "train.max_steps=6"], True),
    (["--config", "r.yaml", "--resume", "runs/x/checkpoint-00000002", "out=runs/x"], ["out=runs/x"],
     "runs/x/checkpoint-00000002"),
])
def test_overrides_may_stand_anywhere_in_command_line_order(argv, overrides, resume):
    from draftsmith.cli import build_parser

    args = build_parser().parse_args(["train", *argv])
    assert (args.overrides, args.resume) == (overrides, resume)


@pytest.mark.parametrize("key", ["block_size", "ttt_steps"])
def test_a_draft_length_past_64_is_refused(key):
    """drafter.block_size=1000 trained, and the drafter's K (its block size / TTT depth) made generate
    profile the SPS(B) table for 1000-token blocks, minutes past any -k that generate / serve accept."""
    raw = _raw()
    raw["drafter"] = {"kind": "head", "layer_ids": [0, 2], key: 65}
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Config:
        layer_ids: tuple = (0,)
        block_size: int = 3
        ttt_steps: int = 1

    kind = type("Kind", (), {"config_cls": Config, "build": None})
    with pytest.raises(DraftsmithError, match=rf"drafter\.{key} must be at most 64 .*got 65"):
        parse_config(raw, {"head": kind})
    raw["drafter"][key] = 64
    assert getattr(parse_config(raw, {"head": kind}).drafter, key) == 64


def test_loss_weights_must_be_finite():
    """drafter.ce_weight=inf / tv_weight=nan: 'loss is inf at step 0; lower train.lr' once the
    target had loaded."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Config:
        layer_ids: tuple = (0,)
        num_layers: int = 1
        ce_weight: float = 1.0

    cat = {"blk": type("Kind", (), {"config_cls": Config, "build": None})}
    raw = _raw()
    for field, value, expect in (("ce_weight", float("inf"), r"drafter\.ce_weight must be a finite number, got inf"),
                                 ("ce_weight", float("nan"), r"drafter\.ce_weight must be a finite number, got nan")):
        raw["drafter"] = {"kind": "blk", field: value}
        with pytest.raises(DraftsmithError, match=expect):
            parse_config(raw, cat, num_layers=3)
    raw["drafter"] = {"kind": "blk", "ce_weight": 0.5}
    assert parse_config(raw, cat, num_layers=3).drafter.ce_weight == 0.5


def test_block_drafter_loss_weights_must_be_finite_in_python_too():
    """DSparkConfig / DFlashConfig built in Python (no recipe): an inf or nan loss weight is the
    config's error, not 'loss is inf at step 0' after the target loaded."""
    from draftsmith.drafters.dflash import DFlashConfig
    from draftsmith.drafters.dspark import DSparkConfig

    for cls in (DSparkConfig, DFlashConfig):
        for v in (float("inf"), float("nan"), -1.0):
            with pytest.raises(DraftsmithError, match=f"ce_weight must be a finite number >= 0, got {v}"):
                cls(ce_weight=v)
        assert cls(ce_weight=0.5).ce_weight == 0.5


@pytest.mark.parametrize("overwrite", [False, True])
def test_out_that_is_a_feature_cache_is_refused(tmp_path, overwrite):
    """train out=DIR where DIR is a feature cache (`draftsmith cache --out`, often data.cache itself):
    the run wrote config.json, model.safetensors and its checkpoints among the shards. Refused
    before anything loads (the target 't' does not exist: the error would be another), with
    --overwrite too (it deletes a run's files only)."""
    import re

    from draftsmith.train.trainer import Trainer

    out = tmp_path / "cache"
    out.mkdir()
    files = {"manifest.json": '{"kind": "draftsmith-target-cache"}\n', "shard-00000.safetensors": "x"}
    for name, text in files.items():
        (out / name).write_text(text)
    with pytest.raises(DraftsmithError, match=rf"^out={re.escape(str(out))} holds a feature cache \(manifest\.json\), "
                                              r"another job's output; training would write its files among it\."):
        Trainer(_cfg(out), CATALOGUE, overwrite=overwrite).fit()
    assert {f.name: f.read_text() for f in out.iterdir()} == files


def test_a_drafter_too_large_for_memory_is_refused_before_it_is_built(tiny_model_dir, tmp_path, monkeypatch):
    """drafter.num_layers=1000 built tens of GB of layers before anything said no. Now its size
    (a lower bound from the configs: draft layers as wide as the target's, 16 bytes a parameter
    to train) is checked against the free memory first, naming the override to lower. Here the
    free memory is made small; the cache does not exist (the error would be that one without)."""
    from draftsmith.drafters import dspark
    from draftsmith.drafters.kind_config import resolve_for_target
    from draftsmith.models import kv_cache
    from draftsmith.models.target import load_target
    from draftsmith.train.memory import draft_layer_params
    from draftsmith.train.trainer import Trainer

    tiny = tiny_model_dir("llama")
    cfg = parse_config({"target": str(tiny), "out": str(tmp_path / "run"), "drafter": {"kind": "dspark", "num_layers": 300},
                        "data": {"cache": str(tmp_path / "no-cache")}, "train": {"device": "cpu"}})
    monkeypatch.setattr(kv_cache, "free_memory", lambda device: 10**6)
    with pytest.raises(DraftsmithError, match=r"^the dspark drafter is too large to train here: 300 draft layer\(s\) of "
                                              r".* GB free; lower drafter\.num_layers=300$"):
        Trainer(cfg).fit()
    # the estimate is a lower bound of what is built, off only by the layers' norms
    target = load_target(str(tiny), device="cpu", dtype="float32")
    config = resolve_for_target(dspark.DSparkConfig(num_layers=2), target)
    layers, per_layer = draft_layer_params(config, target.model.config)
    built = sum(p.numel() for p in dspark.build(target.model, config).backbone.layers.parameters())
    assert layers == 2 and layers * per_layer <= built <= layers * per_layer * 1.05


def test_overwrite_keeps_the_earlier_run_when_the_drafter_is_too_large(tiny_model_dir, tmp_path, monkeypatch):
    """train out=R --overwrite drafter.num_layers=1000: --overwrite deleted R's checkpoints and
    weights, then the memory check refused the drafter. The refusal now comes first."""
    from draftsmith.models import kv_cache
    from draftsmith.train.trainer import Trainer

    out = tmp_path / "run"
    (out / "checkpoint-00000004").mkdir(parents=True)
    (out / "checkpoint-00000004" / "model.safetensors").write_text("old ckpt")
    files = {"config.json": '{"kind": "dspark"}\n', "model.safetensors": "weights", "train_info.json": "{}\n",
             "metrics.jsonl": "{}\n"}
    for name, text in files.items():
        (out / name).write_text(text)
    cfg = parse_config({"target": str(tiny_model_dir("llama")), "out": str(out),
                        "drafter": {"kind": "dspark", "num_layers": 1000},
                        "data": {"cache": str(tmp_path / "no-cache")}, "train": {"device": "cpu"}})
    monkeypatch.setattr(kv_cache, "free_memory", lambda device: 10**6)
    with pytest.raises(DraftsmithError, match=r"too large to train here"):
        Trainer(cfg, overwrite=True).fit()
    assert {f.name: f.read_text() for f in out.iterdir() if f.is_file()} == files
    assert (out / "checkpoint-00000004" / "model.safetensors").read_text() == "old ckpt"
    # ... and a later check that fails (here: data.cache names no cache) deletes nothing either
    cfg = parse_config({"target": str(tiny_model_dir("llama")), "out": str(out),
                        "drafter": {"kind": "dspark", "num_layers": 1, "layer_ids": [0, 1]},
                        "data": {"cache": str(tmp_path / "no-cache")}, "train": {"device": "cpu"}})
    monkeypatch.undo()
    with pytest.raises(DraftsmithError):
        Trainer(cfg, overwrite=True).fit()
    assert {f.name: f.read_text() for f in out.iterdir() if f.is_file()} == files
    assert (out / "checkpoint-00000004" / "model.safetensors").read_text() == "old ckpt"
