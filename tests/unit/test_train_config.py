"""Recipe validation: every mistake gets one clear message naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.train.config import apply_overrides, load_train_config, parse_config

from standin_drafter import CATALOGUE

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def base(**changes):
    raw = {"target": "t", "out": "runs/x", "drafter": {"kind": "head", "layer_ids": [0, 2], "block_size": 3},
           "data": {"cache": "cache/"}, "train": {"lr": 1e-3}}
    for k, v in changes.items():
        raw = apply_overrides(raw, [f"{k}={v}"])
    return raw


def parse(raw, num_layers=3):
    return parse_config(raw, CATALOGUE, source="recipe.yaml", num_layers=num_layers)


def test_valid_recipe_becomes_frozen_dataclasses():
    cfg = parse(base())
    assert cfg.kind == "head" and cfg.drafter.layer_ids == (0, 2) and cfg.drafter.block_size == 3
    assert cfg.train.lr == 1e-3 and cfg.train.warmup_ratio == 0.04 and cfg.train.grad_clip == 1.0
    assert cfg.data.cache == Path("cache/") and not cfg.data.online
    with pytest.raises(Exception):
        cfg.train.lr = 1.0  # frozen
    assert parse(cfg.to_dict()) == cfg  # round trip


@pytest.mark.parametrize("key,value,expect", [
    ("train.lrr", "1e-3", r"train\.lrr: unknown field; did you mean 'lr'\?"),
    ("data.cach", "x", r"data\.cach: unknown field; did you mean 'cache'\?"),
    ("drafter.blok_size", "3", r"drafter\.blok_size: unknown field; did you mean 'block_size'\?"),
    ("optimizer", "adam", r"optimizer: unknown field"),
])
def test_unknown_field(key, value, expect):
    with pytest.raises(DraftsmithError, match=expect):
        parse(base(**{key: value}))


@pytest.mark.parametrize("key,value,expect", [
    ("train.lr", "fast", r"recipe\.yaml: train\.lr: Input should be a valid number.*'fast'"),
    ("train.batch_size", "2.5", r"train\.batch_size: Input should be a valid integer"),
    ("train.dtype", "fp8", r"train\.dtype: Input should be 'auto', 'fp32' or 'bf16'"),
    ("drafter.block_size", "[1, 2]", r"drafter\.block_size: Input should be a valid integer"),
    ("drafter.layer_ids", "first", r"drafter\.layer_ids: Input should be a valid tuple"),
])
def test_wrong_type(key, value, expect):
    with pytest.raises(DraftsmithError, match=expect):
        parse(base(**{key: value}))


def test_layer_id_out_of_range():
    with pytest.raises(DraftsmithError, match=r"drafter\.layer_ids \[3\] out of range: the target has 3 layers"):
        parse(base(**{"drafter.layer_ids": "[0, 3]"}))
    with pytest.raises(DraftsmithError, match="repeats"):
        parse(base(**{"drafter.layer_ids": "[1, 1]"}))


@pytest.mark.parametrize("value", [0, -2])
def test_block_size_below_one(value):
    with pytest.raises(DraftsmithError, match=rf"drafter\.block_size must be >= 1.*got {value}"):
        parse(base(**{"drafter.block_size": value}))


def test_other_errors():
    with pytest.raises(DraftsmithError, match=r"drafter\.kind 'haed' is not a trainable kind \(did you mean 'head'\?\)"):
        parse(base(**{"drafter.kind": "haed"}))
    with pytest.raises(DraftsmithError, match=r"out: required field is missing"):
        parse({k: v for k, v in base().items() if k != "out"})
    with pytest.raises(DraftsmithError, match="data.online=true needs data.regen"):
        parse(base(**{"data.online": "true"}))
    with pytest.raises(DraftsmithError, match=r"train\.warmup_ratio: Input should be less than 1"):
        parse(base(**{"train.warmup_ratio": 1.5}))
    with pytest.raises(DraftsmithError, match="not of the form key=value"):
        apply_overrides({}, ["train.lr"])
    with pytest.raises(DraftsmithError, match="is a value, not a section"):
        apply_overrides({"train": 3}, ["train.lr=1"])


def test_overrides_parse_yaml_values_and_nest():
    raw = apply_overrides({"train": {"lr": 1.0}}, ["train.lr=3e-4", "train.betas=[0.9, 0.99]", "data.online=true",
                                                    "data.max_samples=null", "drafter.kind=head"])
    assert raw == {"train": {"lr": 3e-4, "betas": [0.9, 0.99]}, "data": {"online": True, "max_samples": None},
                   "drafter": {"kind": "head"}}


def test_recipe_file_errors(tmp_path):
    with pytest.raises(DraftsmithError, match="does not exist"):
        load_train_config(tmp_path / "nope.yaml", catalogue=CATALOGUE, check_target=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(DraftsmithError, match="not valid YAML"):
        load_train_config(bad, catalogue=CATALOGUE, check_target=False)
    ok = tmp_path / "ok.yaml"
    ok.write_text("out: runs/a\ndrafter: {kind: head}\ndata: {cache: c}\n")
    cfg = load_train_config(ok, ["train.max_steps=5"], budget_minutes=2.5, catalogue=CATALOGUE, check_target=False)
    assert cfg.train.max_steps == 5 and cfg.train.budget_minutes == 2.5


def test_layer_ids_checked_against_the_real_target_depth(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")  # 3 layers
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {target}\nout: runs/a\ndrafter: {{kind: head, layer_ids: [0, 5]}}\ndata: {{cache: c}}\n")
    with pytest.raises(DraftsmithError, match=r"\[5\] out of range: the target has 3 layers"):
        load_train_config(recipe, catalogue=CATALOGUE)


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("smollm2-135m-*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_parse(recipe):
    cfg = load_train_config(recipe, check_target=False)  # the registry's trainable kinds
    assert cfg.target == "smollm2-135m" and cfg.kind in recipe.stem


def test_a_recipe_that_is_not_text_is_one_error(tmp_path):
    """A binary or non-UTF-8 --config was a UnicodeDecodeError traceback."""
    for i, raw in enumerate((b"\x9d\x00\xff\xfe binary", "train: {lr: 1e-3}  # caf\xe9\n".encode("latin-1"))):
        f = tmp_path / f"bin{i}.json"
        f.write_bytes(raw)
        with pytest.raises(DraftsmithError, match=r"recipe .*bin\d\.json is not UTF-8 text; give a recipe YAML file"):
            load_train_config(f, catalogue=CATALOGUE, check_target=False)


def test_recipes_that_would_recurse_forever_are_one_error(tmp_path):
    """A YAML alias inside itself (`a: &a [*a]`), deep nesting and aliases of aliases were a
    RecursionError traceback (or a hang); so were the same in a KEY=VALUE override."""
    laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 8))
    for text, why in (("a: &a [*a]\n", r"a YAML alias refers to a list or mapping that contains it"),
                      ("train: {betas: &b [0.9, {x: *b}]}\n", "contains it"),
                      ("a: " + "[" * 5000 + "]" * 5000 + "\n", "is nested too deeply to read"),
                      ("a: " + "[" * 40 + "]" * 40 + "\n", "is nested more than 32 levels deep"),
                      (laughs, "expands to more than 100000 values")):
        f = tmp_path / "r.yaml"
        f.write_text(text)
        with pytest.raises(DraftsmithError, match=r"recipe .*r\.yaml.*" + why):
            load_train_config(f, catalogue=CATALOGUE, check_target=False)
    shared = tmp_path / "shared.yaml"  # an alias used twice is fine: the recipe is read to its fields
    shared.write_text("drafter: &d {kind: head}\nout: runs/a\ndata: {cache: c}\nx_unused: *d\n")
    with pytest.raises(DraftsmithError, match="x_unused: unknown field"):
        load_train_config(shared, catalogue=CATALOGUE, check_target=False)
    with pytest.raises(DraftsmithError, match=r"override train\.betas=…: a YAML alias"):
        apply_overrides({}, ["train.betas=&a [*a]"])
    with pytest.raises(DraftsmithError, match=r"override train\.betas=…: the value is nested too deeply"):
        apply_overrides({}, ["train.betas=" + "[" * 5000])


def test_a_recipe_that_is_a_directory_is_named_so(tmp_path):
    """`train --config /tmp` said "recipe /tmp does not exist"."""
    with pytest.raises(DraftsmithError, match=r"recipe .* is a directory; give the recipe YAML file"):
        load_train_config(tmp_path, catalogue=CATALOGUE, check_target=False)
