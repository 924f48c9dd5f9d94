"""An independent draft model (Leviathan et al. 2023): a smaller LM with the target's tokenizer.

The draft runs autoregressively on its own KV cache (same row as the target's), sampling
each draft token from q = the draft's logits warped with the request's own sampling
parameters; q travels with the proposal so the verifier's ratio test is exact. At
temperature 0 drafts are greedy and q is one-hot (Proposal.q = None).

Cache bookkeeping: `draft_len` = tokens of all_ids whose KV is valid in the draft cache.
A round starting with n known tokens writes KV for all_ids[draft_len:n] and for drafts
d1..d(K-1); after verification with m accepted, the valid prefix is n + min(m, K-1).
"""

from __future__ import annotations

import torch

from draftsmith.core.types import Proposal
from draftsmith.core.warp import sample_from, target_probs
from draftsmith.drafters.base import FeatureSpec, TargetFeatures, pad_proposal
from draftsmith.core.request import Request
from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import Decoder
from draftsmith.models.kv_cache import KVCache

_DRAFT_SEED_SALT = 0x5EED  # the draft's generator is derived from, not shared with, the request's


class DraftModelDrafter:
    name = "draft-model"
    needs = FeatureSpec()

    def __init__(self, model: Decoder, target_vocab_size: int, max_rows: int, max_len: int) -> None:
        if model.config.vocab_size != target_vocab_size:
            raise DraftsmithError(
                f"draft model vocabulary ({model.config.vocab_size}) differs from the target's "
                f"({target_vocab_size}); a draft model must share the target's tokenizer"
            )
        self.model = model
        self.cache: KVCache = model.new_cache(max_rows, max_len)

    def start(self, seq: Request, features: TargetFeatures | None) -> None:
        self.cache.reset(seq.row)
        gen = None
        if seq.params.seed is not None:
            gen = torch.Generator(device=self.model.device)
            gen.manual_seed(seq.params.seed ^ _DRAFT_SEED_SALT)
        seq.drafter_state["draft_gen"] = gen
        seq.drafter_state["draft_base"] = 0
        seq.drafter_state["draft_k"] = 0

    def _forward_last(self, seqs: list[Request], feeds: list[list[int]]) -> torch.Tensor:
        """Run each row's feed tokens; return logits at each row's last fed token [B, V]."""
        S = max(len(f) for f in feeds)
        ids = torch.zeros(len(seqs), S, dtype=torch.long)
        for b, f in enumerate(feeds):
            ids[b, : len(f)] = torch.tensor(f)
        rows = torch.tensor([s.row for s in seqs])
        last = torch.tensor([[len(f) - 1] for f in feeds])
        out = self.model(ids, self.cache, rows=rows, logit_index=last)
        for s, f in zip(seqs, feeds):
            self.cache.lengths[s.row] += len(f)
        return out.logits[:, 0]  # [B, V]

    def propose(self, seqs: list[Request], max_lengths: list[int]) -> Proposal:
        active = [i for i, k in enumerate(max_lengths) if k > 0]
        if not active:
            return Proposal.empty(len(seqs))
        drafts: list[list[int]] = [[] for _ in seqs]
        step_q: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for i in active:
            seqs[i].drafter_state["draft_base"] = seqs[i].num_tokens
            seqs[i].drafter_state["draft_k"] = max_lengths[i]
        # First pass catches the draft cache up with everything committed since last round.
        idx = active
        feeds = [seqs[i].all_ids[int(self.cache.lengths[seqs[i].row]) :] for i in idx]
        logits = self._forward_last([seqs[i] for i in idx], feeds)  # [B', V]
        while True:
            # q is the draft distribution actually sampled from (one-hot when greedy).
            q = target_probs(logits[:, None, :], [seqs[i].params for i in idx])[:, 0]  # [B', V]
            for j, i in enumerate(idx):
                s = seqs[i]
                tok = int(torch.argmax(q[j])) if s.params.greedy else sample_from(q[j], s.drafter_state["draft_gen"])
                drafts[i].append(tok)
                step_q[i].append(q[j])
            idx = [i for i in idx if len(drafts[i]) < max_lengths[i]]
            if not idx:
                break
            logits = self._forward_last([seqs[i] for i in idx], [[drafts[i][-1]] for i in idx])
        if all(seqs[i].params.greedy for i in active):
            return pad_proposal(drafts)  # deterministic drafts: one-hot q, never materialised
        qs: list[torch.Tensor | None] = [torch.stack(step_q[i]) if i in step_q else None for i in range(len(seqs))]
        return pad_proposal(drafts, qs)

    def on_verified(self, seqs, proposal, result, features) -> None:
        for b, s in enumerate(seqs):
            k = s.drafter_state.get("draft_k", 0)
            if k == 0:
                continue
            m = int(result.num_accepted[b])
            self.cache.lengths[s.row] = s.drafter_state["draft_base"] + min(m, k - 1)
            s.drafter_state["draft_k"] = 0

    def release(self, seq: Request) -> None:
        if seq.row >= 0:
            self.cache.reset(seq.row)
