"""What a trained drafter (EAGLE-3, DFlash, DSpark) takes from its target, and how its own
weights start.

- `TargetHead`: the target's token embedding and lm_head, frozen and shared by reference
  (never trained, never saved with the drafter);
- `concat_features`: the target hidden states a drafter reads, concatenated in its layer order;
- `init_linear_`: HF-style initialisation of the drafter's own (trained) modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import Decoder, RMSNorm


@dataclass(frozen=True)
class TargetHead:
    """The target's frozen token embedding and lm_head, shared by reference (detached:
    no gradient ever reaches them, and they are not module parameters, so never saved)."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    # 16-bit copies of lm_head for autocast training (a frozen tensor is not in autocast's
    # weight cache, so it would be cast again at every call): dtype -> (version, copy)
    _cast: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(target: Decoder) -> "TargetHead":
        return TargetHead(target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach())

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    def embed_ids(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids.to(self.embed.device), self.embed).to(dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] → float32 target-vocabulary logits [..., V] (under autocast: in its dtype)."""
        return F.linear(h.to(self.lm_head.dtype), self.autocast_weight(self.lm_head)).float()

    def autocast_weight(self, w: torch.Tensor) -> torch.Tensor:
        """`w` (a frozen tensor of this head) as autocast would cast it, cast once and kept
        while autocast is on; `w` itself otherwise."""
        dev = w.device.type
        if not torch.is_autocast_enabled(dev):
            return w
        dt = torch.get_autocast_dtype(dev)
        key = (dt, w.data_ptr(), tuple(w.shape))
        try:
            version = w._version
        except RuntimeError:  # an inference tensor: never changed in place
            version = None
        hit = self._cast.get(key)
        if hit is None or hit[0] != version:
            hit = (version, w.detach().to(dt))
            self._cast[key] = hit
        return hit[1]


def concat_features(hidden: dict[int, torch.Tensor], layer_ids: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """layer id → [B, T, H] → concatenated [B, T, mH] in `layer_ids` order, as `dtype`."""
    missing = [i for i in layer_ids if i not in hidden]
    if missing:
        raise DraftsmithError(f"target features lack layers {missing}; the drafter reads {list(layer_ids)}")
    xs = [hidden[i] for i in layer_ids]
    # Features made under torch.inference_mode cannot be saved for backward: copy them.
    xs = [x.clone() if x.is_inference() and torch.is_grad_enabled() else x for x in xs]
    return torch.cat(xs, dim=-1).to(dtype)


def init_linear_(module: nn.Module, std: float = 0.02) -> None:
    """HF-style init for a fresh drafter: N(0, std) weights, zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
