"""z-lab's own DFlash checkpoint layout (github.com/z-lab/dflash, the HF models
z-lab/*-DFlash*; docs/FORMATS.md §8), both ways.

    config.json          the target's HF config (model_type qwen3) with architectures
                         ["DFlashDraftModel"], num_hidden_layers = draft layers,
                         num_target_layers = L, block_size = γ + 1 (top level and in
                         dflash_config), dflash_config {mask_token_id, target_layer_ids}
    model.safetensors    fc, hidden_norm, layers.{i}.* (Qwen3 layers: q/k norms), norm;
                         no embedding and no lm_head (the target's are used)

The block is ours exactly: the anchor then γ mask tokens, bidirectional, reading the context
strictly before the anchor; slots 1..γ are the drafts. Feature ids number the producing layer
(as ours), so they are written unchanged. The last layer L−1 is refused both ways: z-lab's
transformers path reads HF's hidden states, whose last entry is after the final norm, and its
MLX path hooks the raw layer output, so such a drafter means two different things.
Full vocabulary only (there is no d2t / t2d), Qwen3 layers only, DFlash only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.export import deepspec

ARCH = "DFlashDraftModel"
_NAMES = (("backbone.fc.", "fc."), ("backbone.ctx_norm.", "hidden_norm."), ("backbone.layers.", "layers."),
          ("backbone.norm.", "norm."))
# Our DFlash fields that shape training, not drafting: kept in the "draftsmith" block
_TRAIN_FIELDS = ("max_anchors", "ce_weight", "tv_weight", "kl_weight", "position_decay", "init_from_target")
# dflash_config keys we read; a flag among _OFF is accepted only when false (it switches on
# something our DFlash does not compute); any other key is another DFlash variant
_KEYS = {"target_layer_ids", "mask_token_id", "block_size", "mask_token"}
_OFF = ("causal", "is_causal", "sample_from_anchor", "use_swa")


def to_dflash_native(model, target, hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of our trained DFlash `model` (for the LoadedTarget `target`,
    whose HF config is `hf`) in z-lab's layout."""
    kind = model.config.kind
    if kind != "dflash":
        hint = "export it with --format speculators"
        if kind == "dspark":  # (deepspec holds a DSpark with the full vocabulary only: deepspec.py)
            full = model.config.draft_vocab_size in (None, target.model.config.vocab_size)
            fmts = "deepspec or speculators" if full else "speculators"
            hint = ("DSpark is anchor-first with a Markov head, which z-lab's DFlash has no place for; export it "
                    f"with --format {fmts}")
        raise DraftsmithError(f"the dflash-native format holds DFlash drafters only, not {kind}; {hint}")
    c, tc = model.config, target.model.config
    if c.anchor_first:
        raise DraftsmithError(
            "z-lab's DFlash is mask-first (the anchor + γ masks, the mask at a+k predicts a+k) and this drafter is "
            "anchor-first (the default layout); export it with --format speculators (sample_from_anchor=true) or "
            "deepspec, or train one with drafter.layout=mask-first for this format")
    if c.draft_vocab_size is not None and c.draft_vocab_size < tc.vocab_size:
        raise DraftsmithError(
            f"this DFlash drafter has a reduced draft vocabulary ({c.draft_vocab_size} of {tc.vocab_size}); z-lab's "
            "DFlash drafts over the target's whole lm_head (no d2t / t2d); retrain with draft_vocab_size=null, or "
            "export with --format speculators")
    if tc.embed_scale or tc.local_rope is not None:
        raise DraftsmithError(
            f"the dflash-native layout cannot hold a drafter of this {tc.model_type} target: z-lab's code embeds the "
            "block through the target's scaled embedding and reads one Qwen3-style RoPE from config.json, while this "
            "drafter uses the unscaled embedding rows and the target's global RoPE")
    ids = deepspec.ids_out(c.layer_ids, tc.num_layers, "z-lab DFlash")
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        name = deepspec.rename(k, _NAMES)
        if name is None:
            raise DraftsmithError(f"DFlash tensor {k} has no z-lab name")
        tensors[name] = v
    dtype = state["backbone.fc.weight"].dtype
    if tc.attention_bias:  # z-lab's o_proj has a bias whenever q/k/v do; ours is zero
        for i in range(c.num_layers):
            tensors[f"layers.{i}.self_attn.o_proj.bias"] = torch.zeros(tc.hidden_size, dtype=dtype)
    inter = int(state["backbone.layers.0.mlp.gate_proj.weight"].shape[0])
    config = deepspec.base_config(hf, target, ARCH, c.num_layers, inter, dtype)
    n_slots = c.block_size + 1  # the anchor + γ masks
    config.update(
        auto_map={"AutoModel": "dflash.DFlashDraftModel"},  # z-lab's modeling file, which we do not ship
        use_sliding_window=False, sliding_window=None,
        block_size=n_slots,  # z-lab's code reads the top level, SGLang dflash_config first: both, equal
        dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": ids, "block_size": n_slots},
        draftsmith=deepspec.ours_block(target, "dflash", train={f: getattr(c, f) for f in _TRAIN_FIELDS}),
    )
    return config, tensors


# ---------------------------------------------------------------------------- import


def from_dflash_native(cfg: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], target,
                       src) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(our DFlash config dict, our state dict) of a z-lab DFlash checkpoint for the
    LoadedTarget `target`; refuses (with the reason) whatever our DFlash would not compute."""
    tc = target.model.config
    arch = list(cfg.get("architectures") or [])
    if arch != [ARCH]:
        raise DraftsmithError(f"{src}: architectures {arch} is not z-lab's {ARCH} (other DFlash variants compute "
                              "something else)")
    dc = cfg.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise DraftsmithError(f"{src}: dflash_config must be a JSON object, got {dc!r}")
    on = [k for k in _OFF if dc.get(k) or cfg.get(k)]
    other = sorted(set(dc) - _KEYS - set(_OFF))
    if on or other:
        raise DraftsmithError(f"{src}: config.json sets {', '.join(on + other)}, which Draftsmith's DFlash (full "
                              "bidirectional attention, mask-first block) does not compute")
    if any(t != "full_attention" for t in cfg.get("layer_types") or []):
        raise DraftsmithError(f"{src}: layer_types {cfg['layer_types']} has sliding-window layers; Draftsmith's "
                              "DFlash layers attend over the whole context")
    deepspec.check_target(cfg, target, src)
    n = int(cfg.get("num_hidden_layers") or 0)
    if n < 1:
        raise DraftsmithError(f"{src}: num_hidden_layers {cfg.get('num_hidden_layers')!r}; no draft layers")
    gamma = _block_size(cfg, dc, src) - 1
    mask = dc.get("mask_token_id")
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < tc.vocab_size:
        raise DraftsmithError(f"{src}: dflash_config.mask_token_id {mask!r} is not a token id of the target; "
                              "z-lab's code and vLLM need it (add the id of the mask token)")
    ids = _layer_ids(cfg, dc, n, tc.num_layers, src)
    tensors = dict(tensors)
    deepspec.check_copies(tensors, target, src, deepspec.COPIES)  # not in z-lab files; tolerated if the target's
    for i in range(n):
        deepspec.drop_zero_bias(tensors, f"layers.{i}.self_attn.o_proj.bias", src)
    state = deepspec.rename_all(tensors, _NAMES, src)
    if f"backbone.layers.{n - 1}.self_attn.q_norm.weight" not in state:
        raise DraftsmithError(f"{src}: no draft layer tensors with q/k norms (layers.{n - 1}.*); not a z-lab DFlash "
                              "file")
    inter = int(state["backbone.layers.0.mlp.gate_proj.weight"].shape[0])
    ours = cfg.get("draftsmith")
    train = ours.get("train") if isinstance(ours, dict) and isinstance(ours.get("train"), dict) else {}
    config: dict[str, Any] = {
        "kind": "dflash", "layout": "mask-first", "num_layers": n, "layer_ids": list(ids), "mask_token_id": mask,
        "block_size": gamma,
        "draft_vocab_size": None, "intermediate_size": None if inter == tc.intermediate_size else inter,
        "qk_norm": None if tc.qk_norm else True,  # z-lab's layers always have q/k norms
        **{k: v for k, v in train.items() if k in _TRAIN_FIELDS},
    }
    return config, state


def _block_size(cfg: Mapping[str, Any], dc: Mapping[str, Any], src) -> int:
    """Slots per block: z-lab's code reads the top-level block_size, SGLang dflash_config's first."""
    found = {v for v in (cfg.get("block_size"), dc.get("block_size")) if v is not None}
    if len(found) != 1:
        what = "has no block_size" if not found else f"has two block sizes {sorted(found)} (top level and dflash_config)"
        raise DraftsmithError(f"{src}: config.json {what}; z-lab's code and SGLang would read different blocks")
    bs = found.pop()
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 2:
        raise DraftsmithError(f"{src}: block_size {bs!r} must be an integer >= 2 (the anchor and at least one mask)")
    return bs


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's choice when dflash_config has no target_layer_ids (SGLang's is the same): the
    middle layer for one draft layer, else one per draft layer spread over [1, L−3], rounded
    half to even (Python's round)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _layer_ids(cfg: Mapping[str, Any], dc: Mapping[str, Any], n: int, num_layers: int, src) -> tuple[int, ...]:
    if "target_layer_ids" in dc:
        raw = dc["target_layer_ids"]
    elif "target_layer_ids" in cfg:  # SGLang reads it, z-lab's code ignores it for its default
        raise DraftsmithError(f"{src}: target_layer_ids is at the top level, not in dflash_config; z-lab's code and "
                              "SGLang would read different layers")
    else:
        raw = default_layer_ids(int(cfg.get("num_target_layers") or num_layers), n)
    ids = deepspec.ids_in(raw, num_layers, src)
    if num_layers - 1 in ids:
        raise DraftsmithError(
            f"{src}: target_layer_ids {list(ids)} reads the last target layer, which z-lab's transformers path takes "
            "after the final norm and its MLX path before it; Draftsmith cannot tell which the drafter was trained on")
    return ids
