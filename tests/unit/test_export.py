"""Issue 13: exports in the layouts vLLM (speculators) and SGLang load (docs/FORMATS.md).

These are name / shape / dtype / config contract tests: SGLang's loader skips unknown tensor
names silently and vLLM reads a missing field differently from what our drafters compute, so
a wrong name or a dropped field is a silent zero-acceptance bug, not an error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.drafters import dflash, dspark, eagle3
from draftsmith.drafters.checkpoint import check_target, read_checkpoint_config, save_trained_drafter
from draftsmith.errors import DraftsmithError
from draftsmith.export.formats import export_drafter
from draftsmith.models.target import load_target


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return load_target(str(tiny_model_dir("llama", seed=0)))


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return load_target(str(tiny_model_dir("qwen3", seed=0)))


def _ckpt(tmp_path, target, model):
    d = tmp_path / "ckpt"
    save_trained_drafter(model, d, target.target_id, target.weights_hash)
    return d


def _export(tmp_path, target, model, fmt):
    out = export_drafter(_ckpt(tmp_path, target, model), target, fmt, tmp_path / fmt)
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("vocab", [128, None])
def test_eagle3_to_speculators(tmp_path, llama, vocab):
    model = eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=3, draft_vocab_size=vocab))
    cfg, t = _export(tmp_path, llama, model, "speculators")
    ours = model.state_dict()
    V = llama.model.config.vocab_size
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["norm_before_residual"] is False  # vLLM assumes True when the key is missing
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in model.config.layer_ids]  # vLLM: consumer ids
    assert cfg["draft_vocab_size"] == (vocab or V)  # speculators' default is 32000
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["num_aux_hidden_states"] == len(model.config.layer_ids)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    want = {"fc.weight", "norm.weight", "lm_head.weight"} | {"layers.0." + k[6:] for k in ours if k.startswith("layer.")}
    if vocab:
        want |= {"d2t", "t2d"}
        assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and int(t["t2d"].sum()) == vocab
    assert set(t) == want  # exactly: an extra or a misspelt name would be skipped by a loader
    assert torch.equal(t["layers.0.self_attn.q_proj.weight"], ours["layer.self_attn.q_proj.weight"])
    assert torch.equal(t["fc.weight"], ours["fc.weight"])


def test_eagle3_to_sglang(tmp_path, llama):
    model = eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=2))
    cfg, t = _export(tmp_path, llama, model, "sglang")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(model.config.layer_ids)  # producer ids
    assert cfg["draft_vocab_size"] == llama.model.config.vocab_size
    assert {k for k in t if k.startswith("midlayer.")} == {"midlayer." + k[6:] for k in model.state_dict()
                                                            if k.startswith("layer.")}
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(t)


def test_formats_refuse_what_they_cannot_express(tmp_path, llama, qwen3):
    with pytest.raises(DraftsmithError, match="q/k norms"):  # SGLang would drop them silently
        _export(tmp_path, qwen3, eagle3.build(qwen3.model, eagle3.Eagle3Config(ttt_steps=2)), "sglang")
    block = dspark.build(llama.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=8))
    with pytest.raises(DraftsmithError, match="q/k norms"):  # block layers have them in every format
        _export(tmp_path / "b", llama, block, "speculators")
    with pytest.raises(DraftsmithError, match="EAGLE-3 drafters only"):
        _export(tmp_path / "c", qwen3, dspark.build(qwen3.model, dspark.DSparkConfig(block_size=3, num_layers=1,
                                                                                       rank=8)), "sglang")


def test_dspark_to_speculators(tmp_path, qwen3):
    V = qwen3.model.config.vocab_size
    model = dspark.build(qwen3.model, dspark.DSparkConfig(block_size=4, num_layers=1, rank=8, draft_vocab_size=100))
    model.init_draft_vocab(torch.arange(V, 0, -1) % 37)  # a non-trivial vocabulary
    cfg, t = _export(tmp_path, qwen3, model, "speculators")
    c = model.config
    assert cfg["speculators_model_type"] == "dspark" and cfg["block_size"] == 4
    assert cfg["sample_from_anchor"] is True and cfg["sliding_window_non_causal"] is True
    assert cfg["markov_head_type"] == "vanilla" and cfg["markov_rank"] == 8
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in c.layer_ids]
    assert cfg["mask_token_id"] == c.mask_token_id and cfg["draft_vocab_size"] == 100
    ours = model.state_dict()
    assert torch.equal(t["hidden_norm.weight"], ours["backbone.ctx_norm.weight"])
    ids = model.backbone.vocab.ids
    assert torch.equal(t["lm_head.weight"], qwen3.model.lm_head.weight.detach()[ids])
    w1 = t["markov_head.markov_w1.weight"]
    assert w1.shape == (V, 8)
    index = model.backbone.vocab.index  # target id -> draft id, 100 = outside
    assert torch.equal(w1, ours["seq_head.w1.weight"][index])
    assert torch.equal(w1[ids[5]], ours["seq_head.w1.weight"][5])
    assert {"confidence_head.proj.weight", "markov_head.markov_w2.weight", "d2t", "t2d"} <= set(t)
    assert not [k for k in t if k.startswith(("backbone.", "seq_head."))]  # every name mapped


def test_dflash_to_speculators_and_the_cli(tmp_path, qwen3, capsys):
    mask_first = dflash.build(qwen3.model, dflash.DFlashConfig(block_size=4, num_layers=1, layout="mask-first"))
    cfg, _ = _export(tmp_path / "mask-first", qwen3, mask_first, "speculators")
    assert cfg["block_size"] == 5 and cfg["sample_from_anchor"] is False  # anchor + γ masks
    model = dflash.build(qwen3.model, dflash.DFlashConfig(block_size=4, num_layers=1))
    cfg, t = _export(tmp_path, qwen3, model, "speculators")
    assert cfg["block_size"] == 4 and cfg["sample_from_anchor"] is True  # anchor + γ-1 masks (vLLM's anchor-as-first)
    assert "d2t" not in t and "lm_head.weight" not in t  # full vocabulary: the verifier's own head
    ckpt = tmp_path / "ckpt"
    assert main(["export", "--target", str(qwen3.path), "--drafter", f"dflash:{ckpt}", "--format", "speculators",
                 "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "config.json").is_file()
    assert main(["export", "--target", str(qwen3.path), "--drafter", "ngram", "--format", "speculators",
                 "--out", str(tmp_path / "x")]) == 2
    assert "no trained weights" in capsys.readouterr().err


def test_block_drafter_of_a_llama_target_exports_with_qk_norm_layers(tmp_path, llama):
    """drafter.qk_norm=true gives a Llama-style target's DSpark drafter Qwen3-style layers,
    the only block layers speculators / vLLM have: it exports, q/k norm weights included, and
    still drafts losslessly here (greedy == plain)."""
    from draftsmith import LLM, SamplingParams

    cfg_ = dspark.DSparkConfig(block_size=3, num_layers=1, rank=8, qk_norm=True, init_from_target=True)
    model = dspark.build(llama.model, cfg_)
    assert model.backbone.cfg.qk_norm and not llama.model.config.qk_norm
    cfg, t = _export(tmp_path, llama, model, "speculators")
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= set(t)
    ckpt = tmp_path / "ckpt"
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    spec = LLM(str(llama.path), policy="fixed", drafter=f"dspark:{ckpt}", max_len=64).generate(["hi there"], p)[0].token_ids
    assert spec == LLM(str(llama.path), max_len=64).generate(["hi there"], p)[0].token_ids
    with pytest.raises(DraftsmithError, match="drafter.qk_norm=true"):  # the default follows the target
        _export(tmp_path / "b", llama, dspark.build(llama.model, dspark.DSparkConfig(block_size=3, num_layers=1,
                                                                                      rank=8)), "speculators")


# ---------------------------------------------------------------------------- import


def _round_trip(tmp_path, target, model):
    from draftsmith.export.importing import import_drafter

    src = export_drafter(_ckpt(tmp_path, target, model), target, "speculators", tmp_path / "spec")
    back = import_drafter(src, target, tmp_path / "imported")
    return src, back


# Non-default values for every training-only field (export/formats.py speculators_train_fields):
# what the speculators config has no place for travels in the "draftsmith" block.
_TRAIN = {
    "eagle3": dict(ttt_decay=0.6, freeze_lm_head=True),
    "dflash": dict(max_anchors=64, ce_weight=0.7, tv_weight=0.3, kl_weight=0.2, init_from_target=True,
                   position_decay=2.5),
    "dspark": dict(max_anchors=32, ce_weight=0.3, tv_weight=0.6, kl_weight=0.1, conf_weight=0.5,
                   init_from_target=True, position_decay=4.0),
}


def test_every_training_only_field_is_exercised():
    """A new config field that speculators cannot express must get a non-default value in _TRAIN,
    so that the round trip below checks that it survives."""
    import dataclasses

    from draftsmith.drafters.registry import get
    from draftsmith.export.formats import SPECULATORS_CARRIES, speculators_train_fields

    for kind, values in _TRAIN.items():
        cls = get(kind, trainable=True).config_cls
        names = {f.name for f in dataclasses.fields(cls)}
        assert SPECULATORS_CARRIES[kind] <= names, kind
        assert set(speculators_train_fields(kind)) == set(values) == names - SPECULATORS_CARRIES[kind], kind
        default = cls()
        assert all(getattr(default, k) != v for k, v in values.items()), kind


@pytest.mark.parametrize("which", ["eagle3-full", "eagle3-small", "dflash", "dflash-mask-first", "dspark-small",
                                   "dspark-rnn-qk"])
def test_speculators_import_inverts_export(tmp_path, llama, qwen3, which):
    """export -> import gives the same config, training-only fields included (they travel in
    the "draftsmith" block), and bit-equal weights, and the imported drafter proposes exactly
    what the original does (greedy outputs equal, same acceptance). A speculators directory
    without that block (another tool's) imports with our defaults for those fields."""
    import dataclasses

    from draftsmith import LLM, SamplingParams
    from draftsmith.drafters.registry import load_checkpoint_model
    from draftsmith.export.importing import import_drafter

    V = llama.model.config.vocab_size
    target = qwen3 if which.startswith("dflash") else llama
    torch.manual_seed(3)
    model = {
        "eagle3-full": lambda: eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=3, **_TRAIN["eagle3"])),
        "eagle3-small": lambda: eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=3, draft_vocab_size=100)),
        "dflash": lambda: dflash.build(qwen3.model, dflash.DFlashConfig(block_size=3, num_layers=2,
                                                                         **_TRAIN["dflash"])),
        "dflash-mask-first": lambda: dflash.build(qwen3.model, dflash.DFlashConfig(block_size=3, num_layers=1,
                                                                                    layout="mask-first")),
        "dspark-small": lambda: dspark.build(llama.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=8,
                                                                              draft_vocab_size=100, qk_norm=True,
                                                                              **_TRAIN["dspark"])),
        "dspark-rnn-qk": lambda: dspark.build(llama.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=8,
                                                                               head="rnn", qk_norm=True)),
    }[which]()
    if getattr(model.config, "draft_vocab_size", None):
        model.init_draft_vocab(torch.arange(V, 0, -1) % 37)
    with torch.no_grad():  # non-trivial values everywhere (fresh W2 / confidence heads are zero)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    src, back = _round_trip(tmp_path, target, model)
    kind = model.config.kind
    block = json.loads((src / "config.json").read_text())["draftsmith"]
    assert block["train"] == {f: getattr(model.config, f) for f in _TRAIN[kind]}
    loaded = load_checkpoint_model(back, target)
    ours = model.state_dict()
    assert loaded.config == model.config  # the whole config, training-only fields included
    assert set(loaded.state_dict()) == set(ours)
    for k, v in ours.items():
        assert torch.equal(loaded.state_dict()[k].cpu(), v.cpu()), k
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for ckpt in (tmp_path / "ckpt", back):
        llm = LLM(str(target.path), policy="fixed", drafter=f"{model.config.kind}:{ckpt}", max_len=64)
        runs.append((llm.generate(["abc abc abc", "hello"], p)[1].token_ids, llm.last_stats.draft_accepted))
    assert runs[0] == runs[1]
    cfg = json.loads((src / "config.json").read_text())
    del cfg["draftsmith"]  # as another tool writes it
    (src / "config.json").write_text(json.dumps(cfg))
    foreign = load_checkpoint_model(import_drafter(src, target, tmp_path / "foreign"), target)
    defaults = type(model.config)()
    assert foreign.config == dataclasses.replace(model.config, **{f: getattr(defaults, f) for f in _TRAIN[kind]})


def test_speculators_import_refuses_what_it_cannot_compute(tmp_path, llama, tiny_model_dir):
    from draftsmith.export.importing import import_drafter

    model = eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=2))
    src = export_drafter(_ckpt(tmp_path, llama, model), llama, "speculators", tmp_path / "spec")
    cfg = json.loads((src / "config.json").read_text())

    def attempt(**change):
        bad = {**cfg, **change}
        (src / "config.json").write_text(json.dumps({k: v for k, v in bad.items() if v is not None}))
        return import_drafter(src, llama, tmp_path / "out")

    with pytest.raises(DraftsmithError, match="norm_before_residual"):
        attempt(norm_before_residual=None)  # absent: vLLM reads true
    with pytest.raises(DraftsmithError, match="embeddings"):
        attempt(eagle_aux_hidden_state_layer_ids=[0, 2])
    with pytest.raises(DraftsmithError, match="another target"):
        other = load_target(str(tiny_model_dir("qwen3", seed=0)))
        (src / "config.json").write_text(json.dumps(cfg))
        import_drafter(src, other, tmp_path / "out2")
    # a reduced-vocab DSpark whose W1 rows outside the draft vocabulary differ: ours shares one row
    block = dspark.build(llama.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=4, draft_vocab_size=50,
                                                          qk_norm=True))
    src2 = export_drafter(_ckpt(tmp_path / "b", llama, block), llama, "speculators", tmp_path / "spec2")
    t = load_file(str(src2 / "model.safetensors"))
    t["markov_head.markov_w1.weight"] = torch.randn_like(t["markov_head.markov_w1.weight"])
    from safetensors.torch import save_file

    save_file(t, str(src2 / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="W1 rows"):
        import_drafter(src2, llama, tmp_path / "out3")


def test_import_cli_round_trip_and_one_line_errors(tmp_path, llama, capsys):
    model = eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=2))
    src = export_drafter(_ckpt(tmp_path, llama, model), llama, "speculators", tmp_path / "spec")
    assert main(["import", str(src), "--target", str(llama.path), "--out", str(tmp_path / "imp")]) == 0
    assert f"--drafter eagle3:{tmp_path / 'imp'}" in capsys.readouterr().out
    assert main(["import", str(tmp_path / "nowhere"), "--target", str(llama.path),
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0], err
    # a file (the weights, say) is named as one: it said "FILE/config.json does not exist"
    for argv in ([str(src / "model.safetensors")], ["--src", str(src / "config.json")]):
        assert main(["import", *argv, "--target", str(llama.path), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{argv[-1]} is a file, not a drafter directory; give the directory" in err[0], err
    assert not (tmp_path / "x").exists()


def test_export_and_import_refuse_to_replace_what_out_holds(tmp_path, llama, capsys):
    """A non-empty --out (a training run) or the directory being read is refused, before the
    target loads, unless --overwrite; nothing there changes. --overwrite replaces the drafter
    files only (import: also a calibration.json fitted to the old weights)."""
    ckpt = _ckpt(tmp_path, llama, eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=2)))
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.json", "model.safetensors", "train_info.json", "calibration.json"):
        (run / name).write_text(f"the run's {name}")
    snapshot = lambda d: {p.name: p.read_bytes() for p in d.iterdir()}  # noqa: E731
    run_before, ckpt_before = snapshot(run), snapshot(ckpt)
    target = ["--target", str(llama.path)]
    export = ["export", *target, "--drafter", f"eagle3:{ckpt}", "--format", "speculators", "--out"]

    def error(argv):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("draftsmith: error:"), lines
        return lines[0]

    assert "run is not empty; give a new --out, or pass --overwrite" in error([*export, str(run)])
    assert "is the checkpoint being read" in error([*export, str(ckpt)])
    spec = tmp_path / "spec"
    assert main([*export, str(spec)]) == 0
    spec_before = snapshot(spec)
    assert "run is not empty" in error(["import", str(spec), *target, "--out", str(run)])
    assert "is the drafter directory being read" in error(["import", str(spec), *target, "--out", str(spec)])
    with pytest.raises(DraftsmithError, match="not empty"):  # the library refuses too
        export_drafter(ckpt, llama, "speculators", run)
    assert snapshot(run) == run_before and snapshot(ckpt) == ckpt_before and snapshot(spec) == spec_before
    (tmp_path / "empty").mkdir()  # an empty directory is a fine --out
    assert main([*export, str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "config.json").read_bytes() == spec_before["config.json"]

    assert main(["import", str(spec), *target, "--out", str(run), "--overwrite"]) == 0
    capsys.readouterr()
    assert json.loads((run / "config.json").read_text())["kind"] == "eagle3"
    assert not (run / "calibration.json").exists()
    assert (run / "train_info.json").read_text() == "the run's train_info.json"
    assert main([*export, str(run), "--overwrite"]) == 0
    assert json.loads((run / "config.json").read_text())["speculators_model_type"] == "eagle3"


def test_export_carries_the_calibration_and_overwrite_drops_a_stale_one(tmp_path, llama):
    """An export writes the checkpoint's STS temperatures beside the weights (the same weights:
    `--drafter KIND:OUT` reads them); --overwrite with a drafter that has none removes the
    calibration.json an earlier export left there (it was read as this drafter's), and touches
    nothing else in the directory."""
    from draftsmith.drafters.calibration import STSFit
    from draftsmith.drafters.checkpoint import read_calibration, read_sts

    calibrated = _ckpt(tmp_path / "a", llama, eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=2)))
    (calibrated / "calibration.json").write_text(json.dumps({"temperatures": [1.5, 2.0], "n_bins": 10,
                                                             "fitted_on": {"temperature": 0.0}}))
    plain = _ckpt(tmp_path / "b", llama, eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=2)))
    out = tmp_path / "spec"
    export_drafter(calibrated, llama, "speculators", out)
    assert read_calibration(out) == (1.5, 2.0)
    assert read_sts(out) == STSFit((1.5, 2.0), greedy=True)  # the regime it was fitted in comes along
    (out / "notes.txt").write_text("the user's")
    export_drafter(plain, llama, "speculators", out, overwrite=True)
    assert read_calibration(out) is None and sorted(p.name for p in out.iterdir()) == \
        ["config.json", "model.safetensors", "notes.txt"]
    (calibrated / "calibration.json").write_text("{not json")  # refused before anything is written
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DraftsmithError, match="not a calibration file"):
        export_drafter(calibrated, llama, "speculators", out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_import_carries_the_calibration_as_export_does(tmp_path, llama, capsys):
    """export writes the checkpoint's calibration.json and `--drafter KIND:DIR` reads it, but
    import dropped it: export -> import lost the STS temperatures. import carries it; with
    --overwrite, one in --out that the source has none of is removed; a damaged one stops the
    import (one line) before anything is written."""
    from draftsmith.drafters.checkpoint import read_calibration, read_sts

    calibrated = _ckpt(tmp_path / "a", llama, eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=2)))
    (calibrated / "calibration.json").write_text(json.dumps({"temperatures": [1.5, 2.0], "n_bins": 10}))
    plain = _ckpt(tmp_path / "b", llama, eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=2)))
    spec = export_drafter(calibrated, llama, "speculators", tmp_path / "spec")
    plain_spec = export_drafter(plain, llama, "speculators", tmp_path / "plain-spec")
    imp = ["import", "--target", str(llama.path), "--out", str(tmp_path / "imp")]
    out = tmp_path / "imp"
    assert main([*imp, str(spec)]) == 0 and read_calibration(out) == (1.5, 2.0)
    assert read_sts(out).greedy is None  # (a file without a regime applies to every row, and stays so)
    assert main([*imp, str(plain_spec), "--overwrite"]) == 0 and read_calibration(out) is None
    assert main([*imp, str(spec), "--overwrite"]) == 0 and read_calibration(out) == (1.5, 2.0)
    capsys.readouterr()
    (spec / "calibration.json").write_text("{not json")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main([*imp, str(spec), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a calibration file" in err[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

@pytest.mark.parametrize("edit", [
    lambda c: c.update(transformer_layer_config="x"), lambda c: c.update(block_size="eight"),
    lambda c: c.pop("block_size"), lambda c: c.update(draft_vocab_size="big"), lambda c: c.update(markov_rank="r"),
    lambda c: c.update(markov_head_type=["x"]), lambda c: c["transformer_layer_config"].update(num_hidden_layers="two"),
])
def test_import_of_a_config_with_a_field_missing_or_of_another_type_is_one_error(tmp_path, qwen3, capsys, edit):
    """A speculators config.json with a field of the wrong type (or a required one missing) was a
    ValueError / KeyError / AttributeError / TypeError traceback from `import` and `--drafter
    KIND:DIR`; it is one error naming the directory and the field."""
    model = dspark.build(qwen3.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=4))
    src = export_drafter(_ckpt(tmp_path, qwen3, model), qwen3, "speculators", tmp_path / "spec")
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    argv = ["import", str(src), "--target", str(qwen3.path), "--out", str(tmp_path / "imp")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{src}: its config.json is not a speculators drafter config" in err[0], err
    assert not (tmp_path / "imp").exists()


def test_export_and_import_never_write_into_a_built_in_drafter(tmp_path, llama, monkeypatch, capsys):
    """`export --drafter dspark:smollm2-135m --out <its package directory> --overwrite` replaced the
    built-in drafter's weights and config inside the installed package (calibrate refuses to write
    there; export and import did not), and so did an import."""
    from draftsmith.drafters import builtin

    monkeypatch.setattr(builtin, "BUILTIN_ROOT", tmp_path / "package")
    shipped = tmp_path / "package" / "eagle3" / "shipped"
    shipped.mkdir(parents=True)
    (shipped / "config.json").write_text("the package's config")
    ckpt = _ckpt(tmp_path, llama, eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=2)))
    spec = export_drafter(ckpt, llama, "speculators", tmp_path / "spec")
    target = ["--target", str(llama.path)]
    for argv in (["export", *target, "--drafter", f"eagle3:{ckpt}", "--format", "speculators"],
                 ["import", str(spec), *target]):
        for out in (shipped, shipped.parent / "new"):
            for flag in (["--overwrite"], []):  # without it: not "not empty ... pass --overwrite", then refused
                assert main([*argv, "--out", str(out), *flag]) == 2
                err = capsys.readouterr().err.strip().splitlines()
                assert len(err) == 1 and "is inside Draftsmith's built-in drafters" in err[0], err
                assert "pass --overwrite" not in err[0], err
    assert [p.name for p in shipped.iterdir()] == ["config.json"] and not (shipped.parent / "new").exists()
    assert (shipped / "config.json").read_text() == "the package's config"
    with pytest.raises(DraftsmithError, match="built-in drafters"):
        export_drafter(ckpt, llama, "speculators", shipped, overwrite=True)


def test_export_refuses_a_checkpoint_given_as_another_kind(tmp_path, llama, capsys):
    """`export --drafter dspark:EAGLE3_CKPT` exported the EAGLE-3 drafter and said it wrote 'the
    dspark drafter': KIND was not checked against the checkpoint (every other job refuses it). It is
    refused with every job's words (drafters/checkpoint.check_kind, check_target's rule) before the
    target loads and before anything is written."""
    ckpt = _ckpt(tmp_path, llama, eagle3.build(llama.model, eagle3.Eagle3Config(ttt_steps=2)))
    out = tmp_path / "out"
    assert main(["export", "--target", str(llama.path), "--drafter", f"dspark:{ckpt}", "--format", "speculators",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (f"draftsmith: error: drafter checkpoint {ckpt} does not fit: it is a "
                                        f"'eagle3' drafter, not 'dspark' (use --drafter eagle3:{ckpt})"), err
    assert not out.exists()
    with pytest.raises(DraftsmithError) as every_job:  # what generate / eval / ... say (load_trained_model)
        check_target(read_checkpoint_config(ckpt), llama.target_id, llama.weights_hash, str(ckpt), kind="dspark")
    assert err[0] == f"draftsmith: error: {every_job.value}"
    # before the target loads: a target that is not there is never reached
    assert main(["export", "--target", str(tmp_path / "no-target"), "--drafter", f"dspark:{ckpt}", "--format",
                 "speculators", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a 'eagle3' drafter, not 'dspark'" in err[0], err
    assert not out.exists()
