"""z-lab's DFlash checkpoint layout, both ways (export/dflash_native.py, docs/FORMATS.md §8).

z-lab's DFlashDraftModel loads with HF `from_pretrained`, which random-inits a missing or
misspelt tensor and drops an extra one, and SGLang / vLLM read block_size, mask_token_id and
target_layer_ids from config.json with their own defaults: the contract tests pin exact name
sets, shapes, dtypes and fields; the round trips assert bit-equal weights and equal greedy
outputs and acceptance."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.drafters import dflash, dspark, eagle3
from draftsmith.drafters.checkpoint import save_trained_drafter
from draftsmith.errors import DraftsmithError
from draftsmith.export.dflash_native import default_layer_ids
from draftsmith.export.formats import export_drafter
from draftsmith.export.importing import import_drafter
from draftsmith.models.target import load_target


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return load_target(str(tiny_model_dir("qwen3", seed=0, num_hidden_layers=4)))


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return load_target(str(tiny_model_dir("llama", seed=0, num_hidden_layers=4)))


@pytest.fixture(scope="module")
def qwen2(tiny_model_dir):
    return load_target(str(tiny_model_dir("qwen2", seed=0, num_hidden_layers=4)))


def _perturb(model):
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return model


def _dflash(target, **kw):
    kw = {"block_size": 3, "num_layers": 2, "layer_ids": (0, 1, 2), "layout": "mask-first", **kw}  # z-lab's
    return _perturb(dflash.build(target.model, dflash.DFlashConfig(**kw)))


def _ckpt(tmp_path, target, model):
    return save_trained_drafter(model, tmp_path / "ckpt", target.target_id, target.weights_hash)


def _export(tmp_path, target, model):
    out = export_drafter(_ckpt(tmp_path, target, model), target, "dflash-native", tmp_path / "zlab")
    return out, json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


def _layer_names(n: int, bias: bool = False) -> set[str]:
    per = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
           "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
           "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    if bias:
        per |= {f"self_attn.{p}_proj.bias" for p in "qkvo"}
    return {f"layers.{i}.{p}" for i in range(n) for p in per}


# ---------------------------------------------------------------------------- export contract


def test_dflash_to_native_names_shapes_and_config(tmp_path, qwen3):
    model = _dflash(qwen3)
    _, cfg, t = _export(tmp_path, qwen3, model)
    tc, c = qwen3.model.config, model.config
    H = tc.hidden_size
    # exactly: no embed_tokens / lm_head (z-lab's code uses the target's), no d2t / t2d
    assert set(t) == {"fc.weight", "hidden_norm.weight", "norm.weight"} | _layer_names(2)
    assert tuple(t["fc.weight"].shape) == (H, 3 * H)  # features concatenated in target_layer_ids order
    assert tuple(t["layers.0.self_attn.q_proj.weight"].shape) == (tc.num_heads * tc.head_dim, H)
    assert tuple(t["layers.0.self_attn.k_norm.weight"].shape) == (tc.head_dim,)
    assert all(v.dtype == torch.float32 for v in t.values())  # the drafter's dtype
    ours = model.state_dict()
    assert torch.equal(t["hidden_norm.weight"], ours["backbone.ctx_norm.weight"])
    assert torch.equal(t["fc.weight"], ours["backbone.fc.weight"])
    assert torch.equal(t["layers.1.mlp.down_proj.weight"], ours["backbone.layers.1.mlp.down_proj.weight"])
    expect = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": c.block_size + 1,  # the anchor + γ masks; z-lab's code and MLX read the top level
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": [0, 1, 2],  # producer ids: ours
                          "block_size": c.block_size + 1},  # SGLang reads this one first
        "num_target_layers": tc.num_layers, "num_hidden_layers": 2, "intermediate_size": tc.intermediate_size,
        "hidden_size": H, "vocab_size": tc.vocab_size, "head_dim": tc.head_dim, "attention_bias": False,
        "layer_types": ["full_attention"] * 2,  # vLLM and z-lab: full = non-causal block layers
        "use_sliding_window": False, "tie_word_embeddings": False, "dtype": "float32",
    }
    assert {k: cfg.get(k) for k in expect} == expect
    assert cfg["draftsmith"]["kind"] == "dflash" and cfg["draftsmith"]["target_id"] == qwen3.target_id
    # keys other readers take first, in another numbering or meaning
    assert not {"target_layer_ids", "aux_hidden_state_layer_ids", "eagle_aux_hidden_state_layer_ids",
                "speculators_model_type", "draft_vocab_size", "sample_from_anchor", "torch_dtype"} & set(cfg)


def test_attention_bias_target_writes_a_zero_o_proj_bias(tmp_path, qwen2):
    """z-lab's o_proj has a bias whenever attention_bias is set; ours has none, so it is zero."""
    model = _dflash(qwen2, qk_norm=True, num_layers=1)
    _, cfg, t = _export(tmp_path, qwen2, model)
    assert cfg["attention_bias"] is True
    assert set(t) == {"fc.weight", "hidden_norm.weight", "norm.weight"} | _layer_names(1, bias=True)
    assert not t["layers.0.self_attn.o_proj.bias"].any()
    assert torch.equal(t["layers.0.self_attn.q_proj.bias"], model.state_dict()["backbone.layers.0.self_attn.q_proj.bias"])


def test_export_refuses_what_zlab_cannot_express(tmp_path, qwen3, llama, tiny_model_dir):
    def refused(target, model, match):
        with pytest.raises(DraftsmithError, match=match):
            _export(tmp_path / str(len(list(tmp_path.iterdir()))), target, model)

    refused(qwen3, dspark.build(qwen3.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=4)), "anchor-first")
    refused(qwen3, eagle3.build(qwen3.model, eagle3.Eagle3Config(ttt_steps=2)), "DFlash drafters only")
    refused(qwen3, _dflash(qwen3, layout="anchor-first"), "drafter.layout=mask-first")  # the default layout
    small = _dflash(qwen3, draft_vocab_size=100)
    small.init_draft_vocab(torch.arange(qwen3.model.config.vocab_size, 0, -1) % 37)
    refused(qwen3, small, "reduced draft vocabulary")
    refused(llama, _dflash(llama), "drafter.qk_norm=true")  # Llama-style layers have no q/k norms
    refused(qwen3, _dflash(qwen3, layer_ids=(0, 3)), "last target layer")  # L-1: post-norm in HF hidden states
    gemma = load_target(str(tiny_model_dir("gemma3_text", seed=0)))  # scaled embedding, per-layer-type RoPE
    refused(gemma, _dflash(gemma, qk_norm=True, layer_ids=(0, 1)), "scaled embedding")


def test_a_dspark_refused_is_pointed_at_a_format_that_takes_it(tmp_path, qwen3, llama):
    """The dflash-native refusal of a DSpark names deepspec only where deepspec holds that drafter
    (a full vocabulary); each named format then exports it. Where no format holds it (draft layers
    without q/k norms), the refusal says so instead."""
    full = dspark.build(qwen3.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=4))
    small = dspark.build(qwen3.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=4, draft_vocab_size=100))
    small.init_draft_vocab(torch.arange(qwen3.model.config.vocab_size, 0, -1) % 37)
    for i, (target, model, fmts) in enumerate([(qwen3, full, "deepspec or speculators"), (qwen3, small, "speculators")]):
        ckpt = _ckpt(tmp_path / str(i), target, model)
        with pytest.raises(DraftsmithError, match=f"export it with --format {fmts}$"):
            export_drafter(ckpt, target, "dflash-native", tmp_path / str(i) / "zlab")
        for fmt in fmts.split(" or "):
            assert export_drafter(ckpt, target, fmt, tmp_path / str(i) / fmt).is_dir()
    no_qk = _ckpt(tmp_path / "llama", llama, dspark.build(llama.model, dspark.DSparkConfig(block_size=3, num_layers=1)))
    for fmt in ("dflash-native", "deepspec", "speculators"):
        with pytest.raises(DraftsmithError, match="^every dspark format's draft layers have q/k norms"):
            export_drafter(no_qk, llama, fmt, tmp_path / "llama" / fmt)


def test_default_layer_ids_follow_zlab():
    """z-lab/Qwen3-4B-DFlash-b16 (36 target layers, 5 draft layers) lists [1, 9, 17, 25, 33]."""
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(7, 3) == [1, 2, 4]  # Python's round: 2.5 -> 2 (our own default rounds it up)


# ---------------------------------------------------------------------------- round trips


def _greedy(target, spec):
    """Greedy outputs (always plain decoding's: lossless) and accepted drafts (equal only when
    the drafts are); one thread, restored after."""
    from draftsmith import LLM, SamplingParams

    threads = torch.get_num_threads()
    try:
        llm = LLM(str(target.path), policy="fixed", drafter=spec, max_len=64, threads=1)
        out = llm.generate(["abc abc abc", "hello"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        return [o.token_ids for o in out], llm.last_stats.draft_accepted
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("which", ["qwen3", "qwen3-trained-fields", "llama-qk", "qwen2-bias-qk"])
def test_native_import_inverts_export(tmp_path, qwen3, llama, qwen2, which):
    """export -> import (format detected) gives the same config, bit-equal weights and the same
    greedy drafts; so does the export directory given directly as --drafter dflash:DIR."""
    from draftsmith.drafters.registry import load_checkpoint_model

    target, model = {
        "qwen3": lambda: (qwen3, _dflash(qwen3)),
        "qwen3-trained-fields": lambda: (qwen3, _dflash(qwen3, num_layers=1, layer_ids=(1,), intermediate_size=64,
                                                         max_anchors=32, tv_weight=0.5, position_decay=2.0)),
        "llama-qk": lambda: (llama, _dflash(llama, qk_norm=True)),
        "qwen2-bias-qk": lambda: (qwen2, _dflash(qwen2, qk_norm=True, block_size=4)),
    }[which]()
    src, _, _ = _export(tmp_path, target, model)
    back = import_drafter(src, target, tmp_path / "imported")
    loaded = load_checkpoint_model(back, target)
    ours = model.state_dict()
    assert loaded.config == model.config
    assert set(loaded.state_dict()) == set(ours)
    for k, v in ours.items():
        assert torch.equal(loaded.state_dict()[k].cpu(), v.cpu()), k
    in_memory = load_checkpoint_model(src, target)  # the foreign directory itself, imported in memory
    ref = _proposals(model, target)
    assert _proposals(loaded, target) == ref and _proposals(in_memory, target) == ref
    ref = _greedy(target, f"dflash:{tmp_path / 'ckpt'}")
    assert _greedy(target, f"dflash:{back}") == ref
    assert _greedy(target, f"dflash:{src}") == ref


def _proposals(model, target):
    """The drafted tokens and draft probabilities of two blocks (greedy and sampled) on fixed
    random context features: anchor + γ masks after a 6-token context."""
    from draftsmith.core.sampling import SamplingParams

    bb, g = model.backbone, model.config.block_size
    torch.manual_seed(5)
    feats = torch.randn(2, 6, len(bb.layer_ids) * target.model.config.hidden_size)
    with torch.no_grad():
        kv = bb.context_kv(bb.context(feats), torch.arange(6).expand(2, 6))
        ids = bb.block_inputs(torch.tensor([[17], [40]]), g + 1)  # [2, 1, γ + 1]
        h = bb.blocks(ids, (6 + torch.arange(g + 1)).expand(2, 1, g + 1), kv, torch.ones(2, 1, 6, dtype=torch.bool))
        tokens, q, _ = model.draft(h[:, 0, 1:], ids[:, 0, 0], [SamplingParams(temperature=0.0),
                                                             SamplingParams(temperature=1.0)], torch.rand(2, g))
    return tokens.tolist(), q.tolist()


def _without_none(d):
    return {k: v for k, v in d.items() if v is not None}


def _rewrite(src, cfg_change=None, dflash_change=None, **tensors):
    """Change config.json (None deletes a key; dflash_change: inside dflash_config) and add or
    replace tensors."""
    cfg = json.loads((src / "config.json").read_text())
    dc = _without_none({**cfg["dflash_config"], **(dflash_change or {})})
    (src / "config.json").write_text(json.dumps(_without_none({**cfg, **(cfg_change or {}), "dflash_config": dc})))
    t = load_file(str(src / "model.safetensors"))
    t.update(tensors)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})


def test_a_zlab_shaped_checkpoint_imports(tmp_path, qwen3):
    """As z-lab's HF repos hold them: bf16, block_size at the top level only, the target's
    tie_word_embeddings, no draftsmith block; and without target_layer_ids, z-lab's default."""
    from draftsmith.drafters.registry import load_checkpoint_model

    model = _dflash(qwen3, num_layers=1, layer_ids=(2,))  # z-lab's default for 1 draft layer of 4: 4 // 2 = 2
    src, _, t = _export(tmp_path, qwen3, model)
    bf16 = {k: v.to(torch.bfloat16) for k, v in t.items()}
    _rewrite(src, {"dtype": "bfloat16", "tie_word_embeddings": True, "draftsmith": None, "auto_map": None},
             {"block_size": None, "target_layer_ids": None}, **bf16)
    back = import_drafter(src, qwen3, tmp_path / "imported")
    loaded = load_checkpoint_model(back, qwen3)
    want = dflash.DFlashConfig(block_size=3, num_layers=1, layer_ids=(2,), mask_token_id=model.config.mask_token_id,
                               layout="mask-first")
    assert loaded.config == want  # training-only fields at their defaults
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k].to(torch.bfloat16).float()), k


def test_native_import_refuses_what_it_cannot_compute(tmp_path, qwen3, llama):
    src, cfg0, t0 = _export(tmp_path, qwen3, _dflash(qwen3))
    H = qwen3.model.config.hidden_size

    def refused(match, cfg_change=None, dflash_change=None, target=qwen3, **tensors):
        (src / "config.json").write_text(json.dumps(cfg0))
        save_file(t0, str(src / "model.safetensors"), metadata={"format": "pt"})
        _rewrite(src, cfg_change, dflash_change, **tensors)
        with pytest.raises(DraftsmithError, match=match):
            import_drafter(src, target, tmp_path / "out", fmt="dflash-native")

    refused("not z-lab's DFlashDraftModel", {"architectures": ["DFlash2DraftModel"]})
    refused("sets causal", dflash_change={"causal": True})
    refused("sets sample_from_anchor", dflash_change={"sample_from_anchor": True})
    refused("sets is_causal", {"is_causal": True})
    refused("sets projector_type", dflash_change={"projector_type": "dspark"})
    refused("sliding-window", {"layer_types": ["sliding_attention", "full_attention"]})
    refused("two block sizes", {"block_size": 5})
    refused("has no block_size", {"block_size": None}, {"block_size": None})
    refused(">= 2", {"block_size": 1}, {"block_size": 1})
    refused("mask_token_id None", dflash_change={"mask_token_id": None})
    refused("mask_token_id 9999", dflash_change={"mask_token_id": 9999})
    refused("reads the last target layer", dflash_change={"target_layer_ids": [0, 1, 3]})
    refused("token embeddings", dflash_change={"target_layer_ids": [-1, 0, 1]})
    refused("increase strictly", dflash_change={"target_layer_ids": [1, 0, 2]})
    refused("at the top level", {"target_layer_ids": [0, 1, 2]}, {"target_layer_ids": None})
    refused("unexpected tensor lm_head_extra", **{"lm_head_extra": torch.zeros(4)})
    refused("o_proj.bias is not zero", **{"layers.0.self_attn.o_proj.bias": torch.ones(H)})
    refused("lm_head.weight is not the target's", **{"lm_head.weight": torch.zeros(qwen3.model.config.vocab_size, H)})
    refused("another target", target=llama)
