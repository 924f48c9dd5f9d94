"""The inference drafter of a block model (DFlash / DSpark): one backbone forward per round.

Per engine row, a KVCache of the projected context keys/values of every draft layer; once a
row drafts, its length is the number of committed tokens with target features (=
num_tokens − 1, the engine's invariant). The target features of committed tokens reach it
through the request's feature queue (drafters/feature_queue.py), projected lazily. Each
drafting round is one backbone forward per row batch (drafters/block.py) plus the kind's
sampling stage (`BlockSampler`: DFlash's independent positions, DSpark's sequential stage).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from draftsmith.core.draft_masks import DraftMasks, MaskPool
from draftsmith.core.request import Request
from draftsmith.core.sampling import SamplingParams
from draftsmith.core.types import Proposal
from draftsmith.drafters.base import FeatureSpec, RequestStates, row_uniforms
from draftsmith.drafters.block import BlockBackbone
from draftsmith.drafters.block_step import BlockStep, one_call_reason
from draftsmith.drafters.calibration import STSFit
from draftsmith.drafters.feature_queue import FLUSH_TOKENS, FeatureQueueDrafter, FeatureRequestState
from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import rms_norm_kernel
from draftsmith.models.kv_cache import KVCache
from draftsmith.models.linear import pack_linears_for_inference_, warm_packed_linears_


class BlockSampler(Protocol):
    """The kind-specific part of a block drafter's round (DFlash: independent positions;
    DSpark: the sequential stage and confidences)."""

    def draft(
        self,
        hidden: torch.Tensor,  # [B, n, H] final-normed hidden at the first n drafted positions
        anchors: torch.Tensor,  # [B] anchor ids (x_0)
        params: Sequence[SamplingParams],
        uniforms: torch.Tensor,  # [B, n] one uniform per drafted position
        stop: Callable[[int, torch.Tensor], bool] | None = None,
        masks: DraftMasks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """→ tokens [B, n'], q [B, n', V] (the warped distributions sampled from; one-hot on
        greedy rows; None when every row is greedy: the proposal then carries no q),
        confidence logits [B, n'] or None. n' = n unless a sampler with confidences is given
        `stop`: it calls stop(k, confidence logits of draft k + 1 [B]) before drafting position
        k and, on True, returns the k positions drafted so far (n' = k). `masks`: draft left to
        right under each row's grammar (core/draft_masks.py; n' < n once every row has ended)."""
        ...


class DraftGate(Protocol):
    """The policy's column-by-column decision (policy/prefix_scheduler.py, ColumnSearch)."""

    def open_next(self, column: Sequence[float | None]) -> bool: ...


class BlockDrafter(FeatureQueueDrafter):
    """Inference drafter for a block model (DFlash / DSpark): one backbone forward per round.

    State per engine row: `cache` holds projected context K/V of every draft layer at
    positions 0 .. num_tokens − 2; per request, `states` keeps a `FeatureRequestState` (the
    request's `drafter_gen` and its queued target features). `temperatures` (STS, from
    calibration.json) rescale the confidence logits of the rows of the fit's sampling regime
    (greedy or sampled); other rows keep them raw.
    """

    # A context position is that position's features projected (no other token, no other
    # position), so a row's context follows the engine's prefix cache (feature_queue.py).
    follows_prefix_cache = True
    # rows with a grammar draft under it (core/draft_masks.py); False: unconstrained drafts,
    # cut at the first refused one by the engine (a benchmark's baseline)
    grammar_masks = True

    def __init__(
        self,
        name: str,
        backbone: BlockBackbone,
        sampler: BlockSampler,
        gamma: int,
        anchor_is_first_prediction: bool,
        max_rows: int,
        max_len: int,
        temperatures: STSFit | None = None,
    ) -> None:
        self.name = name
        self.backbone = backbone
        self.sampler = sampler
        self.gamma = int(gamma)
        self.n_in = self.gamma if anchor_is_first_prediction else self.gamma + 1
        self.offset = 0 if anchor_is_first_prediction else 1
        self.needs = FeatureSpec(layer_ids=backbone.layer_ids, follows_prefix_cache=self.follows_prefix_cache)
        self.feature_layers = backbone.layer_ids
        # inference through prepacked weights; the modules still train as before (models/linear.py)
        pack_linears_for_inference_(backbone)
        if isinstance(sampler, torch.nn.Module):
            pack_linears_for_inference_(sampler)
            warm_packed_linears_(sampler)
        warm_packed_linears_(backbone)  # laid out now, not in the first round (see the policy's draft cost)
        with torch.inference_mode():
            backbone.draft_logits(backbone.fc.weight.new_zeros(1, backbone.cfg.hidden_size))  # its draft-vocabulary rows
        self.sts = temperatures
        self.flush_tokens = FLUSH_TOKENS
        self.states: RequestStates[FeatureRequestState] = RequestStates(name)
        self.mask_pool = MaskPool()
        c = backbone.cfg
        self.device = backbone.fc.weight.device
        self.cache = KVCache(c.num_layers, max_rows, c.num_kv_heads, max_len, c.head_dim,
                             dtype=backbone.dtype, device=self.device)
        # the draft layers as one kernel call each where the CPU kernels run them (block_step.py)
        self.step: BlockStep | None = BlockStep(backbone) if one_call_reason(backbone) is None else None

    # -- context cache

    def _consume(self, rows: list[Request], hidden: dict[int, torch.Tensor], counts: list[int]) -> None:
        self._append([s.row for s in rows], self.backbone.features(hidden), counts)

    @torch.inference_mode()
    def _append(self, rows: list[int], feats: torch.Tensor, counts: list[int]) -> None:
        """Project features [B, S, mH] and store the first counts[b] positions of row b."""
        if not rows or max(counts) == 0:
            return
        S = max(counts)
        feats = feats[:, :S]
        starts = self.cache.lengths[rows]  # [B]
        for r, n in zip(rows, counts):
            if int(self.cache.lengths[r]) + n > self.cache.max_len:
                raise DraftsmithError(f"drafter context for row {r} would exceed {self.cache.max_len} tokens")
        pos = (starts[:, None] + torch.arange(S)[None, :]).to(self.device)
        norm = rms_norm_kernel if self.step is not None else None  # the CPU kernels run this backbone
        bb = self.backbone
        kvs = bb.context_kv(bb.context(feats.to(self.device, bb.dtype), norm), pos, norm)
        for layer, (k, v) in enumerate(kvs):
            kc, vc = self.cache.k[layer], self.cache.v[layer]
            for b, (r, n) in enumerate(zip(rows, counts)):
                s0 = int(starts[b])
                kc[r, :, s0 : s0 + n] = k[b, :, :n]
                vc[r, :, s0 : s0 + n] = v[b, :, :n]
        for r, n in zip(rows, counts):
            self.cache.lengths[r] += n

    # -- one round

    gated = True  # propose() takes the policy's draft gate (engine._round)

    @torch.inference_mode()
    def propose(self, seqs: list[Request], max_lengths: list[int], gate: DraftGate | None = None) -> Proposal:
        """Up to min(max_lengths[b], γ) drafts per row; with a `gate`, a sampler with
        confidences stops at the first column the gate does not open (fewer columns, the same
        verify lengths)."""
        active = [i for i, k in enumerate(max_lengths) if k > 0]
        if not active:
            return Proposal.empty(len(seqs))
        act = [seqs[i] for i in active]
        self._flush(act)
        caps = [min(max_lengths[i], self.gamma) for i in active]
        n = max(caps)
        rows = torch.tensor([s.row for s in act])
        ctx_len = self.cache.lengths[rows]  # [B']
        for s, c in zip(act, ctx_len.tolist()):
            if c != s.num_tokens - 1:
                raise RuntimeError(
                    f"drafter {self.name}: row {s.row} has context for {c} tokens, expected "
                    f"{s.num_tokens - 1} (the engine's feature invariant is broken)"
                )
        dev = self.device
        L = int(ctx_len.max())
        anchors = torch.tensor([s.all_ids[-1] for s in act], dtype=torch.long, device=dev)  # [B']
        ids = self.backbone.block_inputs(anchors[:, None], self.n_in)  # [B', 1, n_in]
        row0 = act[0].row
        if self.step is not None and L + self.n_in <= self.cache.max_len:
            if int(ctx_len.min()) == L and [s.row for s in act] == list(range(row0, row0 + len(act))):
                # one run of cache rows at one context length: one kernel call per draft layer
                h = self.step.forward(ids[:, 0], row0, L, self.cache.k, self.cache.v)  # [B', n_in, H]
            else:  # rows anywhere, of any lengths: the same layers op by op, every row over its own keys
                h = self.step.forward_rows(ids[:, 0], rows, ctx_len, self.cache.k, self.cache.v)
        else:
            ctx_kv = [(self.cache.k[i][rows, :, :L], self.cache.v[i][rows, :, :L]) for i in range(len(self.cache.k))]
            ctx_len_d = ctx_len.to(dev)
            ctx_mask = (torch.arange(L, device=dev)[None, :] < ctx_len_d[:, None])[:, None, :]  # [B', 1, L]
            pos = ctx_len_d[:, None, None] + torch.arange(self.n_in, device=dev)  # anchor at index ctx_len
            h = self.backbone.blocks(ids, pos, ctx_kv, ctx_mask)[:, 0]  # [B', n_in, H]
        h = h[:, self.offset : self.offset + n]  # [B', n, H]
        u = row_uniforms(act, [self.states[s].drafter_gen for s in act], caps, n, dev)
        params = [s.params for s in act]
        temps = self._row_temperatures(params)
        masks = DraftMasks.of(act, self.backbone.head.vocab_size, self.backbone.draft_ids, self.mask_pool, caps) \
            if self.grammar_masks else None
        stop = None
        if gate is not None:
            def stop(k: int, z: torch.Tensor) -> bool:
                c = self._confidences(z, k, temps).tolist()
                column: list[float | None] = [None] * len(seqs)
                for b, i in enumerate(active):
                    if caps[b] > k and not (masks is not None and masks.ended[b]):
                        column[i] = c[b]
                return not gate.open_next(column)
        try:
            if stop is None and masks is None:
                tokens, q, conf_logits = self.sampler.draft(h, anchors, params, u)
            else:  # (a sampler without confidences or grammar support is never given either)
                tokens, q, conf_logits = self.sampler.draft(h, anchors, params, u, stop,
                                                            **({} if masks is None else {"masks": masks}))
        finally:
            if masks is not None:
                masks.release()
        caps = [min(c, tokens.shape[1]) for c in caps]  # a stopped sampler drafted fewer columns
        if masks is not None:  # a row ended under its grammar keeps only its drafts before that
            caps = [masks.limit(b, c) for b, c in enumerate(caps)]
        return self._assemble(len(seqs), active, caps, tokens, q, conf_logits, params, temps)

    @property
    def temperatures(self) -> tuple[float, ...] | None:
        """The STS temperatures (of the fit's regime: `sts`), or None."""
        return None if self.sts is None else self.sts.temperatures

    def _row_temperatures(self, params) -> torch.Tensor | None:
        """[B', γ] STS temperatures per drafting row (1 for a row outside the fit's regime, and past
        the fitted positions), or None when no row gets any."""
        fit = self.sts
        use = [fit is not None and fit.applies_to(p.greedy) for p in params]
        if not any(use):
            return None
        ts = list(fit.temperatures[: self.gamma]) + [1.0] * max(0, self.gamma - len(fit.temperatures))
        return torch.tensor([ts if u else [1.0] * self.gamma for u in use], dtype=torch.float32)

    @staticmethod
    def _confidences(z: torch.Tensor, k: int, temps: torch.Tensor | None) -> torch.Tensor:
        """Confidence logits of draft k + 1 of each drafting row [B'] → calibrated confidences
        (the row's STS temperature t_{k+1}: `_row_temperatures`), float32 on the CPU: what the
        proposal carries."""
        z = z.float().cpu()
        if temps is not None:
            z = z / temps[:, k]
        return torch.sigmoid(z)

    def _assemble(self, B, active, caps, tokens, q, conf_logits, params, temps) -> Proposal:
        K = max(caps)
        if K == 0:  # the gate opened no column
            return Proposal.empty(B)
        tokens = tokens[:, :K]  # (columns past every row's cap: drafted after each grammar ended)
        q = q[:, :K] if q is not None else None
        conf_logits = conf_logits[:, :K] if conf_logits is not None else None
        out_tokens = torch.zeros(B, K, dtype=torch.long)
        lengths = torch.zeros(B, dtype=torch.long)
        idx = torch.tensor(active)
        out_tokens[idx] = tokens.cpu()
        lengths[idx] = torch.tensor(caps)
        keep = torch.arange(K)[None, :] < lengths[:, None]
        out_tokens = out_tokens.masked_fill(~keep, 0)
        q_full = None
        if not all(p.greedy for p in params):
            q_full = torch.zeros(B, K, q.shape[-1], dtype=torch.float32, device=q.device)
            q_full[idx.to(q.device)] = q.float()
        conf = None
        if conf_logits is not None and K:
            conf = torch.zeros(B, K, dtype=torch.float32)
            z = conf_logits.float().cpu()  # (one copy; the arithmetic of _confidences, all columns at once)
            conf[idx] = torch.sigmoid(z if temps is None else z / temps[:, :K])
            conf = conf.masked_fill(~keep, 0.0)
        return Proposal(tokens=out_tokens, lengths=lengths, q=q_full, confidences=conf)
