"""The DeepSpec checkpoint layout (github.com/deepseek-ai/DeepSpec; docs/FORMATS.md §5), both ways.

DeepSpec saves `step_N/{config.json, model.safetensors}` with HF `save_pretrained`: the
config is the target's HF config plus the drafter's fields, the file is the drafter's own
state dict with **frozen copies of the target's `embed_tokens` / `lm_head`** in it.

    Qwen3DSparkModel   DSpark: anchor-first block of `block_size` = γ slots (slot k predicts
                       a+k+1), Markov head (vanilla / gated / rnn), confidence head. DeepSpec's
                       "DFlash" baseline is the same class with markov_rank 0 and no
                       confidence head: our anchor-first DFlash, both ways. A rank-0 file
                       *with* a confidence head imports as our DSpark with rank 1, W2 = 0,
                       which drafts exactly the same tokens.
    Qwen3Eagle3Model   EAGLE-3: one layer; its trainer accepts exactly 5 feature layers.

Feature ids (`target_layer_ids`) number the layer that *produced* a state, as ours do, so
they are written unchanged. DeepSpec's evaluators refuse the last layer L−1 (they read HF's
`output_hidden_states`, whose last entry is after the final norm), so we never export it;
−1 (the embeddings) is refused on import. A mask-first DFlash (anchor + γ masks) has no
DeepSpec form. Everything a DeepSpec file could hold that our drafters do not compute
exactly is a DraftsmithError naming it: a loader that guesses would only lose acceptance.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import read_json
from draftsmith.models.decoder import GEMMA3_ROPE_THETA, DecoderConfig
from draftsmith.tensorfile import load_tensors

DSPARK_ARCH = "Qwen3DSparkModel"
EAGLE3_ARCH = "Qwen3Eagle3Model"
EAGLE3_NUM_LAYER_IDS = 5  # deepspec/modeling/eagle3/common.py: validate_eagle3_target_layer_ids
_HEADS_OUT = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}
_HEADS_IN = {v: k for k, v in _HEADS_OUT.items()}
COPIES = ("embed_tokens.weight", "lm_head.weight")  # the target's, frozen, in every DeepSpec file
# Our DSpark-only fields that change training, not what the drafter computes: kept in the
# "draftsmith" block so that export -> import gives back the same config.
_TRAIN_FIELDS = ("ce_weight", "tv_weight", "kl_weight", "conf_weight", "position_decay", "init_from_target")

# (our prefix, DeepSpec prefix); every tensor name must match one, both ways
_DSPARK_NAMES = (
    ("backbone.fc.", "fc."), ("backbone.ctx_norm.", "hidden_norm."), ("backbone.layers.", "layers."),
    ("backbone.norm.", "norm."), ("seq_head.w1.", "markov_head.markov_w1."),
    ("seq_head.w2.", "markov_head.markov_w2."), ("seq_head.gate.", "markov_head.gate_proj."),
    ("seq_head.cell.", "markov_head.joint_proj."), ("seq_head.conf.", "confidence_head.proj."),
)
_EAGLE3_NAMES = (("fc.", "fc."), ("layer.", "layers.0."), ("norm.", "norm."), ("lm_head.", "lm_head."))


def rename(name: str, pairs: Sequence[tuple[str, str]], inverse: bool = False) -> str | None:
    for ours, theirs in pairs:
        a, b = (theirs, ours) if inverse else (ours, theirs)
        if name.startswith(a):
            return b + name[len(a):]
    return None


# ---------------------------------------------------------------------------- export


def to_deepspec(model, target, hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of our trained `model` (for the LoadedTarget `target`, whose HF
    config is `hf`) in DeepSpec's layout."""
    kind = model.config.kind
    if kind == "dspark":
        return _dspark_out(model, target, hf)
    if kind == "eagle3":
        return _eagle3_out(model, target, hf)
    if kind == "dflash" and model.config.anchor_first:
        return _dspark_out(model, target, hf)
    if kind == "dflash":
        raise DraftsmithError(
            "DeepSpec has no form for a mask-first DFlash (anchor + γ masks): DeepSpec's DFlash baseline "
            "(Qwen3DSparkModel, markov_rank 0) drafts from the anchor; export it with --format speculators or "
            "dflash-native, or train an anchor-first one (drafter.layout=anchor-first, the default)")
    raise DraftsmithError(f"the deepspec format holds DSpark and EAGLE-3 drafters, not {kind}")


def ids_out(layer_ids: Sequence[int], num_layers: int, who: str = "DeepSpec") -> list[int]:
    """Ours unchanged (DeepSpec and z-lab DFlash number the producing layer too), without L−1:
    their inference reads HF's hidden states, whose last entry is post-norm, and ours is not."""
    if num_layers - 1 in layer_ids:
        raise DraftsmithError(
            f"this drafter reads the last target layer ({num_layers - 1}), which {who} does not read as we do (its "
            "inference takes HF hidden states, and HF stores the final-normed state there); train it with layer_ids "
            f"that stop at {num_layers - 2} or lower to export it to {who}")
    return [int(i) for i in layer_ids]


# Gemma 3 keys for what its own layers compute and the draft layers do not (those are Qwen3
# layers: plain RMSNorm, SwiGLU, head_dim ** -0.5, no soft-capping, one RoPE)
_TARGET_ONLY = ("hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
                "rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern",
                "use_bidirectional_attention")


def draft_layer_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The target's HF config `hf` as the config of the draft layers, which are plain pre-norm
    SwiGLU layers with the target's geometry and *global* RoPE whatever the target family
    (drafters/block_attention.py, eagle3.py), read as Qwen3 / Llama layers by every engine.
    For a Gemma 3 target: its global RoPE spelled as such a reader takes it (transformers 5
    writes Gemma's per layer type, {"full_attention": .., "sliding_attention": ..}, which HF's
    Qwen3 rotary embedding cannot read, KeyError 'rope_type', and our importer reads as the
    default θ 10000; an old Gemma file without rope_theta means θ 1e6 to Gemma, 1e4 to Qwen3),
    and none of Gemma's keys for what only its own layers do."""
    cfg = {k: v for k, v in hf.items() if k not in _TARGET_ONLY}
    if hf.get("model_type") == "gemma3_text":
        params = hf.get("rope_parameters") or {}
        if "full_attention" in params or "sliding_attention" in params:
            cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": GEMMA3_ROPE_THETA["full_attention"],
                                      **(params.get("full_attention") or {})}
        elif hf.get("rope_theta") is None and "rope_theta" not in params:
            cfg["rope_theta"] = GEMMA3_ROPE_THETA["full_attention"]
    cfg["hidden_act"] = "silu"
    return cfg


def base_config(hf: dict[str, Any], target, arch: str, num_layers: int, intermediate: int,
                 dtype: torch.dtype) -> dict[str, Any]:
    """The target's HF config with DeepSpec's own entries, as its build_draft_config writes
    them (Qwen3 attention: model_type qwen3; geometry written out where a default differs)."""
    tc = target.model.config
    drop = ("architectures", "auto_map", "quantization_config", "torch_dtype", "dtype")
    cfg = {k: v for k, v in draft_layer_hf(hf).items() if k not in drop}
    cfg.update(
        architectures=[arch], model_type="qwen3", num_target_layers=tc.num_layers, num_hidden_layers=num_layers,
        intermediate_size=intermediate, head_dim=tc.head_dim, attention_bias=bool(tc.attention_bias),
        tie_word_embeddings=False,  # its embed_tokens and lm_head are separate copies
        layer_types=["full_attention"] * num_layers,  # no sliding window; vLLM: non-causal block layers
        dtype=str(dtype).removeprefix("torch."),
    )
    return cfg


def _target_tensor(target, name: str) -> torch.Tensor:
    """The target's own embedding or lm_head weight, by its DeepSpec name."""
    w = target.model.model.embed_tokens.weight if name == "embed_tokens.weight" else target.model.lm_head.weight
    return w.detach()


def _target_copies(target, dtype: torch.dtype, names: Sequence[str] = COPIES) -> dict[str, torch.Tensor]:
    """The target's embedding / lm_head as DeepSpec stores them: in the drafter's dtype (its
    files hold one dtype; DeepSpec copies the target after casting it to its precision). Own
    storage each: a tied target's two would otherwise share one, which safetensors refuses."""
    return {n: _target_tensor(target, n).cpu().to(dtype).clone() for n in names}


def ours_block(target, kind: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "target_id": target.target_id, "target_weights_hash": target.weights_hash, **extra}


def _dspark_out(model, target, hf):
    """DSpark, or an anchor-first DFlash as DeepSpec's DFlash baseline (markov_rank 0, no
    confidence head): the same class and backbone tensors."""
    c, tc = model.config, target.model.config
    kind, name = c.kind, "DSpark" if c.kind == "dspark" else "DFlash"
    V = tc.vocab_size
    if c.draft_vocab_size is not None and c.draft_vocab_size < V:
        raise DraftsmithError(
            f"this {name} drafter has a reduced draft vocabulary ({c.draft_vocab_size} of {V}); DeepSpec's holds the "
            "full vocabulary only (no d2t / t2d); retrain with draft_vocab_size=null, or export with --format "
            "speculators")
    ids = ids_out(c.layer_ids, tc.num_layers)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        theirs = rename(k, _DSPARK_NAMES)
        if theirs is None:
            raise DraftsmithError(f"{name} tensor {k} has no DeepSpec name")
        tensors[theirs] = v
    dtype = state["backbone.fc.weight"].dtype
    if tc.attention_bias:  # DeepSpec's o_proj has a bias whenever q/k/v do; ours is zero
        for i in range(c.num_layers):
            tensors[f"layers.{i}.self_attn.o_proj.bias"] = torch.zeros(tc.hidden_size, dtype=dtype)
    tensors.update(_target_copies(target, dtype))
    inter = int(state["backbone.layers.0.mlp.gate_proj.weight"].shape[0])
    config = base_config(hf, target, DSPARK_ARCH, c.num_layers, inter, dtype)
    config.update(
        block_size=c.block_size,  # anchor first: γ slots, slot k predicts a+k+1 (as ours)
        mask_token_id=c.mask_token_id, target_layer_ids=ids, num_anchors=c.max_anchors,
        sample_from_anchor=True,  # DeepSpec ignores it; engines that read it must not assume mask-first
        draftsmith=ours_block(target, kind, train={f: getattr(c, f) for f in _TRAIN_FIELDS if hasattr(c, f)}),
    )
    if kind == "dspark":
        config.update(markov_rank=c.rank, markov_head_type=_HEADS_OUT[c.head],
                      enable_confidence_head=True, confidence_head_with_markov=True)  # ours reads [h ; W1[x_{k-1}]]
    else:  # what DeepSpec's config/dflash/*.py build: no Markov head, no confidence head
        config.update(markov_rank=0, enable_confidence_head=False)
    return config, tensors


def _eagle3_out(model, target, hf):
    c, tc = model.config, target.model.config
    state = model.state_dict()
    V, Vd = tc.vocab_size, int(state["lm_head.weight"].shape[0])
    if Vd < V:
        raise DraftsmithError(
            f"this EAGLE-3 drafter has a reduced draft vocabulary ({Vd} of {V}); DeepSpec's lm_head is the full "
            "vocabulary (no d2t / t2d); retrain with draft_vocab_size=null, or export with --format speculators")
    if not tc.qk_norm:
        raise DraftsmithError(
            f"DeepSpec's EAGLE-3 layer (Qwen3) has q/k norms, and Draftsmith's EAGLE-3 has them only for Qwen3 "
            f"targets, not this {tc.model_type} one; export it with --format speculators instead")
    if len(c.layer_ids) != EAGLE3_NUM_LAYER_IDS:
        raise DraftsmithError(
            f"DeepSpec's EAGLE-3 takes exactly {EAGLE3_NUM_LAYER_IDS} target layers and this drafter reads "
            f"{len(c.layer_ids)} ({list(c.layer_ids)}); train it with {EAGLE3_NUM_LAYER_IDS} layer_ids to export it")
    ids = ids_out(c.layer_ids, tc.num_layers)
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if k in ("d2t", "t2d"):  # identity maps for a full vocabulary
            continue
        name = rename(k, _EAGLE3_NAMES)
        if name is None:
            raise DraftsmithError(f"EAGLE-3 tensor {k} has no DeepSpec name")
        tensors[name] = v
    dtype = state["fc.weight"].dtype
    if tc.attention_bias:
        tensors["layers.0.self_attn.o_proj.bias"] = torch.zeros(tc.hidden_size, dtype=dtype)
    tensors.update(_target_copies(target, dtype, ("embed_tokens.weight",)))  # lm_head: the drafter's own
    inter = int(state["layer.mlp.gate_proj.weight"].shape[0])
    config = base_config(hf, target, EAGLE3_ARCH, 1, inter, dtype)
    config.update(
        target_layer_ids=ids, ttt_length=c.ttt_steps, step_loss_decay=c.ttt_decay, draft_num_hidden_layers=1,
        target_model_name_or_path=str(target.path), draftsmith=ours_block(target, "eagle3"),
    )
    return config, tensors


# ---------------------------------------------------------------------------- import


def read_dir(src: str | Path, what: str = "DeepSpec") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and all tensors of an HF `save_pretrained` directory (a DeepSpec `step_N`,
    or a run directory with a `step_latest` link): one safetensors file or shards with an index."""
    d = Path(src)
    if not (d / "config.json").is_file() and (d / "step_latest").exists():
        d = d / "step_latest"
    cfg = read_json(d / "config.json", f"{what} config")
    index = d / "model.safetensors.index.json"
    if (d / "model.safetensors").is_file() or not index.is_file():
        return cfg, load_tensors(d / "model.safetensors", f"{what} drafter")
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
        raise DraftsmithError(f"{index} is not a safetensors index (no weight_map); the checkpoint is "
                              "damaged") from None
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_tensors(d / f, f"{what} drafter shard"))
    return cfg, tensors


def from_deepspec(cfg: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], target,
                  src: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(our drafter config dict, our state dict) of a DeepSpec checkpoint for the LoadedTarget
    `target`; refuses (with the reason) whatever our drafters would not compute exactly."""
    arch = list(cfg.get("architectures") or [])
    if arch not in ([DSPARK_ARCH], [EAGLE3_ARCH]):
        raise DraftsmithError(
            f"{src}: architectures {arch} is not a DeepSpec drafter Draftsmith runs ({DSPARK_ARCH}, {EAGLE3_ARCH}; "
            "the Gemma4 ones are outside Draftsmith's model families)")
    check_target(cfg, target, src)
    tensors = dict(tensors)
    if arch == [DSPARK_ARCH]:
        return _dspark_in(cfg, tensors, target, src)
    return _eagle3_in(cfg, tensors, target, src)


def _require(cfg: Mapping[str, Any], keys: Sequence[str], src) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise DraftsmithError(f"{src}: config.json lacks {', '.join(missing)}, which DeepSpec's model requires; "
                              "not a complete DeepSpec checkpoint")


def check_target(cfg: Mapping[str, Any], target, src) -> None:
    """The draft layers use the target's geometry, RoPE and norm eps (DeepSpec copies the
    target's config): a difference means it was trained for another target."""
    tc = target.model.config
    try:
        theirs = DecoderConfig.from_hf({**cfg, "num_hidden_layers": cfg.get("num_target_layers", tc.num_layers)})
    except DraftsmithError as e:
        raise DraftsmithError(f"{src}: {e}") from None
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps",
              "rope", "attention_bias")
    bad = [f"{f} {getattr(theirs, f)} (target: {getattr(tc, f)})" for f in fields
           if getattr(theirs, f) != getattr(tc, f)]
    if bad:
        raise DraftsmithError(f"{src} was made for another target: {'; '.join(bad)}; import it with the target it "
                              "drafts for (--target)")


def ids_in(raw: Any, num_layers: int, src) -> tuple[int, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        raise DraftsmithError(f"{src}: target_layer_ids must list the target layers the drafter reads, got {raw!r}")
    if -1 in raw:
        raise DraftsmithError(f"{src}: target_layer_ids {raw} reads the token embeddings (-1); Draftsmith drafters "
                              "read decoder layer outputs only")
    if any(not 0 <= i < num_layers for i in raw) or any(b <= a for a, b in zip(raw, raw[1:])):
        raise DraftsmithError(f"{src}: target_layer_ids {raw} must increase strictly within 0..{num_layers - 1}")
    return tuple(raw)  # both number the producing layer (DeepSpec's cache hooks the raw layer output)


def check_copies(tensors: dict[str, torch.Tensor], target, src, names: Sequence[str]) -> None:
    """DeepSpec's frozen embed_tokens / lm_head copies must be the target's (in the file's
    dtype); ours are the target's own tensors, so they are dropped after the check."""
    for name in names:
        have = tensors.pop(name, None)
        if have is None:
            continue
        ref = _target_tensor(target, name)
        if tuple(have.shape) != tuple(ref.shape) or not torch.equal(have, ref.to("cpu", have.dtype)):
            raise DraftsmithError(
                f"{src}: its {name} is not the target's (shape {tuple(have.shape)}, target {tuple(ref.shape)}); "
                "DeepSpec trained it against other weights, so import it with the target it was trained for")


def drop_zero_bias(tensors: dict[str, torch.Tensor], name: str, src) -> None:
    """Remove an o_proj bias that is all zeros (engines write one for biased targets); refuse any other."""
    b = tensors.pop(name, None)
    if b is not None and bool(b.ne(0).any()):
        raise DraftsmithError(f"{src}: {name} is not zero; Draftsmith's attention has no output bias")


def rename_all(tensors: Mapping[str, torch.Tensor], pairs, src) -> dict[str, torch.Tensor]:
    state = {}
    for k, v in tensors.items():
        ours = rename(k, pairs, inverse=True)
        if ours is None:
            raise DraftsmithError(f"{src}: unexpected tensor {k}; Draftsmith's drafter has no such weight")
        state[ours] = v
    return state


def _dspark_in(cfg, tensors, target, src):
    tc = target.model.config
    V, H = tc.vocab_size, tc.hidden_size
    _require(cfg, ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head", "markov_rank",
                   "block_size", "num_hidden_layers"), src)
    if cfg.get("sample_from_anchor", True) is not True:
        raise DraftsmithError(f"{src}: sample_from_anchor is {cfg.get('sample_from_anchor')!r}; DeepSpec's DSpark and "
                              "Draftsmith's draft from the anchor, and a mask-first block is not this layout")
    ids = ids_in(cfg["target_layer_ids"], tc.num_layers, src)
    n = int(cfg["num_hidden_layers"])
    check_copies(tensors, target, src, COPIES)
    for i in range(n):
        drop_zero_bias(tensors, f"layers.{i}.self_attn.o_proj.bias", src)
    state = rename_all(tensors, _DSPARK_NAMES, src)
    if n < 1 or f"backbone.layers.{n - 1}.self_attn.q_norm.weight" not in state:
        raise DraftsmithError(f"{src}: no draft layer tensors with q/k norms (layers.*); not a DeepSpec DSpark file")
    r = int(cfg["markov_rank"])
    conf = bool(cfg["enable_confidence_head"])
    if conf:  # DeepSpec asserts it whenever the confidence head is on
        _require(cfg, ("confidence_head_with_markov",), src)
    with_markov = conf and bool(cfg["confidence_head_with_markov"])
    dtype = state["backbone.fc.weight"].dtype if "backbone.fc.weight" in state else torch.float32
    if r < 0:
        raise DraftsmithError(f"{src}: markov_rank {r} is negative")
    if r == 0 and not conf:  # DeepSpec's DFlash baseline: our anchor-first DFlash
        if any(k.startswith("seq_head.") for k in state):
            raise DraftsmithError(f"{src}: Markov or confidence tensors in a checkpoint with markov_rank 0 and "
                                  "enable_confidence_head false")
        return _block_config(cfg, state, tc, n, ids, {"kind": "dflash", "layout": "anchor-first"}), state
    if r == 0:  # no sequential stage but a confidence head: rank 1 with W1 = W2 = 0 adds exactly 0
        if any(k.startswith("seq_head.") and not k.startswith("seq_head.conf.") for k in state):
            raise DraftsmithError(f"{src}: Markov tensors in a checkpoint with markov_rank 0")
        if with_markov:
            raise DraftsmithError(f"{src}: confidence_head_with_markov is true but there is no Markov head (rank 0)")
        head, rank = "markov", 1
        state["seq_head.w1.weight"] = torch.zeros(V, 1, dtype=dtype)
        state["seq_head.w2.weight"] = torch.zeros(V, 1, dtype=dtype)
    else:
        head = _HEADS_IN.get(str(cfg.get("markov_head_type", "")).lower())
        if head is None:
            raise DraftsmithError(f"{src}: markov_head_type {cfg.get('markov_head_type')!r} is not vanilla, gated or "
                                  "rnn (the heads DeepSpec and Draftsmith share)")
        rank = r
    if not conf:  # no confidence head: a zero one (logit 0 everywhere; the drafts do not depend on it)
        if "seq_head.conf.weight" in state:
            raise DraftsmithError(f"{src}: confidence head tensors but enable_confidence_head is false")
        state["seq_head.conf.weight"] = torch.zeros(1, H + rank, dtype=dtype)
        state["seq_head.conf.bias"] = torch.zeros(1, dtype=dtype)
    elif not with_markov and "seq_head.conf.weight" in state:  # reads h only: zero columns for W1[x_{k-1}]
        w = state["seq_head.conf.weight"]
        state["seq_head.conf.weight"] = torch.cat([w, torch.zeros(1, rank, dtype=w.dtype)], 1)
    return _block_config(cfg, state, tc, n, ids, {"kind": "dspark", "rank": rank, "head": head}), state


def _block_config(cfg, state, tc, n: int, ids, kind_fields: dict[str, Any]) -> dict[str, Any]:
    """Our DSpark / DFlash config dict of a Qwen3DSparkModel file (`kind_fields`: the kind's own)."""
    inter = int(state["backbone.layers.0.mlp.gate_proj.weight"].shape[0])
    ours = cfg.get("draftsmith")
    train = ours.get("train") if isinstance(ours, dict) and isinstance(ours.get("train"), dict) else {}
    keep = _TRAIN_FIELDS if kind_fields["kind"] == "dspark" else tuple(f for f in _TRAIN_FIELDS if f != "conf_weight")
    return {
        **kind_fields, "num_layers": n, "layer_ids": list(ids), "mask_token_id": int(cfg["mask_token_id"]),
        "block_size": int(cfg["block_size"]), "max_anchors": int(cfg["num_anchors"]), "draft_vocab_size": None,
        "intermediate_size": None if inter == tc.intermediate_size else inter,
        "qk_norm": None if tc.qk_norm else True,  # DeepSpec's layers always have q/k norms
        **{k: v for k, v in train.items() if k in keep},
    }


def _eagle3_in(cfg, tensors, target, src):
    tc = target.model.config
    V = tc.vocab_size
    _require(cfg, ("target_layer_ids", "ttt_length", "step_loss_decay"), src)
    n = int(cfg.get("num_hidden_layers") or 1)
    if n != 1:
        raise DraftsmithError(f"{src}: an EAGLE-3 drafter with {n} layers; Draftsmith's has 1")
    if not tc.qk_norm:
        raise DraftsmithError(f"{src}: DeepSpec's EAGLE-3 layer has q/k norms, and Draftsmith's EAGLE-3 has them only "
                              f"for Qwen3 targets, not this {tc.model_type} one")
    ids = ids_in(cfg["target_layer_ids"], tc.num_layers, src)
    check_copies(tensors, target, src, ("embed_tokens.weight",))  # lm_head is the drafter's own head
    drop_zero_bias(tensors, "layers.0.self_attn.o_proj.bias", src)
    state = rename_all(tensors, _EAGLE3_NAMES, src)
    head = state.get("lm_head.weight")
    if head is None or tuple(head.shape) != (V, tc.hidden_size) or "layer.mlp.gate_proj.weight" not in state:
        raise DraftsmithError(f"{src}: no EAGLE-3 layer tensors (layers.0.*) or no full-vocabulary lm_head [{V}, "
                              f"{tc.hidden_size}]; not a DeepSpec EAGLE-3 file")
    state["d2t"], state["t2d"] = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    inter = int(state["layer.mlp.gate_proj.weight"].shape[0])
    config = {"kind": "eagle3", "layer_ids": list(ids), "ttt_steps": int(cfg["ttt_length"]),
              "ttt_decay": float(cfg["step_loss_decay"]), "draft_vocab_size": None,
              "intermediate_size": None if inter == tc.intermediate_size else inter}
    return config, state
