"""`draftsmith import` detects a drafter directory's layout from its config.json, and
`--drafter KIND:DIR` takes a foreign directory directly (export/detect.py, drafters/checkpoint.py):
speculators, DeepSpec and z-lab DFlash directories run in generate / eval like our own."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.cli import main
from draftsmith.data.sources.conversation import split_of
from draftsmith.drafters import dflash, dspark, eagle3, registry
from draftsmith.drafters.checkpoint import read_checkpoint_config, save_trained_drafter
from draftsmith.errors import DraftsmithError
from draftsmith.export.detect import detect_format
from draftsmith.export.formats import export_drafter
from draftsmith.models.target import load_target


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return load_target(str(tiny_model_dir("qwen3", seed=0, num_hidden_layers=6)))


@pytest.fixture(scope="module")
def exports(qwen3, tmp_path_factory):
    """One directory per layout: our checkpoints, and their exports (DeepSpec: a run directory)."""
    root = tmp_path_factory.mktemp("exports")
    torch.manual_seed(3)
    models = {
        "dflash": dflash.build(qwen3.model, dflash.DFlashConfig(block_size=3, num_layers=1, layer_ids=(0, 2),
                                                                layout="mask-first")),  # z-lab's layout
        "dspark": dspark.build(qwen3.model, dspark.DSparkConfig(block_size=4, num_layers=1, rank=4, layer_ids=(0, 2))),
        "eagle3": eagle3.build(qwen3.model, eagle3.Eagle3Config(ttt_steps=2, layer_ids=(0, 1, 2, 3, 4))),
    }
    dirs = {}
    for kind, model in models.items():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        dirs[kind] = save_trained_drafter(model, root / kind, qwen3.target_id, qwen3.weights_hash)
    dirs["speculators"] = export_drafter(dirs["eagle3"], qwen3, "speculators", root / "spec-eagle3")
    dirs["deepspec"] = export_drafter(dirs["dspark"], qwen3, "deepspec", root / "run" / "step_3")
    (root / "run" / "step_latest").symlink_to(dirs["deepspec"])
    dirs["deepspec-run"] = root / "run"
    dirs["dflash-native"] = export_drafter(dirs["dflash"], qwen3, "dflash-native", root / "zlab")
    return dirs


def test_detect_format_by_markers(exports, tmp_path):
    assert detect_format(exports["dflash"]) == "draftsmith"
    for fmt in ("speculators", "deepspec", "dflash-native"):
        assert detect_format(exports[fmt]) == fmt
    assert detect_format(exports["deepspec-run"]) == "deepspec"  # through step_latest

    def write(cfg):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    with pytest.raises(DraftsmithError, match="cannot tell the format"):
        detect_format(write({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    with pytest.raises(DraftsmithError, match="speculators and dflash-native"):
        detect_format(write({"speculators_model_type": "dflash", "dflash_config": {}}))
    assert detect_format(write({"architectures": ["DFlashDraftModel"]})) == "dflash-native"
    assert detect_format(write({"architectures": ["Gemma4DSparkModel"]})) == "deepspec"  # its importer says why not


@pytest.mark.parametrize("fmt,kind", [("speculators", "eagle3"), ("deepspec-run", "dspark"),
                                      ("dflash-native", "dflash")])
def test_import_cli_detects_the_format(exports, qwen3, tmp_path, capsys, fmt, kind):
    """No --format: detected, and the import equals the original checkpoint bit for bit."""
    out = tmp_path / "imp"
    assert main(["import", str(exports[fmt]), "--target", str(qwen3.path), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "format, detected" in said and f"--drafter {kind}:{out}" in said
    a = registry.load_checkpoint_model(out, qwen3).state_dict()
    b = registry.load_checkpoint_model(exports[kind], qwen3).state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_import_cli_one_line_errors(exports, qwen3, tmp_path, capsys):
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    ours = exports["dflash"]
    for src, says in ((unknown, "cannot tell the format"), (tmp_path / "nowhere", "does not exist"),
                      (ours, f"already a Draftsmith checkpoint; use it as --drafter dflash:{ours}")):
        assert main(["import", str(src), "--target", str(qwen3.path), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


def test_import_takes_the_directory_as_dir_and_src_as_its_old_spelling(exports, qwen3, tmp_path, capsys):
    """`draftsmith import DIR --out CKPT`; `--src DIR` is still accepted (the same directory twice
    too). Two different directories: a one-line error; none: argparse's usage error naming DIR."""
    from pathlib import Path

    from draftsmith.cli import build_parser
    from draftsmith.cli.imports import source_dir

    parser = build_parser()
    for argv in (["import", "D", "--out", "O"], ["import", "--target", "T", "D", "--out", "O"],
                 ["import", "--out", "O", "--format", "deepspec", "D"], ["import", "--src", "D", "--out", "O"],
                 ["import", "D", "--src", "D", "--out", "O"]):
        assert source_dir(parser.parse_args(argv)) == Path("D"), argv
    src, out = exports["speculators"], tmp_path / "imp"
    assert main(["import", "--target", str(qwen3.path), "--src", str(src), "--out", str(out)]) == 0  # the old form
    assert f"--drafter eagle3:{out}" in capsys.readouterr().out
    assert main(["import", str(src), "--src", str(tmp_path / "other"), "--target", str(qwen3.path),
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "two source directories" in err[0], err
    with pytest.raises(SystemExit) as e:
        main(["import", "--target", str(qwen3.path), "--out", str(tmp_path / "x")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: draftsmith import" in err and "required: DIR" in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("fmt,kind", [("speculators", "eagle3"), ("deepspec", "dspark"), ("deepspec-run", "dspark"),
                                      ("dflash-native", "dflash")])
def test_a_foreign_directory_is_a_drafter_spec(exports, qwen3, fmt, kind):
    """KIND:DIR on a foreign directory imports it in memory: the same model as our checkpoint,
    and read_checkpoint_config gives eval / bench its kind and draft length in our terms."""
    src = exports[fmt]
    summary = read_checkpoint_config(src)
    ours = read_checkpoint_config(exports[kind])
    steps = "ttt_steps" if kind == "eagle3" else "block_size"
    assert summary["kind"] == kind and summary[steps] == ours[steps]
    assert summary["format"] == fmt.removesuffix("-run")
    a = registry.load_checkpoint_model(src, qwen3).state_dict()
    b = registry.load_checkpoint_model(exports[kind], qwen3).state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    drafter = registry.build_drafter(f"{kind}:{src}", qwen3, 2, 64)
    assert drafter is not None


def test_a_foreign_directory_must_be_given_as_the_kind_it_imports_as(exports, qwen3):
    with pytest.raises(DraftsmithError, match="imports as a dspark drafter, not dflash; use --drafter dspark:"):
        registry.build_drafter(f"dflash:{exports['deepspec']}", qwen3, 2, 64)
    with pytest.raises(DraftsmithError, match="imports as a dflash drafter, not dspark"):
        registry.build_drafter(f"dspark:{exports['dflash-native']}", qwen3, 2, 64)


def test_generate_and_eval_take_a_foreign_directory(exports, qwen3, tmp_path, capsys):
    """The z-lab export as --drafter dflash:DIR: generate drafts and stays lossless, eval
    measures it with the draft length read from the foreign config."""
    spec = f"dflash:{exports['dflash-native']}"
    args = ["generate", "--target", str(qwen3.path), "--policy", "fixed", "--prompt", "ab", "--max-new-tokens", "10", "--json"]
    capsys.readouterr()
    assert main(args + ["--drafter", spec]) == 0
    spec_out = json.loads(capsys.readouterr().out)
    assert main(args + ["--drafter", f"dflash:{exports['dflash']}"]) == 0
    ours_out = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    plain_out = json.loads(capsys.readouterr().out)
    assert spec_out["results"][0]["token_ids"] == plain_out["results"][0]["token_ids"]  # greedy: lossless
    assert spec_out["stats"]["draft_proposed"] > 0
    assert {k: spec_out["stats"][k] for k in ("draft_proposed", "draft_accepted")} == \
        {k: ours_out["stats"][k] for k in ("draft_proposed", "draft_accepted")}

    ids = [f"p{i}" for i in range(4000) if split_of(f"file:prompts.jsonl/p{i}") == "heldout"][:2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"abc abc {i}"}) + "\n" for i in ids))
    assert main(["eval", "--target", str(qwen3.path), "--drafter", spec, "--tasks", str(prompts), "--max-prompts", "2",
                 "--max-new-tokens", "8", "--no-progress", "--out", str(tmp_path / "eval")]) == 0
    (drafter,) = json.loads((tmp_path / "eval" / "report.json").read_text())["drafters"]
    assert drafter["kind"] == "dflash" and drafter["overall"]["rounds"] > 0


def test_export_converts_a_foreign_directory(exports, qwen3, tmp_path):
    """export --drafter dflash:ZLAB_DIR --format speculators converts between foreign formats:
    the same files as exporting our own checkpoint."""
    from safetensors.torch import load_file

    for name, ckpt in (("via-zlab", exports["dflash-native"]), ("direct", exports["dflash"])):
        assert main(["export", "--target", str(qwen3.path), "--drafter", f"dflash:{ckpt}", "--format", "speculators",
                     "--out", str(tmp_path / name)]) == 0
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("via-zlab", "direct"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    cfg_a, cfg_b = (json.loads((tmp_path / n / "config.json").read_text()) for n in ("via-zlab", "direct"))
    assert cfg_a == cfg_b


@pytest.mark.parametrize("value, field", [(["greedy"], "speculators_config must be an object"),
                                          ("greedy", "speculators_config must be an object"),
                                          ({"proposal_methods": "greedy"}, "proposal_methods must be a list of objects"),
                                          ({"proposal_methods": [3]}, "proposal_methods must be a list of objects")])
def test_a_speculators_config_of_another_shape_is_one_error_naming_it(exports, qwen3, tmp_path, capsys, value,
                                                                      field):
    """generate --drafter eagle3:DIR reads the draft length from the foreign config.json first: a
    speculators_config that is a list or a string (or proposal methods that are no objects) was an
    AttributeError / KeyError traceback there, before the importer could name the field; then the
    importer said "('list' object has no attribute 'get')": it names the field and what it expects."""
    import shutil

    d = tmp_path / "odd"
    shutil.copytree(exports["speculators"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["speculators_config"] = value
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_checkpoint_config(d)["ttt_steps"] == 7  # no draft length in it: vLLM's default
    capsys.readouterr()
    out = tmp_path / "imported"
    for argv in (["generate", "--target", str(qwen3.path), "--drafter", f"eagle3:{d}", "--prompt", "ab",
                  "--max-tokens", "4"],
                 ["import", str(d), "--target", str(qwen3.path), "--out", str(out)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{d}: speculators_config" in err[0] and field in err[0], err
        assert "has no attribute" not in err[0], err
    assert not out.exists()
