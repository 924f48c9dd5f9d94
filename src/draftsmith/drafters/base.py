"""The drafter interface: propose, then learn from the verification result.

The engine calls every drafter the same way and never branches on its kind:

    needs            which target features the drafter reads (layer ids, final hidden)
    start(seq)       a request got a cache row (prefill done): set up per-request state
    propose(seqs, max_lengths) -> Proposal
                     at most max_lengths[b] draft tokens for row b (0 allowed), with q when
                     the drafts were sampled (None = deterministic one-hot drafts).
                     A drafter with `gated = True` also takes propose(..., gate=G): the
                     policy's column search (draft_gate), asked column by column; it may stop
                     at the first column G does not open (DSpark: drafters/block_drafter.py)
    on_verified(seqs, proposal, result, features)
                     the committed tokens are in seq.output_ids already; features hold the
                     requested target features for this round's input positions
    release(seq)     the request left: free its state

Per-request state. A drafter keeps what it knows about a request in a small dataclass of
its own, held in a `RequestStates` it owns: created by start(), looked up by propose() and
on_verified(), dropped by release(). Entries are keyed by the engine row the request holds
in between (one request per row at a time, as in the drafter's own KV cache; request ids
may repeat, e.g. client-supplied ones). Sampling drafters subclass `DrafterRequestState`,
whose `drafter_gen` is the request's drafter generator (`drafter_generator`: the request's
seed ^ DRAFT_SEED_SALT — derived from, never shared with, the generator that verifies):

    DraftModelState      drafters/draft_model.py   drafter_gen, base, k (the round's rollback)
    FeatureRequestState  drafters/feature_queue.py drafter_gen, queue (target features not
                                                   yet in the cache; EAGLE-3, DFlash, DSpark)

`Request.drafter_state` (a plain dict) is not the drafter's: it is the draft-length
policy's per-request scratch (policy/*.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, runtime_checkable

import torch

from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.core.request import Request
from draftsmith.core.warp import draw_uniforms, position_uniforms

DRAFT_SEED_SALT = 0x5EED  # drafter generators derive from, and never share, the request's


@dataclass(frozen=True)
class FeatureSpec:
    """Target features a drafter needs from each target forward.

    follows_prefix_cache: the drafter keeps every position's features per engine row, as the KV
    cache keeps keys and values, so a prompt prefix the row still holds needs no recomputing:
    with prefix caching, start() gets only the features of the positions past it
    (data/feature_recorder.py). Drafters that build a context from start()'s features alone
    leave it False, and the engine turns prefix caching off for them.
    reuse_margin: a reused prefix stops this many positions short of the matched one, for a
    drafter whose context position also reads the next token (EAGLE-3: 1; the target then
    recomputes that position and the drafter gets its features again)."""

    layer_ids: tuple[int, ...] = ()
    final_hidden: bool = False
    follows_prefix_cache: bool = False
    reuse_margin: int = 0


@dataclass
class TargetFeatures:
    """Features of one target forward, for the rows that took part.

    hidden:       layer id -> [B, S, H] decoder-layer outputs at the forward's input positions
    final_hidden: [B, S, H] normed last hidden state, or None when not requested
    """

    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    final_hidden: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    name: str
    needs: FeatureSpec

    def start(self, seq: Request, features: TargetFeatures | None) -> None: ...

    def propose(self, seqs: list[Request], max_lengths: list[int]) -> Proposal: ...

    def on_verified(
        self,
        seqs: list[Request],
        proposal: Proposal,
        result: VerifyResult,
        features: TargetFeatures | None,
    ) -> None: ...

    def release(self, seq: Request) -> None: ...


class NoDrafter:
    """Plain decoding through the same path: every round proposes nothing."""

    name = "none"
    needs = FeatureSpec()

    def start(self, seq: Request, features: TargetFeatures | None) -> None:
        pass

    def propose(self, seqs: list[Request], max_lengths: list[int]) -> Proposal:
        return Proposal.empty(len(seqs))

    def on_verified(self, seqs, proposal, result, features) -> None:
        pass

    def release(self, seq: Request) -> None:
        pass


# ---------------------------------------------------------------------------- per-request state


@dataclass
class DrafterRequestState:
    """What every sampling drafter keeps per request: its own generator (None = unseeded)."""

    drafter_gen: torch.Generator | None = None


S = TypeVar("S")


class RequestStates(Generic[S]):
    """A drafter's typed per-request state: one S per started request, keyed by its engine row."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # the drafter's name, for errors
        self._by_row: dict[int, S] = {}

    def start(self, seq: Request, state: S) -> S:
        """Set the state of a request that just got its row (replaces any stale entry)."""
        self._by_row[seq.row] = state
        return state

    def __getitem__(self, seq: Request) -> S:
        try:
            return self._by_row[seq.row]
        except KeyError:
            raise RuntimeError(
                f"drafter {self.owner}: request {seq.request_id!r} (row {seq.row}) was not started"
            ) from None

    def get(self, seq: Request) -> S | None:
        return self._by_row.get(seq.row)

    def release(self, seq: Request) -> S | None:
        """Drop a leaving request's state (None when it had none)."""
        return self._by_row.pop(seq.row, None)

    def __len__(self) -> int:
        return len(self._by_row)


def drafter_generator(seq: Request, device: torch.device) -> torch.Generator | None:
    """The drafter's own per-request generator (None when the request has no seed)."""
    if seq.params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seq.params.seed ^ DRAFT_SEED_SALT)
    return g


def row_uniforms(seqs: Sequence[Request], generators: Sequence[torch.Generator | None], counts: Sequence[int],
                 width: int, device: torch.device) -> torch.Tensor:
    """[B, width] uniforms for the drafts of a round (the rest are 0.5 padding).

    A seeded request's draft k uses the uniform of its output position, len(output_ids) + k:
    the same u_t that verification's position-keyed coupling draws the target's token with
    (core/verify.py), so draft and target token come from one uniform and agree as often as
    their CDFs allow. Other rows draw counts[b] from their drafter generator."""
    u = torch.full((len(seqs), width), 0.5, device=device)
    for b, (s, g, n) in enumerate(zip(seqs, generators, counts)):
        if n and s.params.seed is not None:
            u[b, :n] = position_uniforms(s.params.seed, len(s.output_ids), n, device).to(u.dtype)
        elif n:
            u[b, :n] = draw_uniforms(n, g, device)
    return u


def pad_proposal(drafts: list[list[int]], q: list[torch.Tensor] | None = None) -> Proposal:
    """Right-pad per-row draft lists into a Proposal (q rows are [len_b, V] each)."""
    B = len(drafts)
    K = max((len(d) for d in drafts), default=0)
    tokens = torch.zeros(B, K, dtype=torch.long)
    for b, d in enumerate(drafts):
        if d:
            tokens[b, : len(d)] = torch.tensor(d, dtype=torch.long)
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    q_full = None
    if q is not None and K > 0:
        V = next(x.shape[-1] for x in q if x is not None and x.numel())
        q_full = torch.zeros(B, K, V, dtype=torch.float32)
        for b, qb in enumerate(q):
            if qb is not None and qb.numel():
                q_full[b, : qb.shape[0]] = qb
        # Rows without sampled drafts never read q past their length.
    return Proposal(tokens=tokens, lengths=lengths, q=q_full)
