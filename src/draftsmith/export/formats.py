"""Export a trained drafter to the formats vLLM and SGLang load (docs/FORMATS.md).

    speculators   config.json + model.safetensors that speculators 0.9 validates and vLLM serves
                  (`--speculative-config '{"model": DIR, ...}'`): eagle3, dflash, dspark
    sglang        SGLang's EAGLE-3 draft directory (LlamaForCausalLMEagle3): eagle3 on targets
                  without q/k norms or attention biases (SGLang drops both silently)
    deepspec      DeepSpec's step_N layout (Qwen3DSparkModel / Qwen3Eagle3Model, export/deepspec.py):
                  full-vocabulary dspark with q/k-norm layers, and eagle3 on Qwen3 targets
    dflash-native z-lab's DFlashDraftModel layout (export/dflash_native.py), what z-lab's code,
                  SGLang (--speculative-algorithm DFLASH) and vLLM ("method": "dflash") load:
                  full-vocabulary dflash with q/k-norm layers

Every engine reads a missing field differently from what our drafters compute, so every field
that matters is written explicitly (norm_before_residual, sliding_window_non_causal,
sample_from_anchor, draft_vocab_size, the feature-layer ids in the engine's own numbering).
A combination a format cannot express is a DraftsmithError that says why.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from draftsmith.drafters import registry
from draftsmith.drafters.builtin import is_builtin
from draftsmith.drafters.checkpoint import read_sts, write_calibration
from draftsmith.data.outdir import check_replace
from draftsmith.errors import DraftsmithError
from draftsmith.export.deepspec import draft_layer_hf, ours_block, to_deepspec
from draftsmith.export.dflash_native import to_dflash_native
from draftsmith.fileio import atomic_write, read_json
from draftsmith.tensorfile import save_tensors

FORMATS = ("speculators", "sglang", "deepspec", "dflash-native")
_MARKOV_HEAD = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}
# The fields of our drafter configs that a speculators config.json itself expresses (and
# export/importing.py reads back). Every other field shapes training only (loss weights,
# max_anchors, ttt_decay, init_from_target, position_decay, ...): it travels in the
# "draftsmith" block's "train", so that export -> import gives back the same config.
_BLOCK_CARRIES = frozenset({"kind", "block_size", "num_layers", "layer_ids", "mask_token_id", "intermediate_size",
                            "draft_vocab_size", "qk_norm"})
SPECULATORS_CARRIES = {
    "eagle3": frozenset({"kind", "layer_ids", "ttt_steps", "draft_vocab_size", "intermediate_size"}),
    "dflash": _BLOCK_CARRIES | {"layout"},  # as sample_from_anchor
    "dspark": _BLOCK_CARRIES | {"rank", "head"},
}


def speculators_train_fields(kind: str) -> tuple[str, ...]:
    """The fields of `kind`'s config that the speculators format has no place for."""
    cls = registry.get(kind, trainable=True).config_cls
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in SPECULATORS_CARRIES[kind])


def _speculators_ours(target, config) -> dict[str, Any]:
    """The "draftsmith" block of a speculators export: who made it, for which target, and the
    training-only config fields (speculators keeps extra top-level keys; vLLM ignores them)."""
    train = {f: getattr(config, f) for f in speculators_train_fields(config.kind)}
    return ours_block(target, config.kind, layer_ids=list(config.layer_ids), train=train)


def check_drafter_out(out: str | Path, overwrite: bool, source: str | Path, source_what: str) -> Path:
    """export / import's --out: a new or empty directory that is not `source` unless `overwrite`
    (data/outdir.check_replace), and never a built-in drafter's package directory."""
    if is_builtin(out):  # first: check_replace's "pass --overwrite" would send the user to a second refusal
        raise DraftsmithError(f"--out {out} is inside Draftsmith's built-in drafters (package data, never written "
                              "to, --overwrite or not); give a directory of your own")
    return check_replace(out, overwrite, source=source, source_what=source_what)


def export_drafter(ckpt: str | Path, target, fmt: str, out: str | Path, overwrite: bool = False) -> Path:
    """Write checkpoint `ckpt` (trained for the LoadedTarget `target`) to `out` in `fmt`, with the
    checkpoint's calibration.json when it has one (the same weights: its temperatures hold, and
    `--drafter KIND:OUT` reads them). A non-empty `out`, or `out` = `ckpt`, is refused unless
    `overwrite` (then the files an export writes are replaced: a calibration.json there is
    removed when this drafter has none; nothing else is touched)."""
    if fmt not in FORMATS:
        raise DraftsmithError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    check_drafter_out(out, overwrite, source=ckpt, source_what="checkpoint")
    model = registry.load_checkpoint_model(ckpt, target)
    sts = read_sts(ckpt)  # a damaged file stops the export before anything is written
    kind = model.config.kind
    hf = read_json(Path(target.path) / "config.json", "target config")
    if fmt == "sglang" and kind != "eagle3":
        raise DraftsmithError(f"the sglang format holds EAGLE-3 drafters only, not {kind}; "
                              "export DFlash / DSpark with --format speculators")
    if kind != "eagle3":  # before the formats' own refusals, which would point at one another
        _check_attention(model.backbone.cfg, fmt, kind)
    if fmt == "deepspec":
        config, tensors = to_deepspec(model, target, hf)
    elif fmt == "dflash-native":
        config, tensors = to_dflash_native(model, target, hf)
    elif fmt == "sglang":
        config, tensors = _sglang_eagle3(model, target, hf)
    elif kind == "eagle3":
        config, tensors = _speculators_eagle3(model, target, hf)
    else:
        config, tensors = _speculators_block(model, target, hf)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write(out / "model.safetensors", lambda p: save_tensors(p, tensors, metadata={"format": "pt"}))
    atomic_write(out / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    write_calibration(out, sts)  # none: one left by an earlier export would be read as this drafter's
    return out


# ---------------------------------------------------------------------------- shared pieces


def _layer_config(hf: dict[str, Any], model_type: str, num_layers: int, intermediate: int) -> dict[str, Any]:
    """The draft layers' HF config: the target's geometry and RoPE, the draft's depth and width."""
    cfg = {k: v for k, v in draft_layer_hf(hf).items() if k not in ("architectures", "auto_map", "quantization_config")}
    cfg.update(model_type=model_type, num_hidden_layers=num_layers, intermediate_size=intermediate,
               tie_word_embeddings=False, layer_types=["full_attention"] * num_layers)
    cfg.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    return cfg


def _verifier(target, hf: dict[str, Any]) -> dict[str, Any]:
    return {"name_or_path": str(target.path), "architectures": hf.get("architectures", [])}


def _ours(target) -> dict[str, Any]:
    return {"target_id": target.target_id, "target_weights_hash": target.weights_hash}


def _vocab(state: dict[str, torch.Tensor], prefix: str, V: int, Vd: int) -> dict[str, torch.Tensor]:
    """d2t (int64 offsets) and t2d (bool) only for a reduced vocabulary: engines build the
    map only when the draft vocabulary differs from the target's."""
    if Vd >= V:
        return {}
    return {"d2t": state[f"{prefix}d2t"].long(), "t2d": state[f"{prefix}t2d"].bool()}


def _check_attention(dec_cfg, fmt: str, kind: str) -> None:
    if fmt == "sglang" and (dec_cfg.qk_norm or dec_cfg.attention_bias):
        what = "q/k norms (Qwen3)" if dec_cfg.qk_norm else "q/k/v biases (Qwen2)"
        raise DraftsmithError(f"SGLang's EAGLE-3 layer has no {what} and would drop them silently; "
                              "export this drafter with --format speculators (vLLM) instead")
    if kind != "eagle3" and not dec_cfg.qk_norm:
        raise DraftsmithError(
            f"every {kind} format's draft layers have q/k norms (Qwen3 layers), and this drafter's have none "
            f"(they follow its {dec_cfg.model_type} target); train it with drafter.qk_norm=true to export it")


# ---------------------------------------------------------------------------- EAGLE-3


def _eagle3_names(state: dict[str, torch.Tensor], prefix: str, H: int, bias: bool) -> dict[str, torch.Tensor]:
    out = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"],
           "lm_head.weight": state["lm_head.weight"]}
    for k, v in state.items():
        if k.startswith("layer."):
            out[prefix + k[len("layer."):]] = v
    if bias:  # engines expect o_proj to carry a bias whenever attention_bias is set
        out[prefix + "self_attn.o_proj.bias"] = torch.zeros(H, dtype=state["fc.weight"].dtype)
    return out


def _speculators_eagle3(model, target, hf):
    dec = target.model.config
    _check_attention(dec, "speculators", "eagle3")
    state = model.state_dict()
    V, Vd = dec.vocab_size, int(state["lm_head.weight"].shape[0])
    ids = [i + 1 for i in model.config.layer_ids]  # vLLM / speculators: the layer the state feeds
    inter = int(state["layer.mlp.gate_proj.weight"].shape[0])
    layer = _layer_config(hf, "qwen3" if dec.qk_norm else "llama", 1, inter)
    layer.update(num_aux_hidden_states=len(ids), attention_bias=bool(dec.attention_bias))
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "speculators_config": {"algorithm": "eagle3",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": model.config.ttt_steps}],
                               "default_proposal_method": "greedy", "verifier": _verifier(target, hf)},
        "transformer_layer_config": layer, "draft_vocab_size": Vd,
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_residual": False,  # ours adds the un-normed fc output; vLLM assumes True if absent
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "target_hidden_size": None,
        "draftsmith": _speculators_ours(target, model.config),
    }
    tensors = _eagle3_names(state, "layers.0.", dec.hidden_size, dec.attention_bias)
    tensors.update(_vocab(state, "", V, Vd))
    return config, tensors


def _sglang_eagle3(model, target, hf):
    dec = target.model.config
    _check_attention(dec, "sglang", "eagle3")
    state = model.state_dict()
    V, Vd = dec.vocab_size, int(state["lm_head.weight"].shape[0])
    inter = int(state["layer.mlp.gate_proj.weight"].shape[0])
    config = _layer_config(hf, "llama", 1, inter)
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=Vd,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(model.config.layer_ids),
                                "use_aux_hidden_state": True},  # SGLang: the producing layer's id
                  draftsmith={"kind": "eagle3", **_ours(target)})
    tensors = _eagle3_names(state, "midlayer.", dec.hidden_size, False)
    if Vd < V:
        tensors.update(_vocab(state, "", V, Vd))
    else:  # SGLang reads the maps unconditionally
        tensors.update(d2t=torch.zeros(V, dtype=torch.long), t2d=torch.ones(V, dtype=torch.bool))
    return config, tensors


# ---------------------------------------------------------------------------- DFlash / DSpark


def _speculators_block(model, target, hf):
    dec = target.model.config
    kind = model.config.kind
    c = model.config
    state = model.state_dict()
    V = dec.vocab_size
    Vd = int(c.draft_vocab_size or V)
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if not k.startswith("backbone.") or k.startswith("backbone.vocab."):
            continue
        name = k[len("backbone."):]
        if name.startswith("ctx_norm."):
            name = "hidden_norm." + name[len("ctx_norm."):]
        tensors[name] = v
    if dec.attention_bias:
        for i in range(c.num_layers):
            tensors[f"layers.{i}.self_attn.o_proj.bias"] = torch.zeros(dec.hidden_size)
    tensors.update(_vocab(state, "backbone.vocab.", V, Vd))
    if Vd < V:  # the target's lm_head rows of the draft vocabulary
        ids = torch.arange(Vd) + state["backbone.vocab.d2t"].cpu()
        tensors["lm_head.weight"] = target.model.lm_head.weight.detach().cpu()[ids]
    inter = int(tensors["layers.0.mlp.gate_proj.weight"].shape[0])
    config = {
        "speculators_model_type": kind, "architectures": [f"{'DFlash' if kind == 'dflash' else 'DSpark'}Speculator"],
        "speculators_config": {"algorithm": kind,
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size}],
                               "default_proposal_method": "greedy", "verifier": _verifier(target, hf)},
        "transformer_layer_config": _layer_config(hf, "qwen3", c.num_layers, inter),
        "draft_vocab_size": Vd,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.layer_ids],
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": True,  # our block attends both ways; vLLM runs causal when False
        "draftsmith": _speculators_ours(target, c),
    }
    if kind == "dflash" and not c.anchor_first:  # the anchor + γ masks, mask k predicts a+k
        config.update(block_size=c.block_size + 1, sample_from_anchor=False)
    elif kind == "dflash":  # the anchor + γ−1 masks, slot k predicts a+k+1 (vLLM's anchor-as-first)
        config.update(block_size=c.block_size, sample_from_anchor=True)
    else:
        config.update(block_size=c.block_size, sample_from_anchor=True,  # vLLM assumes False if absent
                      markov_rank=c.rank, markov_head_type=_MARKOV_HEAD[c.head],
                      enable_confidence_head=True, confidence_head_with_markov=True)
        tensors.update(_markov_tensors(model, state, V, Vd))
    return config, tensors


def _markov_tensors(model, state, V: int, Vd: int) -> dict[str, torch.Tensor]:
    """DSpark's sequential head in speculators' names; W1 indexed by target id [V, r] (our
    reduced table has one shared row for every token outside the draft vocabulary)."""
    out = {}
    w1 = state["seq_head.w1.weight"]
    if Vd < V:
        index = model.backbone.vocab.index.cpu()  # target id -> draft id (Vd = outside)
        w1 = w1.cpu()[index]
    out["markov_head.markov_w1.weight"] = w1
    out["markov_head.markov_w2.weight"] = state["seq_head.w2.weight"]
    for k, v in state.items():
        if k.startswith("seq_head.gate."):
            out["markov_head.gate_proj." + k[len("seq_head.gate."):]] = v
        elif k.startswith("seq_head.cell."):
            out["markov_head.joint_proj." + k[len("seq_head.cell."):]] = v
        elif k.startswith("seq_head.conf."):
            out["confidence_head.proj." + k[len("seq_head.conf."):]] = v
    return out
