"""The per-request feature queue holds what it counts: its bounds (FLUSH_TOKENS, QUEUE_BYTES)
bound memory only if a queued slice does not keep the whole round's tensor alive."""

from __future__ import annotations

import torch

from draftsmith.drafters.base import TargetFeatures
from draftsmith.drafters.feature_queue import QueuedFeatures


def _held(q: QueuedFeatures) -> int:
    """Bytes of the storages the queue's tensors keep alive (each storage once)."""
    parts = ([] if q.prefill is None else list(q.prefill.values())) + [h for r in q.rounds for h in r.values()]
    storages = {h.untyped_storage().data_ptr(): h.untyped_storage().nbytes() for h in parts}
    return sum(storages.values())


def test_queued_slices_hold_only_their_own_bytes():
    B, S, H = 32, 8, 16
    q = QueuedFeatures()
    rounds = []
    for r in range(5):
        feats = {i: torch.randn(B, S, H) for i in (1, 14)}  # one round's features, every row
        rounds.append(feats)
        q.push({i: h[3, : r % 3 + 1] for i, h in feats.items()})  # row 3 commits 1-3 positions
    assert q.count() == sum(r % 3 + 1 for r in range(5))
    assert q.bytes == q.count() * H * 4 * 2
    assert _held(q) == q.bytes  # a view would keep B * S positions alive per round
    got = q.take()
    want = {i: torch.cat([f[i][3, : r % 3 + 1] for r, f in enumerate(rounds)]) for i in (1, 14)}
    assert set(got) == {1, 14} and all(torch.equal(got[i], want[i]) for i in got)
    assert q.count() == 0 and q.bytes == 0 and q.take() is None


def test_prompt_features_from_a_batched_prefill_are_copied_out_of_the_padding():
    padded = {i: torch.randn(4, 50, 8) for i in (1, 14)}  # a batched prefill, padded to 50 tokens
    q = QueuedFeatures.of_prompt(TargetFeatures(hidden={i: h[2:3, :7] for i, h in padded.items()}))
    assert q.count() == 7 and q.bytes == 7 * 8 * 4 * 2 and _held(q) == q.bytes
    assert torch.equal(q.take()[14], padded[14][2, :7])
    whole = {i: torch.randn(1, 7, 8) for i in (1, 14)}  # a tensor that is all its storage is kept as is
    q = QueuedFeatures.of_prompt(TargetFeatures(hidden=whole))
    assert all(q.prefill[i] is whole[i] for i in whole)
