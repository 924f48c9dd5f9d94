"""DeepSpec's checkpoint layout, both ways (export/deepspec.py, docs/FORMATS.md §5).

DeepSpec loads with HF `from_pretrained`, which fills a missing or misspelt tensor with a fresh
random init and ignores an extra one: a wrong name is a silent zero-acceptance bug. So the
contract tests assert exact name sets, shapes, dtypes and config fields; the round trips
assert bit-equal state dicts and equal greedy outputs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.cli import main
from draftsmith.drafters import dflash, dspark, eagle3
from draftsmith.drafters.checkpoint import save_trained_drafter
from draftsmith.errors import DraftsmithError
from draftsmith.export.formats import export_drafter
from draftsmith.export.importing import import_drafter
from draftsmith.models.target import load_target


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return load_target(str(tiny_model_dir("qwen3", seed=0)))


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return load_target(str(tiny_model_dir("llama", seed=0)))


@pytest.fixture(scope="module")
def qwen3_deep(tiny_model_dir):
    """Six layers: room for EAGLE-3's five feature layers without the last one."""
    return load_target(str(tiny_model_dir("qwen3", seed=0, num_hidden_layers=6)))


def _perturb(model):
    torch.manual_seed(3)
    with torch.no_grad():  # non-trivial values everywhere (fresh W2 / confidence heads are zero)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return model


def _dspark(target, **kw):
    kw = {"block_size": 3, "num_layers": 1, "rank": 8, "layer_ids": (0, 1), **kw}
    return _perturb(dspark.build(target.model, dspark.DSparkConfig(**kw)))


def _eagle3(target, **kw):
    kw = {"ttt_steps": 3, "layer_ids": (0, 1, 2, 3, 4), **kw}
    return _perturb(eagle3.build(target.model, eagle3.Eagle3Config(**kw)))


def _ckpt(tmp_path, target, model):
    return save_trained_drafter(model, tmp_path / "ckpt", target.target_id, target.weights_hash)


def _export(tmp_path, target, model):
    out = export_drafter(_ckpt(tmp_path, target, model), target, "deepspec", tmp_path / "step_1")
    return out, json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


def _layer_names(prefix: str, n: int, eagle: bool = False) -> set[str]:
    per = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
           "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
           "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    if eagle:
        per.add("hidden_norm.weight")
    return {f"{prefix}{i}.{p}" for i in range(n) for p in per}


# ---------------------------------------------------------------------------- export contract


@pytest.mark.parametrize("head", ["markov", "gated", "rnn"])
def test_dspark_to_deepspec_names_shapes_and_config(tmp_path, qwen3, head):
    model = _dspark(qwen3, head=head, num_layers=2)
    _, cfg, t = _export(tmp_path, qwen3, model)
    tc, c = qwen3.model.config, model.config
    V, H, r = tc.vocab_size, tc.hidden_size, 8
    want = {"embed_tokens.weight", "lm_head.weight", "fc.weight", "hidden_norm.weight", "norm.weight",
            "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} | _layer_names("layers.", 2)
    want |= {"gated": {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"},
             "rnn": {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}}.get(head, set())
    assert set(t) == want  # exactly: from_pretrained would random-init a missing name and drop an extra one
    shapes = {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "fc.weight": (H, 2 * H),
              "markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r),
              "confidence_head.proj.weight": (1, H + r), "confidence_head.proj.bias": (1,),
              "markov_head.gate_proj.weight": (r, H + r), "markov_head.joint_proj.weight": (3 * r, 2 * r + H)}
    for k, s in shapes.items():
        if k in t:
            assert tuple(t[k].shape) == s, k
    assert all(v.dtype == torch.float32 for v in t.values())  # one dtype, the drafter's
    assert torch.equal(t["embed_tokens.weight"], qwen3.model.model.embed_tokens.weight.detach())
    assert torch.equal(t["lm_head.weight"], qwen3.model.lm_head.weight.detach())
    ours = model.state_dict()
    assert torch.equal(t["hidden_norm.weight"], ours["backbone.ctx_norm.weight"])
    assert torch.equal(t["markov_head.markov_w2.weight"], ours["seq_head.w2.weight"])
    assert torch.equal(t["layers.1.self_attn.k_norm.weight"], ours["backbone.layers.1.self_attn.k_norm.weight"])
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    expect = {"num_target_layers": tc.num_layers, "num_hidden_layers": 2, "block_size": c.block_size,
              "mask_token_id": c.mask_token_id, "target_layer_ids": [0, 1],  # producer ids: ours, unchanged
              "num_anchors": c.max_anchors, "markov_rank": r,
              "markov_head_type": {"markov": "vanilla"}.get(head, head), "enable_confidence_head": True,
              "confidence_head_with_markov": True, "tie_word_embeddings": False,
              "layer_types": ["full_attention"] * 2, "head_dim": tc.head_dim, "attention_bias": False,
              "vocab_size": V, "hidden_size": H, "intermediate_size": tc.intermediate_size,
              "sample_from_anchor": True, "dtype": "float32"}
    assert {k: cfg.get(k) for k in expect} == expect
    # keys another reader would take first, with another numbering or meaning
    assert not {"eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids", "dflash_config",
                "speculators_model_type", "draft_vocab_size", "torch_dtype"} & set(cfg)


def test_eagle3_to_deepspec_names_shapes_and_config(tmp_path, qwen3_deep):
    model = _eagle3(qwen3_deep)
    _, cfg, t = _export(tmp_path, qwen3_deep, model)
    tc = qwen3_deep.model.config
    V, H = tc.vocab_size, tc.hidden_size
    want = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight"} | _layer_names("layers.", 1, True)
    assert set(t) == want
    assert tuple(t["fc.weight"].shape) == (H, 5 * H) and tuple(t["lm_head.weight"].shape) == (V, H)
    assert tuple(t["layers.0.self_attn.q_proj.weight"].shape) == (tc.num_heads * tc.head_dim, 2 * H)
    ours = model.state_dict()
    assert torch.equal(t["lm_head.weight"], ours["lm_head.weight"])  # the drafter's own head
    assert torch.equal(t["layers.0.hidden_norm.weight"], ours["layer.hidden_norm.weight"])
    assert torch.equal(t["embed_tokens.weight"], qwen3_deep.model.model.embed_tokens.weight.detach())
    expect = {"architectures": ["Qwen3Eagle3Model"], "num_target_layers": 6, "num_hidden_layers": 1,
              "draft_num_hidden_layers": 1, "target_layer_ids": [0, 1, 2, 3, 4], "ttt_length": 3,
              "step_loss_decay": 0.8, "tie_word_embeddings": False, "layer_types": ["full_attention"]}
    assert {k: cfg.get(k) for k in expect} == expect
    assert cfg["target_model_name_or_path"] == str(qwen3_deep.path)


def test_export_refuses_what_deepspec_cannot_express(tmp_path, qwen3, llama, qwen3_deep):
    def refused(target, model, match):
        with pytest.raises(DraftsmithError, match=match):
            _export(tmp_path / str(len(list(tmp_path.iterdir()))), target, model)

    refused(qwen3, dflash.build(qwen3.model, dflash.DFlashConfig(block_size=3, num_layers=1, layer_ids=(0, 1),
                                                                 layout="mask-first")), "mask-first")
    small = _dspark(qwen3, draft_vocab_size=100)
    small.init_draft_vocab(torch.arange(qwen3.model.config.vocab_size, 0, -1) % 37)
    refused(qwen3, small, "reduced draft vocabulary")
    refused(llama, _dspark(llama), "drafter.qk_norm=true")  # Llama-style layers have no q/k norms
    refused(qwen3, _dspark(qwen3, layer_ids=(0, 2)), "last target layer")  # L-1: post-norm in DeepSpec's eval
    refused(qwen3_deep, _eagle3(qwen3_deep, layer_ids=(0, 2, 4)), "exactly 5")
    refused(qwen3_deep, _eagle3(qwen3_deep, layer_ids=(0, 1, 2, 3, 5)), "last target layer")
    refused(qwen3_deep, _eagle3(qwen3_deep, draft_vocab_size=100), "reduced draft vocabulary")
    refused(llama, _eagle3(llama, layer_ids=(0, 1)), "only for Qwen3 targets")


# ---------------------------------------------------------------------------- round trips


def _greedy(target, spec):
    """Greedy outputs and accepted drafts: the outputs always equal plain decoding (lossless),
    the acceptance shows that the drafts themselves are the same. One thread: tiny ops spend
    more time in OpenMP barriers than in arithmetic (restored after, for the tests that follow)."""
    from draftsmith import LLM, SamplingParams

    threads = torch.get_num_threads()
    try:
        llm = LLM(str(target.path), policy="fixed", drafter=spec, max_len=64, threads=1)
        out = llm.generate(["abc abc abc", "hello"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        return [o.token_ids for o in out], llm.last_stats.draft_accepted
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("which", ["dspark-qwen3", "dspark-gated-qwen3", "dspark-rnn-llama-qk", "eagle3-qwen3",
                                   "dflash-qwen3"])
def test_deepspec_import_inverts_export(tmp_path, qwen3, llama, qwen3_deep, which):
    """export -> import gives the same config, bit-equal weights and the same greedy drafts."""
    from draftsmith.drafters.registry import load_checkpoint_model

    target, model = {
        "dspark-qwen3": lambda: (qwen3, _dspark(qwen3, num_layers=2, ce_weight=0.3, position_decay=2.0)),
        "dspark-gated-qwen3": lambda: (qwen3, _dspark(qwen3, head="gated", intermediate_size=64)),
        "dspark-rnn-llama-qk": lambda: (llama, _dspark(llama, head="rnn", qk_norm=True)),
        "eagle3-qwen3": lambda: (qwen3_deep, _eagle3(qwen3_deep, ttt_decay=0.7)),
        "dflash-qwen3": lambda: (qwen3, _perturb(dflash.build(qwen3.model, dflash.DFlashConfig(
            block_size=3, num_layers=2, layer_ids=(0, 1), position_decay=4.0)))),  # anchor-first: the baseline
    }[which]()
    src, _, _ = _export(tmp_path, target, model)
    back = import_drafter(src, target, tmp_path / "imported", fmt="deepspec")
    loaded = load_checkpoint_model(back, target)
    ours = model.state_dict()
    assert loaded.config == model.config
    assert set(loaded.state_dict()) == set(ours)
    for k, v in ours.items():
        assert torch.equal(loaded.state_dict()[k].cpu(), v.cpu()), k
    kind = model.config.kind
    assert _greedy(target, f"{kind}:{tmp_path / 'ckpt'}") == _greedy(target, f"{kind}:{back}")


_GEMMA6 = dict(num_hidden_layers=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)


@pytest.mark.parametrize("which", ["gemma3-dspark", "gemma3-4x-config-dspark", "gemma3-eagle3", "qwen3_moe-dspark"])
def test_gemma3_and_qwen3_moe_targets_export_their_global_rope(tmp_path, tiny_model_dir, which):
    """The draft layers are Qwen3 layers for any target, with the target's *global* RoPE. For a
    Gemma 3 target (transformers 5 spelling: rope_parameters per layer type) the exports used to
    copy Gemma's RoPE entry, which HF's Qwen3 rotary embedding (DeepSpec's, vLLM's config) cannot
    read and our importer refused ("made for another target"). Now: the RoPE a Qwen3 reader
    builds from the DeepSpec and speculators configs is bit-equal to the drafter's, and export ->
    import gives the same config, weights and greedy drafts (the 4.x Gemma spelling and
    Qwen3-MoE, whose draft layers are dense Qwen3 layers, too)."""
    from test_new_families import _make  # the tiny Gemma 3 / Qwen3-MoE targets and their variants
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from draftsmith.drafters.registry import load_checkpoint_model

    family, kind = which.rsplit("-", 1)
    if family == "gemma3" and kind == "eagle3":
        path = tiny_model_dir("gemma3_text", seed=0, **_GEMMA6)  # five feature layers, not the last
    else:
        path = _make(tiny_model_dir, {"gemma3": "gemma3_text", "gemma3-4x-config": "gemma3_text-4x-config-softcap",
                                      "qwen3_moe": "qwen3_moe"}[family])
    target = load_target(str(path))
    tc = target.model.config
    assert tc.local_rope is not None if family.startswith("gemma3") else tc.moe_layers
    model = _eagle3(target) if kind == "eagle3" else _dspark(target, ce_weight=0.4)
    rope = (model.inv_freq, model.rope_scale) if kind == "eagle3" else (model.backbone.inv_freq,
                                                                        model.backbone.rope_scale)
    src, cfg, _ = _export(tmp_path, target, model)
    spec = export_drafter(tmp_path / "ckpt", target, "speculators", tmp_path / "spec")
    layer = json.loads((spec / "config.json").read_text())["transformer_layer_config"]
    for written in (cfg, layer):
        theirs = Qwen3Config(**{k: v for k, v in written.items() if k != "architectures"})
        rotary = Qwen3RotaryEmbedding(theirs)
        assert torch.equal(rotary.inv_freq, rope[0]) and rotary.attention_scaling == rope[1]
        assert theirs.hidden_act == "silu"  # the draft MLP is SwiGLU whatever the target's activation
        assert not {"rope_local_base_freq", "query_pre_attn_scalar", "final_logit_softcapping",
                    "hidden_activation"} & set(written)
    back = import_drafter(src, target, tmp_path / "imported", fmt="deepspec")
    loaded = load_checkpoint_model(back, target)
    assert loaded.config == model.config
    ours = model.state_dict()
    assert set(loaded.state_dict()) == set(ours)
    for k, v in ours.items():
        assert torch.equal(loaded.state_dict()[k].cpu(), v.cpu()), k
    assert _greedy(target, f"{kind}:{tmp_path / 'ckpt'}") == _greedy(target, f"{kind}:{back}")


def _rewrite(src, cfg_change=None, drop=(), **tensor_change):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(cfg_change or {})
    (src / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    t = load_file(str(src / "model.safetensors"))
    t = {k: v for k, v in t.items() if not k.startswith(tuple(drop))}
    t.update(tensor_change)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})


def test_dflash_exports_as_deepspecs_dflash_baseline(tmp_path, qwen3):
    """An anchor-first DFlash is DeepSpec's DFlash baseline: Qwen3DSparkModel with markov_rank 0
    and no confidence head (config/dflash/*.py), the backbone tensors only."""
    model = _perturb(dflash.build(qwen3.model, dflash.DFlashConfig(block_size=3, num_layers=1, layer_ids=(0, 1))))
    _, cfg, t = _export(tmp_path, qwen3, model)
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == 3
    assert cfg["markov_rank"] == 0 and cfg["enable_confidence_head"] is False
    assert "markov_head_type" not in cfg and "confidence_head_with_markov" not in cfg
    assert not any(k.startswith(("markov_head.", "confidence_head.")) for k in t)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} | _layer_names("layers.", 1) <= set(t)


def test_deepspec_dflash_baseline_imports_as_our_dflash(tmp_path, qwen3):
    """A DeepSpec DSpark file rewritten to the baseline (markov_rank 0, no confidence head)
    imports as our anchor-first DFlash with the same backbone, and drafts what the DSpark's
    backbone alone drafts (W2 = 0): same tokens and q for the same uniforms."""
    from draftsmith.core.sampling import SamplingParams
    from draftsmith.drafters.registry import load_checkpoint_model

    model = _dspark(qwen3)
    src, _, _ = _export(tmp_path, qwen3, model)
    _rewrite(src, {"markov_rank": 0, "markov_head_type": None, "enable_confidence_head": False,
                   "confidence_head_with_markov": None}, drop=("markov_head.", "confidence_head."))
    back = import_drafter(src, qwen3, tmp_path / "imported", fmt="deepspec")
    loaded = load_checkpoint_model(back, qwen3)
    assert loaded.config.kind == "dflash" and loaded.config.layout == "anchor-first"
    assert loaded.config.block_size == model.config.block_size
    ours = {k: v for k, v in model.state_dict().items() if k.startswith("backbone.")}
    assert set(loaded.state_dict()) == set(ours)
    for k, v in ours.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    H = qwen3.model.config.hidden_size
    with torch.no_grad():
        model.seq_head.w2.weight.zero_()
        torch.manual_seed(5)
        h, anchors, u = torch.randn(2, 3, H), torch.randint(0, 200, (2,)), torch.rand(2, 3)
        params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
        tok_ref, q_ref, _ = model.draft(h, anchors, params, u)
        tok_in, q_in, _ = loaded.draft(h, anchors, params, u)
    assert torch.equal(tok_ref, tok_in) and torch.allclose(q_ref, q_in, atol=1e-7)
    with pytest.raises(DraftsmithError, match="imports as a dflash drafter, not dspark; use --drafter dflash:"):
        _greedy(qwen3, f"dspark:{src}")
    ref = tmp_path / "ref"
    save_trained_drafter(model, ref, qwen3.target_id, qwen3.weights_hash)
    assert _greedy(qwen3, f"dspark:{ref}") == _greedy(qwen3, f"dflash:{back}")  # same drafts: same acceptance


def test_deepspec_rank_zero_with_a_confidence_head_imports_as_rank_one_dspark(tmp_path, qwen3):
    """markov_rank 0 with a confidence head is our DSpark with rank 1 and W1 = W2 = 0: the Markov
    bias is exactly zero, so it drafts what the backbone alone does."""
    from draftsmith.drafters.registry import load_checkpoint_model

    model = _dspark(qwen3)
    src, _, t = _export(tmp_path, qwen3, model)
    H = qwen3.model.config.hidden_size
    conf_w = t["confidence_head.proj.weight"][:, :H].clone()
    _rewrite(src, {"markov_rank": 0, "markov_head_type": None, "enable_confidence_head": True,
                   "confidence_head_with_markov": False}, drop=("markov_head.",),
             **{"confidence_head.proj.weight": conf_w})
    back = import_drafter(src, qwen3, tmp_path / "imported", fmt="deepspec")
    loaded = load_checkpoint_model(back, qwen3).state_dict()
    ours = model.state_dict()
    assert loaded["seq_head.w1.weight"].shape == (qwen3.model.config.vocab_size, 1)
    assert not loaded["seq_head.w1.weight"].any() and not loaded["seq_head.w2.weight"].any()
    assert torch.equal(loaded["seq_head.conf.weight"], torch.cat([conf_w, torch.zeros(1, 1)], 1))
    for k, v in ours.items():
        if k.startswith("backbone."):
            assert torch.equal(loaded[k], v), k
    with torch.no_grad():  # the same backbone with no sequential stage drafts the same tokens
        model.seq_head.w2.weight.zero_()
        from draftsmith.core.sampling import SamplingParams

        model_in = load_checkpoint_model(back, qwen3)
        torch.manual_seed(5)
        h, anchors, u = torch.randn(2, 3, H), torch.randint(0, 200, (2,)), torch.rand(2, 3)
        params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
        tok_ref, q_ref, _ = model.draft(h, anchors, params, u)
        tok_in, q_in, _ = model_in.draft(h, anchors, params, u)
        assert torch.equal(tok_ref, tok_in) and torch.equal(q_ref, q_in)
    ref = tmp_path / "ref"
    save_trained_drafter(model, ref, qwen3.target_id, qwen3.weights_hash)
    assert _greedy(qwen3, f"dspark:{ref}") == _greedy(qwen3, f"dspark:{back}")  # same drafts: same acceptance


def test_deepspec_import_refuses_what_it_cannot_compute(tmp_path, qwen3, llama):
    src, cfg0, t0 = _export(tmp_path, qwen3, _dspark(qwen3))

    def refused(match, cfg_change=None, target=qwen3, **tensors):
        (src / "config.json").write_text(json.dumps(cfg0))
        save_file(t0, str(src / "model.safetensors"), metadata={"format": "pt"})
        _rewrite(src, cfg_change, **tensors)
        with pytest.raises(DraftsmithError, match=match):
            import_drafter(src, target, tmp_path / "out", fmt="deepspec")

    refused("embed_tokens.weight is not the target's",
            **{"embed_tokens.weight": t0["embed_tokens.weight"] + 1e-3})
    refused("lm_head.weight is not the target's", **{"lm_head.weight": t0["lm_head.weight"].flip(0)})
    refused("token embeddings", {"target_layer_ids": [-1, 1]})
    refused("increase strictly", {"target_layer_ids": [1, 0]})
    refused("sample_from_anchor", {"sample_from_anchor": False})
    refused("markov_head_type", {"markov_head_type": "cond"})
    refused("architectures", {"architectures": ["Gemma4DSparkModel"]})
    refused("lacks confidence_head_with_markov", {"confidence_head_with_markov": None})
    refused("unexpected tensor mask_embedding", **{"mask_embedding": torch.zeros(4)})
    refused("o_proj.bias is not zero", **{"layers.0.self_attn.o_proj.bias": torch.ones(qwen3.model.config.hidden_size)})
    refused("another target", target=llama)


def test_cli_and_sharded_run_directory(tmp_path, qwen3, capsys):
    """The CLI both ways; import reads HF shards + index and a run directory's step_latest."""
    model = _dspark(qwen3)
    ckpt = _ckpt(tmp_path, qwen3, model)
    step = tmp_path / "run" / "step_7"
    assert main(["export", "--target", str(qwen3.path), "--drafter", f"dspark:{ckpt}", "--format", "deepspec",
                 "--out", str(step)]) == 0
    t = load_file(str(step / "model.safetensors"))
    (step / "model.safetensors").unlink()
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(step / f), metadata={"format": "pt"})
    (step / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    (tmp_path / "run" / "step_latest").symlink_to(step)
    capsys.readouterr()
    assert main(["import", str(tmp_path / "run"), "--format", "deepspec", "--target", str(qwen3.path),
                 "--out", str(tmp_path / "imp")]) == 0
    assert f"--drafter dspark:{tmp_path / 'imp'}" in capsys.readouterr().out
    assert main(["import", str(tmp_path / "nowhere"), "--format", "deepspec", "--target", str(qwen3.path),
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0], err
