"""An independent draft model (Leviathan et al. 2023): a smaller LM with the target's tokenizer.

The draft runs autoregressively on its own KV cache (same row as the target's), sampling
each draft token from q = the draft's logits warped with the request's own sampling
parameters; q travels with the proposal so the verifier's ratio test is exact. At
temperature 0 drafts are greedy and q is one-hot (Proposal.q = None).

Cache bookkeeping: `draft_len` = tokens of all_ids whose KV is valid in the draft cache.
A round starting with n known tokens writes KV for all_ids[draft_len:n] and for drafts
d1..d(K-1); after verification with m accepted, the valid prefix is n + min(m, K-1).
Per request (`DraftModelState`): the drafter generator and that round's n (`base`) and K (`k`).

A round's catch-up feed is drafting work when it is the last round's commits (the bonus token, and
the last draft when all were accepted), but a backlog when it is a prompt or the commits of rounds
that did not draft: like the feature-fed drafters (drafters/feature_queue.py), a feed with a row
past STEADY_TOKENS counts in `consumed_s` / `consumed_positions`, which the engine keeps out of the
drafting time the prefix scheduler learns, and `backlog_positions` tells the scheduler what a probe
would consume first. (Without it the first round's drafting time held the whole prompt's prefill
through the draft model: on a 2-core Zen 4 the Qwen2.5-Coder 0.5B drafting for the 1.5B then looked
too dear to draft or probe, and the default policy never verified a draft: tau 1.00, stop 63.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.core.draft_masks import DraftMasks, MaskPool
from draftsmith.core.types import Proposal
from draftsmith.core.warp import argmax_rows, inverse_cdf, position_uniforms, sample_from, target_probs
from draftsmith.drafters.base import (
    DrafterRequestState, FeatureSpec, RequestStates, TargetFeatures, drafter_generator, pad_proposal,
)
from draftsmith.drafters.feature_queue import backlog, consuming
from draftsmith.core.request import Request
from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import Decoder
from draftsmith.models.kv_cache import KVCache


@dataclass
class DraftModelState(DrafterRequestState):
    """Per request: `drafter_gen`, and the last drafting round's rollback point."""

    base: int = 0  # num_tokens when that round drafted
    k: int = 0  # drafts that round proposed; 0 = nothing to roll back


class DraftModelDrafter:
    name = "draft-model"
    needs = FeatureSpec()
    grammar_masks = True  # rows with a grammar draft under it (core/draft_masks.py)

    def __init__(self, model: Decoder, target_vocab_size: int, max_rows: int, max_len: int) -> None:
        if model.config.vocab_size != target_vocab_size:
            raise DraftsmithError(
                f"draft model vocabulary ({model.config.vocab_size}) differs from the target's "
                f"({target_vocab_size}); a draft model must share the target's tokenizer"
            )
        self.model = model
        self.cache: KVCache = model.new_cache(max_rows, max_len)
        self.states: RequestStates[DraftModelState] = RequestStates(self.name)
        self.mask_pool = MaskPool()
        self.consumed_s = 0.0  # wall seconds of catch-up feeds that were a backlog, cumulative (the engine reads it)
        self.consumed_positions = 0  # the positions those feeds ran, cumulative (the cost model's rate)

    def backlog_positions(self, seqs: list[Request]) -> int:
        """The backlog a round that drafts all these rows feeds first (counted in `consumed_positions`
        then): what the prefix scheduler prices a probe with."""
        return backlog([s.num_tokens - int(self.cache.lengths[s.row]) for s in seqs])

    def start(self, seq: Request, features: TargetFeatures | None) -> None:
        self.cache.reset(seq.row)
        self.states.start(seq, DraftModelState(drafter_gen=drafter_generator(seq, self.model.device)))

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
            st = self.states[seqs[i]]
            st.base = seqs[i].num_tokens  # (st.k: the drafts kept, set below)
        # First pass catches the draft cache up with everything committed since last round.
        idx = active
        feeds = [seqs[i].all_ids[int(self.cache.lengths[seqs[i].row]) :] for i in idx]
        for i, f in zip(idx, feeds):
            if not f:  # the cache holds more than was committed: a rollback was missed
                raise RuntimeError(
                    f"draft model: row {seqs[i].row} caches {int(self.cache.lengths[seqs[i].row])} tokens but "
                    f"request {seqs[i].request_id!r} has committed only {seqs[i].num_tokens} (the drafter's "
                    "rollback invariant is broken)")
        with consuming(self, backlog([len(f) for f in feeds]), self.model.device):
            logits = self._forward_last([seqs[i] for i in idx], feeds)  # [B', V]
        masks = DraftMasks.of([seqs[i] for i in active], logits.shape[-1], pool=self.mask_pool,
                              caps=[max_lengths[i] for i in active]) if self.grammar_masks else None
        try:
            self._draft(seqs, idx, logits, max_lengths, drafts, step_q, masks)
        finally:
            if masks is not None:
                masks.release()
        if masks is not None:  # a row ended under its grammar keeps only its drafts before that
            for j, i in enumerate(active):
                n = masks.limit(j, len(drafts[i]))
                drafts[i], step_q[i] = drafts[i][:n], step_q[i][:n]
        for i in active:  # what the cache holds past `base`: drafts 1 .. k - 1
            self.states[seqs[i]].k = len(drafts[i])
        if all(seqs[i].params.greedy for i in active):
            return pad_proposal(drafts)  # deterministic drafts: one-hot q, never materialised
        qs: list[torch.Tensor | None] = [torch.stack(step_q[i]) if step_q.get(i) else None for i in range(len(seqs))]
        return pad_proposal(drafts, qs)

    def _draft(self, seqs, idx, logits, max_lengths, drafts, step_q, masks: DraftMasks | None) -> None:
        """The drafting loop of `propose` from the first logits: appends to drafts[i] / step_q[i]."""
        col = {i: j for j, i in enumerate(idx)}  # row i's index among the masks' rows
        all_greedy = all(seqs[i].params.greedy for i in idx)
        while True:
            if masks is not None:
                logits = masks.restrict(logits, [col[i] for i in idx])
            if all_greedy:  # each row's argmax (what the one-hot q below would pick); no q to keep
                for i, tok in zip(idx, argmax_rows(logits.float()).tolist()):
                    drafts[i].append(tok)
            else:
                # q is the draft distribution actually sampled from (one-hot when greedy).
                q = target_probs(logits[:, None, :], [seqs[i].params for i in idx])[:, 0]  # [B', V]
                for j, i in enumerate(idx):
                    s = seqs[i]
                    if s.params.greedy:
                        tok = int(torch.argmax(q[j]))
                    elif s.params.seed is not None:  # the position's uniform, as verification couples it
                        u = position_uniforms(s.params.seed, len(s.output_ids) + len(drafts[i]), 1, q.device)
                        tok = int(inverse_cdf(q[j][None], u.to(q.dtype))[0])
                    else:
                        tok = int(sample_from(q[j], self.states[s].drafter_gen))
                    drafts[i].append(tok)
                    step_q[i].append(q[j])
            if masks is not None:
                masks.consume([drafts[i][-1] for i in idx], [col[i] for i in idx])
            idx = [i for i in idx if len(drafts[i]) < max_lengths[i] and not (masks is not None and masks.ended[col[i]])]
            if not idx:
                break
            logits = self._forward_last([seqs[i] for i in idx], [[drafts[i][-1]] for i in idx])

    def on_verified(self, seqs, proposal, result, features) -> None:
        for b, s in enumerate(seqs):
            st = self.states[s]
            if st.k == 0:
                continue
            m = int(result.num_accepted[b])
            self.cache.lengths[s.row] = st.base + min(m, st.k - 1)
            st.k = 0

    def release(self, seq: Request) -> None:
        self.states.release(seq)
        if seq.row >= 0:
            self.cache.reset(seq.row)
