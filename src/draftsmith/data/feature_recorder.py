"""The target's features recorded while it regenerates: `draftsmith regen --features-out DIR`
writes the feature cache `draftsmith cache` would, without a second pass over every token.

`FeatureRecorder` is plain decoding (it proposes nothing) that asks the engine for the cache's
layers and the final hidden state of every target forward and keeps them per engine row, at the
positions where the KV cache keeps that row's keys and values: a prefill's positions, then the
token each decode round feeds. With prefix caching, a conversation's next turn starts in the row
that holds the turns so far, finds their features still there, and computes only the new ones:
every token's features are computed once per conversation, by the forward that generated it.

A conversation's last tokens (its final end-of-turn token and the template's closing text) are
never fed while the target answers. The regen backend feeds them with one more request, the
"tail" (the whole conversation as its prompt, one token to generate, which is dropped), marked
with `want(request_id)`; when it leaves, the recorder keeps the features of all its prompt's
positions for `take(request_id)`.

What is recorded equals what `draftsmith cache` computes up to float summation order (a decode
step adds in a different order than a long prefill), well inside the storage dtype's rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.core.request import Request
from draftsmith.drafters.base import FeatureSpec, NoDrafter, TargetFeatures


class FeatureRecorder(NoDrafter):
    """Plain decoding that records the target's features of every fed position, per row.

    layer_ids: the decoder layers to keep (the cache's), besides the final hidden state.
    max_len:   the engine's row length (a row's record never grows past it).
    dtype:     what the record is kept in (the cache's storage dtype)."""

    name = "feature-recorder"

    def __init__(self, layer_ids: Sequence[int], max_len: int, dtype: torch.dtype = torch.float16) -> None:
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.needs = FeatureSpec(layer_ids=self.layer_ids, final_hidden=True, follows_prefix_cache=True)
        self.max_len = int(max_len)
        self.dtype = dtype
        self._record: dict[int, torch.Tensor] = {}  # row -> [capacity, len(layer_ids) + 1, H]
        self._length: dict[int, int] = {}  # row -> positions its record holds (like KVCache.lengths)
        self._wanted: set[str] = set()
        self._taken: dict[str, torch.Tensor] = {}

    # ---- what the regen backend asks --------------------------------------------------

    def want(self, request_id: str) -> None:
        """Keep the features of `request_id`'s whole prompt when it leaves (its last round must
        have fed the prompt's last token: a request that generates at least one token)."""
        self._wanted.add(request_id)

    def take(self, request_id: str) -> tuple[dict[int, torch.Tensor], torch.Tensor] | None:
        """({layer id: [T, H]}, final hidden [T, H]) of a wanted request that left, T = its
        prompt's length; None if it has not left (or was not wanted)."""
        rec = self._taken.pop(request_id, None)
        if rec is None:
            return None
        return {i: rec[:, k] for k, i in enumerate(self.layer_ids)}, rec[:, -1]

    # ---- the drafter interface (the engine calls these) ---------------------------------

    def start(self, seq: Request, features: TargetFeatures | None) -> None:
        reused = int(seq.stats.cached_tokens)  # the prefix the row kept: its features are still here
        have = self._length.get(seq.row, 0)
        if reused > have:
            raise RuntimeError(f"row {seq.row} reuses {reused} positions, but the feature record holds {have} "
                               "(a KV cache shared with another engine?)")
        self._length[seq.row] = reused
        if features is not None:
            self._write(seq.row, features, 0, int(features.final_hidden.shape[1]))

    def on_verified(self, seqs, proposal, result, features: TargetFeatures | None) -> None:
        if features is None:
            raise RuntimeError("the feature recorder got no target features from a round")
        for b, s in enumerate(seqs):  # the fed token + accepted drafts: what the KV cache committed
            self._write(s.row, features, b, 1 + int(result.num_accepted[b]))

    def release(self, seq: Request) -> None:
        # The record stays with the row (a later request may reuse its prefix); a wanted request's
        # features are copied out now, before another request can take the row.
        if seq.request_id not in self._wanted:
            return
        self._wanted.discard(seq.request_id)
        n = len(seq.prompt_ids)
        if self._length.get(seq.row, 0) < n:
            raise RuntimeError(f"request {seq.request_id!r} left before its prompt's {n} positions were fed")
        self._taken[seq.request_id] = self._record[seq.row][:n].clone()

    # ---- the record -------------------------------------------------------------------

    def _write(self, row: int, f: TargetFeatures, b: int, n: int) -> None:
        pos = self._length.get(row, 0)
        x = torch.stack([f.hidden[i][b, :n] for i in self.layer_ids] + [f.final_hidden[b, :n]], dim=1)
        buf = self._record.get(row)
        need = pos + n
        if buf is None or buf.shape[0] < need:  # grow by doubling, up to the row's length
            cap = min(max(need, 256, 2 * (0 if buf is None else buf.shape[0])), max(self.max_len, need))
            grown = torch.empty(cap, x.shape[1], x.shape[2], dtype=self.dtype)
            if buf is not None and pos:
                grown[:pos] = buf[:pos]
            buf = self._record[row] = grown
        buf[pos:need] = x.to("cpu", self.dtype)
        self._length[row] = need
