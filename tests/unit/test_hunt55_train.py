"""Bad input to `draftsmith train` found by hunt 55: each case was a traceback, a confusing
error or a silently replaced drafter, and is now one line naming what to change."""

from __future__ import annotations

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
