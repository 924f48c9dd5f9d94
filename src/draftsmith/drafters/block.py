"""The block-parallel backbone shared by DFlash and DSpark, its training forward, and the
config fields the two kinds share.

Backbone (DFlash paper; docs/ALGORITHMS.md):
- context: target features of m layers, concatenated → W_c (mH→H) → RMSNorm = H_ctx;
- KV injection: every draft layer attends over keys [W_K H_ctx ; W_K H_d] and values
  [W_V H_ctx ; W_V H_d]; queries come from the block H_d only (drafters/block_attention.py);
- the block: the anchor (last committed token) followed by mask tokens, bidirectional
  inside the block; the block sees the context strictly before the anchor (the anchor is
  the engine's pending token and has no target features yet);
- embedding and lm_head are the target's, frozen, never saved (`TargetHead`); with a
  reduced draft vocabulary (drafters/vocab.py) the drafter scores only those lm_head rows.

Training runs many blocks of a conversation in one packed forward (`packed_forward`);
inference is `BlockDrafter` (drafters/block_drafter.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.data.features import default_layer_ids
from draftsmith.drafters.anchors import BlockPack, pack_blocks, sample_anchors
from draftsmith.drafters.base import FeatureSpec
from draftsmith.drafters.block_attention import InjectedLayer, NormFn, head_rope
from draftsmith.drafters.protocol import TrainBatch
from draftsmith.drafters.target_head import TargetHead, concat_features, init_linear_
from draftsmith.drafters.vocab import DraftVocab
from draftsmith.errors import DraftsmithError
from draftsmith.kernels.build import cpu_kernels
from draftsmith.models.decoder import Decoder, RMSNorm
from draftsmith.models.linear import PackedWeight
from draftsmith.models.rope import rope_inv_freq


# ---------------------------------------------------------------------------- backbone


class BlockBackbone(nn.Module):
    """W_c + RMSNorm context projection, `num_layers` KV-injected layers, final norm, and
    the draft vocabulary (all target tokens, or the `draft_vocab_size` most frequent)."""

    def __init__(
        self,
        target: Decoder,
        layer_ids: Sequence[int],
        num_layers: int,
        mask_token_id: int,
        intermediate_size: int | None = None,
        draft_vocab_size: int | None = None,
        init_from_target: bool = False,
        qk_norm: bool | None = None,
    ) -> None:
        super().__init__()
        tc = target.config
        self.cfg = dataclasses.replace(
            tc, num_layers=num_layers, intermediate_size=intermediate_size or tc.intermediate_size,
            qk_norm=tc.qk_norm if qk_norm is None else bool(qk_norm),
        )
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.mask_token_id = int(mask_token_id)
        H = tc.hidden_size
        self.fc = nn.Linear(len(self.layer_ids) * H, H, bias=False)  # W_c
        self.ctx_norm = RMSNorm(H, tc.rms_norm_eps)
        self.layers = nn.ModuleList(InjectedLayer(self.cfg) for _ in range(num_layers))
        self.norm = RMSNorm(H, tc.rms_norm_eps)
        inv, scale = rope_inv_freq(tc.rope, tc.head_dim, tc.max_position_embeddings)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scale = scale
        self.head = TargetHead.of(target)
        V = tc.vocab_size
        self.vocab = DraftVocab(V, draft_vocab_size) if draft_vocab_size and draft_vocab_size < V else None
        self.lm_rows: torch.Tensor | None = None  # the target's lm_head rows of the draft ids (derived)
        self._lm_pack = PackedWeight()  # lm_rows laid out for the CPU kernel at inference (models/linear.py)
        self._full_pack = PackedWeight()  # the whole lm_head, for target_stats
        init_linear_(self)
        if init_from_target:
            self.init_layers_from(target)
        self._take_lm_rows()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._take_lm_rows())

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def init_layers_from(self, target: Decoder) -> None:
        """Start draft layer j as a copy of target layer L − n + j (its last n layers: they
        already map hidden states towards next-token logits through the same lm_head)."""
        src = list(target.model.layers)[-len(self.layers):]
        for mine, theirs in zip(self.layers, src):
            own = mine.state_dict()
            state = {k: v for k, v in theirs.state_dict().items() if k in own}
            # q/k norms the target lacks (drafter.qk_norm=true on a Llama-style target) start at 1
            state.update({k: v for k, v in own.items() if k not in state and k.endswith(("q_norm.weight", "k_norm.weight"))})
            bad = [k for k in own if k not in state or state[k].shape != own[k].shape]
            if bad:
                raise DraftsmithError(f"init_from_target: draft layer tensors {bad[:3]} have no same-shaped "
                                      "counterpart in the target's layers (a different intermediate_size?)")
            mine.load_state_dict({k: v.detach().clone() for k, v in state.items()})

    # -- the draft vocabulary (identity maps when it is the target's)

    @property
    def draft_size(self) -> int:
        return self.vocab.size if self.vocab is not None else self.head.vocab_size

    def _take_lm_rows(self) -> None:
        """The target's lm_head rows of the draft ids, in this backbone's dtype (a copy: a
        bfloat16 drafter beside a float32 target reads half the bytes; drafters/precision.py)."""
        if self.vocab is not None:
            rows = self.head.lm_head[self.vocab.ids.to(self.head.lm_head.device)]
            self.lm_rows = rows.to(self.fc.weight.device, self.fc.weight.dtype)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._take_lm_rows()  # `.to(dtype / device)`: the derived rows follow the weights
        return out

    def set_draft_vocab(self, token_counts: torch.Tensor | Sequence[int]) -> None:
        """Choose the reduced vocabulary from training-data token counts [V] (no-op without one)."""
        if self.vocab is not None:
            self.vocab.set_counts(token_counts)
            self._take_lm_rows()

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] → float32 logits over the draft vocabulary [..., Vd] (frozen target rows)."""
        if self.vocab is None:
            return self.head.logits(h)
        return self._lm_pack(h.to(self.lm_rows.dtype), self.head.autocast_weight(self.lm_rows)).float()

    @torch.no_grad()
    def target_stats(self, final_hidden: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per position of `final_hidden` [T, H]: the log-sum-exp of the target's logits outside
        the reduced draft vocabulary [T] and the target's argmax token [T] (None without a
        reduced vocabulary). With them a training step needs the lm_head over the draft
        vocabulary only: at every drafted position the full lm_head, its softmax and argmax
        were ~40% of a DSpark step. Computed in the caller's precision (autocast or not), as
        the step's own logits are, through the same packed-weight path (a row's logits do not
        depend on the chunk it is computed in)."""
        if self.vocab is None:
            return None
        dev = final_hidden.device
        add = torch.zeros(self.head.vocab_size, dtype=torch.float32, device=dev)  # 0: counts in the rest
        add[self.vocab.ids.to(dev)] = -torch.inf
        w = self.head.autocast_weight(self.head.lm_head)
        fused = dev.type == "cpu" and cpu_kernels().ok
        lse, top = [], []
        for i in range(0, final_hidden.shape[0], chunk):
            lg = self._full_pack(final_hidden[i: i + chunk].to(w.dtype), w)
            if fused and lg.dtype in (torch.float32, torch.bfloat16):
                a, b = torch.ops.draftsmith.lse_argmax(lg, add)
            else:
                lg = lg.float()
                a, b = torch.logsumexp(lg + add, -1), lg.argmax(-1)
            lse.append(a)
            top.append(b)
        if not lse:  # no positions (the trainer's "does this model have statistics?" probe)
            return final_hidden.new_zeros(0, dtype=torch.float32), final_hidden.new_zeros(0, dtype=torch.long)
        return torch.cat(lse), torch.cat(top)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """[Vd] target id of each draft id; None when the draft vocabulary is the target's."""
        return self.vocab.ids if self.vocab is not None else None

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids → draft ids (Vd for a token outside a reduced vocabulary)."""
        return target_ids if self.vocab is None else self.vocab.to_draft(target_ids)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.vocab is None else self.vocab.ids[draft_ids]

    def to_target_q(self, q: torch.Tensor) -> torch.Tensor:
        """[..., Vd] → [..., V] (zero outside the draft vocabulary)."""
        return q if self.vocab is None else self.vocab.scatter(q)

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """layer id → [B, T, H] → concatenated [B, T, mH] in `layer_ids` order."""
        return concat_features(hidden, self.layer_ids, self.dtype)

    def context(self, feats: torch.Tensor, norm: NormFn | None = None) -> torch.Tensor:
        """H_ctx = RMSNorm(W_c feats): [B, T, mH] → [B, T, H]; `norm(x, weight, eps)` in place of
        the module call (the drafter's inference: the one-pass CPU kernel, ~60 → ~3 us a call)."""
        x = self.fc(feats)
        return self.ctx_norm(x) if norm is None else norm(x, self.ctx_norm.weight, self.ctx_norm.eps)

    def context_kv(self, h_ctx: torch.Tensor, positions: torch.Tensor,
                   norm: NormFn | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, rotated keys and values [B, Hkv, T, D] of H_ctx at positions [B, T]."""
        cos, sin = head_rope(self.inv_freq, positions, self.rope_scale, h_ctx.dtype)
        return [layer.self_attn.key_value(h_ctx, cos, sin, norm) for layer in self.layers]

    def block_inputs(self, anchors: torch.Tensor, n_in: int) -> torch.Tensor:
        """anchor ids [...] → block ids [..., n_in]: the anchor, then n_in − 1 mask tokens."""
        ids = torch.full((*anchors.shape, n_in), self.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        return ids

    def blocks(
        self,
        ids: torch.Tensor,  # [B, A, n] block token ids
        positions: torch.Tensor,  # [B, A, n] absolute positions (anchor index + 0..n−1)
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_mask: torch.Tensor,  # [B, A, T]
    ) -> torch.Tensor:
        """→ final-normed block hidden states [B, A, n, H] (the lm_head input)."""
        x = self.head.embed_ids(ids, self.dtype)
        cos, sin = head_rope(self.inv_freq, positions, self.rope_scale, x.dtype)
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, kv, ctx_mask, cos, sin)
        return self.norm(x)


# ---------------------------------------------------------------------------- training forward


@dataclass
class PackedForward:
    """One packed training forward: the sampled blocks and their drafted positions.

    pack:    anchors, masks and drafted-token indices (drafters/anchors.py)
    hidden:  [B, A, γ, H] final-normed hidden at the γ drafted positions of every block
    targets: [B, A, γ] x*_k (the token at a+k);  prev: [B, A, γ] x_{k−1} (anchor at k = 1)
    """

    pack: BlockPack
    hidden: torch.Tensor
    targets: torch.Tensor
    prev: torch.Tensor


def packed_forward(
    backbone: BlockBackbone,
    batch: TrainBatch,
    gamma: int,
    anchor_is_first_prediction: bool,
    anchors: torch.Tensor,  # [B, A] (train/anchors.sample_anchors)
    valid: torch.Tensor,  # [B, A]
) -> PackedForward:
    """Run every block of the batch through the backbone at once.

    DFlash (anchor_is_first_prediction=False): block = anchor + γ masks, drafts at block
    positions 1..γ. DSpark (True): block = anchor + γ−1 masks, drafts at positions 0..γ−1.
    Either way the drafted tokens are those at a+1 .. a+γ.
    """
    ids, lengths = batch.input_ids, batch.lengths
    B, T = ids.shape
    pack = pack_blocks(batch.loss_mask, lengths, anchors, valid, gamma)
    h_ctx = backbone.context(backbone.features(batch.hidden))  # [B, T, H]
    pos = torch.arange(T, device=ids.device).expand(B, T)
    ctx_kv = backbone.context_kv(h_ctx, pos)
    n_in = gamma if anchor_is_first_prediction else gamma + 1
    off = 0 if anchor_is_first_prediction else 1
    block_ids = backbone.block_inputs(ids.gather(1, anchors), n_in)  # [B, A, n_in]
    block_pos = anchors[:, :, None] + torch.arange(n_in, device=ids.device)
    h = backbone.blocks(block_ids, block_pos, ctx_kv, pack.context_mask)  # [B, A, n_in, H]
    prev_index = (anchors[:, :, None] + torch.arange(gamma, device=ids.device)).clamp(max=T - 1)
    return PackedForward(
        pack=pack,
        hidden=h[:, :, off : off + gamma],
        targets=ids.gather(1, pack.target_index.reshape(B, -1)).view_as(pack.target_index),
        prev=ids.gather(1, prev_index.reshape(B, -1)).view_as(prev_index),
    )


def target_logits_at(backbone: BlockBackbone, batch: TrainBatch, pack: BlockPack
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The target's distribution at the valid drafted positions: the token at a+k is predicted
    by lm_head(final_hidden[a+k−1]). (logits [N, V], None, None); or, when the batch carries the
    target's statistics outside a reduced draft vocabulary (`BlockBackbone.target_stats`),
    (logits over the draft vocabulary [N, Vd], log-sum-exp of the rest [N], argmax [N]): the
    same distribution from Vd of the V lm_head rows (8192 of 49152 for the built-in)."""
    idx = (pack.target_index - 1).clamp(min=0)[pack.target_mask]  # [N]
    B = batch.final_hidden.shape[0]
    rows = torch.arange(B, device=idx.device)[:, None, None].expand_as(pack.target_index)[pack.target_mask]
    with torch.no_grad():
        h = batch.final_hidden[rows, idx]
        if batch.target_rest_lse is not None and backbone.vocab is not None:
            return backbone.draft_logits(h), batch.target_rest_lse[rows, idx], batch.target_top1[rows, idx]
        return backbone.head.logits(h), None, None


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True)
class BlockConfig:
    """The fields DFlash and DSpark share: the backbone and its training. Each kind's config
    subclasses this and sets its kind, loss weights and extras."""

    kind: str = "block"
    block_size: int = 7  # γ: drafts per forward
    num_layers: int = 5  # draft layers, each with the context K/V injected
    layer_ids: tuple[int, ...] = ()  # target feature layers; () = num_layers spread over [1, L−3]
    mask_token_id: int | None = None  # None = resolved at build (choose_mask_token_id)
    intermediate_size: int | None = None  # draft MLP width; None = the target's
    max_anchors: int = 512  # training blocks sampled per sequence
    draft_vocab_size: int | None = None  # reduced draft vocabulary (drafters/vocab.py); None = the target's
    ce_weight: float = 1.0
    tv_weight: float = 0.0
    kl_weight: float = 0.0  # KL(p_t ‖ p_d) per position (drafters/losses.py); 0 in the papers
    init_from_target: bool = False  # start the draft layers as copies of the target's last layers
    # q/k RMSNorm in the draft layers; None = as the target. True lets a drafter of a target
    # without them (Llama, SmolLM) export to vLLM / speculators, whose block layers are Qwen3's
    qk_norm: bool | None = None
    position_decay: float | None = None  # w_k = exp(−(k−1)/d); None = block_size

    def __post_init__(self) -> None:
        validate_block_config(self)


# ---------------------------------------------------------------------------- config helpers


def choose_mask_token_id(vocab_size: int, tokenizer=None) -> int:
    """The embedding row block drafters use as their mask token (never trained: the target's
    embedding is frozen; the drafter learns what that input means). Deterministic:

    1. the first row no tokenizer entry maps to, when the embedding is padded past the
       tokenizer (Qwen3: 151669, the row DFlash uses);
    2. otherwise the highest-id added token that is not a special token the model uses
       (bos / eos / pad / unk / chat markers) — SmolLM2: 16 `<empty_output>`, a code-corpus
       marker chat never produces;
    3. otherwise (no tokenizer at hand) the last row, vocab_size − 1.
    """
    if tokenizer is not None:
        n = len(tokenizer)
        if n < vocab_size:
            return n
        used = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        spare = sorted(int(i) for i in added if int(i) not in used and int(i) < vocab_size)
        if spare:
            return spare[-1]
    return vocab_size - 1


def validate_block_config(cfg) -> None:
    """Checks shared by DFlashConfig and DSparkConfig (called from __post_init__)."""
    if isinstance(cfg.layer_ids, list):
        object.__setattr__(cfg, "layer_ids", tuple(cfg.layer_ids))
    problems = []
    for name in ("block_size", "num_layers", "max_anchors"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            problems.append(f"{name} must be an integer >= 1, got {v!r}")
    if cfg.intermediate_size is not None and (not isinstance(cfg.intermediate_size, int) or cfg.intermediate_size < 1):
        problems.append(f"intermediate_size must be a positive integer or null, got {cfg.intermediate_size!r}")
    dv = cfg.draft_vocab_size
    if dv is not None and (not isinstance(dv, int) or isinstance(dv, bool) or dv < 1):
        problems.append(f"draft_vocab_size must be a positive integer or null, got {dv!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in cfg.layer_ids):
        problems.append(f"layer_ids must be integers, got {cfg.layer_ids!r}")
    elif len(set(cfg.layer_ids)) != len(cfg.layer_ids):
        problems.append(f"layer_ids repeat: {list(cfg.layer_ids)}")
    for name in ("ce_weight", "tv_weight", "kl_weight", "conf_weight"):
        v = getattr(cfg, name, 0.0)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 <= v < float("inf")):  # (nan, inf)
            problems.append(f"{name} must be a finite number >= 0, got {v!r}")
    if cfg.position_decay is not None and not (isinstance(cfg.position_decay, (int, float)) and cfg.position_decay > 0):
        problems.append(f"position_decay must be > 0 or null, got {cfg.position_decay!r}")
    if problems:
        raise DraftsmithError(f"{cfg.kind} config: " + "; ".join(problems))


def resolve_feature_layers(layer_ids: Sequence[int], n_default: int, num_layers: int, kind: str) -> tuple[int, ...]:
    """Explicit ids are range-checked; () means `n_default` ids spread over [1, L−3]."""
    if not layer_ids:
        return default_layer_ids(num_layers, n_default)
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise DraftsmithError(
            f"{kind} config: layer ids {bad} are out of range; the target has {num_layers} layers "
            f"(ids 0..{num_layers - 1})"
        )
    return tuple(sorted(int(i) for i in layer_ids))


def resolve_block_config(cfg, target: Decoder):
    """Fill the target-dependent defaults (feature layers, mask token) and check ranges."""
    tc = target.config
    ids = resolve_feature_layers(cfg.layer_ids, cfg.num_layers, tc.num_layers, cfg.kind)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else choose_mask_token_id(tc.vocab_size)
    if not 0 <= mask < tc.vocab_size:
        raise DraftsmithError(
            f"{cfg.kind} config: mask_token_id {mask} is outside the target vocabulary [0, {tc.vocab_size})"
        )
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > tc.vocab_size:
        raise DraftsmithError(
            f"{cfg.kind} config: draft_vocab_size {cfg.draft_vocab_size} exceeds the target vocabulary "
            f"{tc.vocab_size}; use at most {tc.vocab_size} (or null for the whole vocabulary)"
        )
    return dataclasses.replace(cfg, layer_ids=ids, mask_token_id=int(mask))


class BlockModel(nn.Module):
    """What the DFlash and DSpark models share: the draft vocabulary, the target features
    the backbone reads, and the packed training forward over sampled anchor blocks."""

    backbone: BlockBackbone

    def init_draft_vocab(self, token_counts: torch.Tensor | Sequence[int]) -> None:
        """Choose the reduced vocabulary from training-data token counts [V] (before training)."""
        self.backbone.set_draft_vocab(token_counts)

    def target_stats(self, final_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The protocol's per-position target statistics (BlockBackbone.target_stats); None when
        the loss does not read the target's distribution (CE only)."""
        c = self.config
        if not (c.tv_weight or c.kl_weight or getattr(c, "conf_weight", 0.0)):
            return None
        return self.backbone.target_stats(final_hidden)

    @property
    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(layer_ids=self.backbone.layer_ids)

    def packed_training_forward(self, batch: TrainBatch, generator: torch.Generator | None,
                                anchor_is_first_prediction: bool) -> tuple[PackedForward, torch.Tensor]:
        """The backbone over this batch's sampled blocks, and the mask [B, A, γ] of trained slots."""
        c = self.config
        anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, c.max_anchors, generator)
        pf = packed_forward(self.backbone, batch, c.block_size, anchor_is_first_prediction, anchors, valid)
        return pf, pf.pack.target_mask
