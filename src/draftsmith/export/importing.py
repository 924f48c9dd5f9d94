"""Import a drafter written in the speculators format (what vLLM serves), DeepSpec's layout
(export/deepspec.py) or z-lab's DFlash layout (export/dflash_native.py) as a Draftsmith
checkpoint, so `eval`, `bench`, `generate`, `serve` and the prefix scheduler can measure it.
The layout is detected from config.json unless given (export/detect.py); `--drafter KIND:DIR`
imports such a directory in memory (drafters/checkpoint.py).

The maps are the inverse of export/formats.py (docs/FORMATS.md §3). Only what our drafters
compute exactly is accepted; every other setting is a DraftsmithError that names it, because
a drafter that loads but computes something else drafts garbage without any error (the
verifier stays lossless, acceptance just collapses):

- feature ids are speculators' consumer ids (ours + 1); id 0 (the embeddings) cannot be read;
- EAGLE-3: one layer, norm_before_residual / norm_before_fc / fc_norm / norm_output false,
  target_hidden_size null or H, a zero (or absent) o_proj bias;
- DFlash: sample_from_anchor true (anchor-first, our default layout) or false / absent
  (mask-first, vLLM's reading of an absent key); DSpark: sample_from_anchor true, a confidence
  head that reads the Markov embedding (or none: a zero head), and a W1 [V, r] whose rows
  outside a reduced draft vocabulary are all equal (our table shares one such row);
- the geometry (hidden size, vocabulary, heads) must be the target's, and a shipped lm_head of
  the draft vocabulary must be the target's rows (block drafters use the target's head).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.drafters import registry
from draftsmith.drafters.checkpoint import (CALIBRATION_FILE, read_sts, restore_state, save_trained_drafter,
                                            write_calibration)
from draftsmith.drafters.kind_config import config_from_dict
from draftsmith.errors import DraftsmithError
from draftsmith.export import deepspec, dflash_native
from draftsmith.export.detect import IMPORT_FORMATS, count_field, detect_foreign, speculators_proposal
from draftsmith.export.formats import check_drafter_out, speculators_train_fields
from draftsmith.fileio import read_json
from draftsmith.tensorfile import load_tensors

_HEADS = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}


def import_model(src: str | Path, target, fmt: str | None = None) -> nn.Module:
    """Our drafter model of the `fmt` directory `src` (speculators; a DeepSpec step_N or run
    directory; z-lab DFlash) for the LoadedTarget `target`. fmt None: detected from config.json."""
    src = Path(src)
    fmt = fmt or detect_foreign(src)
    if fmt not in IMPORT_FORMATS:
        raise DraftsmithError(f"unknown import format {fmt!r}; choose one of {', '.join(IMPORT_FORMATS)}")
    try:
        if fmt == "deepspec":
            cfg, tensors = deepspec.read_dir(src)
            config, state = deepspec.from_deepspec(cfg, tensors, target, src)
        elif fmt == "dflash-native":
            cfg, tensors = deepspec.read_dir(src, "z-lab DFlash")  # the same HF save_pretrained files
            config, state = dflash_native.from_dflash_native(cfg, tensors, target, src)
        else:
            config, state = _speculators(src, target)
    except (KeyError, ValueError, TypeError, AttributeError) as e:  # a field missing, or not of its type
        what = f"no {e}" if isinstance(e, KeyError) else " ".join(str(e).split())
        raise DraftsmithError(f"{src}: its config.json is not a {fmt} drafter config Draftsmith can read ({what}); "
                              "the file is damaged, or was written by another version of that format") from None
    kind = config["kind"]
    entry = registry.get(kind, trainable=True)
    model = entry.build(target.model, config_from_dict(config, entry.config_cls, kind))
    restore_state(model, state, src)
    return model


def import_drafter(src: str | Path, target, out: str | Path, fmt: str | None = None, overwrite: bool = False) -> Path:
    """`import_model`, written to `out` as our checkpoint, with `src`'s calibration.json when it
    has one (what `export` wrote, and `--drafter KIND:SRC` reads). A non-empty `out`, or `out` =
    `src`, is refused unless `overwrite` (then its config.json and model.safetensors are replaced,
    and a calibration.json there is src's, or removed: it was fitted to other weights)."""
    out = check_drafter_out(out, overwrite, source=src, source_what="drafter directory")
    sts = read_sts(src)  # a damaged file stops the import before anything is written
    model = import_model(src, target, fmt)
    save_trained_drafter(model, out, target.target_id, target.weights_hash)
    write_calibration(out, sts)  # src's, or none: one there was fitted to other weights
    return out


def _speculators(src: Path, target) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg = read_json(src / "config.json", "speculators config")
    tensors = load_tensors(src / "model.safetensors", "speculators drafter")
    kind = cfg.get("speculators_model_type")
    if kind not in ("eagle3", "dflash", "dspark"):
        raise DraftsmithError(f"{src}: speculators_model_type {kind!r} is not one Draftsmith runs "
                              "(eagle3, dflash, dspark)")
    _check_geometry(cfg, target, src)
    if kind == "eagle3":
        return _eagle3(cfg, tensors, target, src)
    return _block(kind, cfg, tensors, target, src)


# ---------------------------------------------------------------------------- shared checks


def _check_geometry(cfg: dict[str, Any], target, src: Path) -> None:
    layer = cfg.get("transformer_layer_config") or {}
    tc = target.model.config
    have = {"hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size, "num_attention_heads": tc.num_heads,
            "num_key_value_heads": tc.num_kv_heads}
    bad = [f"{k} {layer.get(k)} (target: {v})" for k, v in have.items() if layer.get(k) not in (None, v)]
    if bad:
        raise DraftsmithError(f"{src} was made for another target: {', '.join(bad)}; import it with the target "
                              "it drafts for (--target)")


def _train_fields(cfg: dict[str, Any], kind: str) -> dict[str, Any]:
    """The training-only config fields our own exports keep in the "draftsmith" block
    (export/formats.py); a directory another tool wrote has none, and gets our defaults."""
    ours = cfg.get("draftsmith")
    train = ours.get("train") if isinstance(ours, dict) and isinstance(ours.get("train"), dict) else {}
    keep = speculators_train_fields(kind)
    return {k: v for k, v in train.items() if k in keep}


def _layer_ids(cfg: dict[str, Any], key: str, src: Path) -> list[int]:
    ids = cfg.get(key)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise DraftsmithError(f"{src}: {key} must list the target layers the drafter reads, got {ids!r}")
    if min(ids) < 1:
        raise DraftsmithError(f"{src}: {key} reads the embeddings (id 0); Draftsmith drafters read decoder "
                              "layer outputs only")
    if ids != sorted(ids):
        raise DraftsmithError(f"{src}: {key} {ids} is not in ascending order (vLLM sorts it)")
    return [i - 1 for i in ids]  # speculators / vLLM number the layer a state feeds


def _vocab(tensors: dict[str, torch.Tensor], V: int, Vd: int, src: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): the files' for a reduced vocabulary, identity maps for a full one."""
    if Vd >= V:
        return torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    if "d2t" not in tensors or "t2d" not in tensors:
        raise DraftsmithError(f"{src}: draft_vocab_size {Vd} < {V} but the file has no d2t / t2d maps")
    d2t, t2d = tensors.pop("d2t").long(), tensors.pop("t2d").bool()
    if d2t.shape != (Vd,) or t2d.shape != (V,) or int(t2d.sum()) != Vd:
        raise DraftsmithError(f"{src}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not describe a "
                              f"{Vd}-token draft vocabulary of {V}")
    ids = torch.arange(Vd) + d2t
    if bool((ids[1:] <= ids[:-1]).any()) or not bool(t2d[ids].all()):
        raise DraftsmithError(f"{src}: d2t is not the ascending, t2d-consistent map engines use")
    return d2t, t2d


# ---------------------------------------------------------------------------- EAGLE-3


def _eagle3(cfg, tensors, target, src):
    layer = cfg.get("transformer_layer_config") or {}
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise DraftsmithError(f"{src}: an EAGLE-3 drafter with {layer.get('num_hidden_layers')} layers; ours has 1")
    for flag, default in (("norm_before_residual", True), ("norm_before_fc", False), ("fc_norm", False),
                          ("norm_output", False)):
        if cfg.get(flag, default):  # vLLM assumes norm_before_residual=True when the key is absent
            raise DraftsmithError(f"{src}: {flag} is true (or absent, which vLLM reads as true); Draftsmith's "
                                  "EAGLE-3 layer computes the false case only")
    th = cfg.get("target_hidden_size")
    if th not in (None, target.model.config.hidden_size):
        raise DraftsmithError(f"{src}: target_hidden_size {th} differs from the target's hidden size")
    tensors = dict(tensors)
    tensors.pop("embed_tokens.weight", None)  # ours shares the target's embedding
    prefix = "layers.0." if any(k.startswith("layers.0.") for k in tensors) else "midlayer."
    deepspec.drop_zero_bias(tensors, prefix + "self_attn.o_proj.bias", src)
    V = target.model.config.vocab_size
    Vd = int(cfg.get("draft_vocab_size") or V)
    d2t, t2d = _vocab(tensors, V, Vd, src)
    state = {"d2t": d2t, "t2d": t2d}
    for k, v in tensors.items():
        state["layer." + k[len(prefix):] if k.startswith(prefix) else k] = v
    if "layer.mlp.gate_proj.weight" not in state:
        raise DraftsmithError(f"{src}: no EAGLE-3 layer tensors ({prefix}*)")
    inter = int(state["layer.mlp.gate_proj.weight"].shape[0])
    config = {"kind": "eagle3", "layer_ids": _layer_ids(cfg, "eagle_aux_hidden_state_layer_ids", src),
              "ttt_steps": count_field(speculators_proposal(cfg, src).get("speculative_tokens")) or 7,
              "draft_vocab_size": Vd if Vd < V else None,
              "intermediate_size": None if inter == target.model.config.intermediate_size else inter,
              **_train_fields(cfg, "eagle3")}
    return config, state


# ---------------------------------------------------------------------------- DFlash / DSpark


def _block(kind, cfg, tensors, target, src):
    tc = target.model.config
    V = tc.vocab_size
    Vd = int(cfg.get("draft_vocab_size") or V)
    anchor_first = bool(cfg.get("sample_from_anchor", False))  # vLLM's reading of an absent key
    if kind == "dspark" and not anchor_first:
        raise DraftsmithError(f"{src}: DSpark with sample_from_anchor false or absent (vLLM reads absent as "
                              "false); Draftsmith's DSpark drafts from the anchor")
    layer = cfg.get("transformer_layer_config") or {}
    n = int(layer.get("num_hidden_layers") or 0)
    tensors = dict(tensors)
    for i in range(n):
        deepspec.drop_zero_bias(tensors, f"layers.{i}.self_attn.o_proj.bias", src)
    head = tensors.pop("lm_head.weight", None)
    tensors.pop("embed_tokens.weight", None)
    d2t, t2d = _vocab(tensors, V, Vd, src)
    ids = torch.arange(Vd) + d2t if Vd < V else torch.arange(V)
    if head is not None and not torch.equal(head.float(), target.model.lm_head.weight.detach().float().cpu()[ids]):
        raise DraftsmithError(f"{src}: its lm_head is not the target's rows; Draftsmith's block drafters use the "
                              "target's own head")
    state: dict[str, torch.Tensor] = {}
    seq: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        if k.startswith(("markov_head.", "confidence_head.")):
            seq[k] = v
        elif k.startswith("hidden_norm."):
            state["backbone.ctx_norm." + k[len("hidden_norm."):]] = v
        else:
            state["backbone." + k] = v
    if Vd < V:
        state["backbone.vocab.d2t"], state["backbone.vocab.t2d"] = d2t, t2d
    q_norm = "backbone.layers.0.self_attn.q_norm.weight" in state
    inter = int(state["backbone.layers.0.mlp.gate_proj.weight"].shape[0]) if n else tc.intermediate_size
    config: dict[str, Any] = {
        "kind": kind, "num_layers": n, "layer_ids": _layer_ids(cfg, "aux_hidden_state_layer_ids", src),
        "mask_token_id": int(cfg["mask_token_id"]) if "mask_token_id" in cfg else None,
        "draft_vocab_size": Vd if Vd < V else None,
        "intermediate_size": None if inter == tc.intermediate_size else inter,
        "qk_norm": None if q_norm == tc.qk_norm else q_norm,
        "block_size": int(cfg["block_size"]) - (0 if anchor_first else 1),
        **_train_fields(cfg, kind),
    }
    if kind == "dflash":
        config["layout"] = "anchor-first" if anchor_first else "mask-first"
    if kind == "dspark":
        config.update(_markov(cfg, seq, config, V, Vd, d2t, tc.hidden_size, src, state))
    elif seq:
        raise DraftsmithError(f"{src}: a DFlash drafter with Markov / confidence tensors")
    return config, state


def _markov(cfg, seq, config, V, Vd, d2t, H, src, state) -> dict[str, Any]:
    r = int(cfg.get("markov_rank") or 0)
    head = _HEADS.get(cfg.get("markov_head_type", "vanilla"))
    if head is None:
        raise DraftsmithError(f"{src}: markov_head_type {cfg.get('markov_head_type')!r} is not vanilla, gated or rnn")
    if r == 0:  # no sequential stage: rank 1 with W2 = 0 adds exactly nothing
        r, head = 1, "markov"
        w1, w2 = torch.zeros(V, 1), torch.zeros(Vd, 1)
    else:
        w1, w2 = seq.pop("markov_head.markov_w1.weight"), seq.pop("markov_head.markov_w2.weight")
    if Vd < V:  # our table: the draft ids' rows, then one row shared by every other token
        ids = torch.arange(Vd) + d2t
        outside = torch.ones(V, dtype=torch.bool)
        outside[ids] = False
        rest = w1[outside]
        if rest.shape[0] and not bool((rest == rest[0]).all()):
            raise DraftsmithError(f"{src}: markov W1 rows of tokens outside the {Vd}-token draft vocabulary differ; "
                                  "Draftsmith shares one row for them, so the import would change the drafter")
        w1 = torch.cat([w1[ids], rest[:1] if rest.shape[0] else torch.zeros(1, w1.shape[1], dtype=w1.dtype)])
    state["seq_head.w1.weight"], state["seq_head.w2.weight"] = w1, w2
    for k, v in seq.items():
        if k.startswith("markov_head.gate_proj."):
            state["seq_head.gate." + k[len("markov_head.gate_proj."):]] = v
        elif k.startswith("markov_head.joint_proj."):
            state["seq_head.cell." + k[len("markov_head.joint_proj."):]] = v
        elif k.startswith("confidence_head.proj."):
            state["seq_head.conf." + k[len("confidence_head.proj."):]] = v
        else:
            raise DraftsmithError(f"{src}: unexpected DSpark tensor {k}")
    if not cfg.get("enable_confidence_head", True) or "seq_head.conf.weight" not in state:
        state["seq_head.conf.weight"], state["seq_head.conf.bias"] = torch.zeros(1, H + r), torch.zeros(1)
    elif not cfg.get("confidence_head_with_markov", True):  # reads h only: zero columns for e
        w = state["seq_head.conf.weight"]
        state["seq_head.conf.weight"] = torch.cat([w, torch.zeros(1, r, dtype=w.dtype)], 1)
    return {"rank": r, "head": head}
