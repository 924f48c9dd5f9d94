"""Drafts from a request's grammar: tokens it forces are drafted for free, drafts it refuses
are not verified.

- Forced drafts (jump-forward, verified): where the grammar allows only one continuation for
  the next bytes (a JSON key after its opening quote, the literal text of a regex), llguidance
  gives those bytes' canonical tokens (`compute_ff_tokens`). They become the row's draft for
  the round, in place of the drafter's: the target verifies them like any deterministic draft,
  so the output law is unchanged whatever the grammar engine's mask allows there, and a run of
  n forced tokens is committed in one forward of 1 + n positions instead of n + 1 forwards
  (llguidance 1.9's mask allows only those canonical tokens where it forces bytes, so they are
  accepted whenever the engine masks with it).
- Refused drafts: a draft the grammar refuses has target probability 0 under the mask, so it
  is rejected for certain and nothing after it is ever reached. Those positions are cut from
  the verify block before the forward. The first refused draft itself is cut only where the
  row's drafts are deterministic: a rejected one-hot draft leaves the residual max(p - q, 0),
  which is p itself when p gives the draft 0; a sampled draft (q given) stays, so its rejection
  samples the residual its law needs.

Both read the matcher at the committed output and leave it there (validate_tokens and
compute_ff_tokens do not consume).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from draftsmith.core.types import Proposal


def forced_drafts(seqs: Sequence, caps: Sequence[int]) -> list[list[int]]:
    """Per row, the tokens its grammar forces next, at most caps[b] ([] for rows without a
    grammar, with nothing forced, or a cap of 0)."""
    out: list[list[int]] = []
    for s, cap in zip(seqs, caps):
        m = getattr(s, "grammar", None)
        if m is None or cap <= 0 or m.is_stopped():
            out.append([])
            continue
        out.append(list(m.compute_ff_tokens())[:cap])
    return out


def forced_widths(kept: Sequence[int], forced: Sequence[int], cost: Callable[[int, int], float],
                  prefer_wider: bool = False) -> list[int]:
    """How many of each row's forced drafts to verify beside the kept drafts: the block width W
    (at least the kept drafts' own; or none of them) with the most tokens per second, forced drafts
    counted as certain and kept drafts as if all accepted. `cost(W, drafts)`: seconds of a forward
    W wide holding that many drafts; `prefer_wider`: ties go to the wider."""
    if not kept:
        return []
    n0 = sum(kept)
    w0, tokens = 1 + max(kept, default=0), float(len(kept) + n0)
    best, best_w = tokens / cost(w0, n0), 1  # no forced drafts
    for w in range(w0, 2 + max(forced, default=0)):
        f = sum(min(n, w - 1) for n in forced)
        rate = (tokens + f) / cost(w, n0 + f)
        if rate > best or (prefer_wider and rate == best):
            best, best_w = rate, w
    return [min(n, best_w - 1) for n in forced]


def fit_forced(rows: int, kept: Sequence[int], forced: Sequence[int]) -> list[int]:
    """forced_widths where no cost model is known: as if a forward cost time in proportion to its
    padded tokens (rows x W, the most a wider forward can cost; ties go to the wider). At batch 1
    that is every forced draft; on a batch it widens only where the forced runs fill the extra
    columns, so a forward is never made slower than the tokens it adds."""
    return forced_widths(kept, forced, lambda w, n: rows * w, prefer_wider=True)


def grammar_lengths(seqs: Sequence, proposal: Proposal, eos_token_ids: Collection[int]) -> list[int]:
    """Per row, how many of its drafts to verify: up to the first one its grammar refuses
    (that one included where the proposal's drafts were sampled, q given). Rows without a
    grammar keep all of theirs."""
    lengths = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
    if not proposal.max_len:
        return lengths
    tokens = proposal.tokens.tolist()
    out = []
    for s, row, n in zip(seqs, tokens, lengths):
        m = getattr(s, "grammar", None)
        if m is None or n == 0:
            out.append(n)
            continue
        drafts = row[:n]
        if m.is_stopped():  # only EOS may follow, and validate_tokens counts none there (llguidance 1.9)
            valid = 1 if drafts[0] in eos_token_ids else 0
        else:
            valid = m.validate_tokens(drafts)
        out.append(min(n, valid + (proposal.q is not None)))
    return out


def with_forced(proposal: Proposal, forced: Sequence[Sequence[int]]) -> Proposal:
    """`proposal` with row b's drafts replaced by forced[b] where that is non-empty (the drafter
    proposed nothing there): one-hot q and confidence 1 where the proposal has them."""
    return proposal.with_rows(forced, [[1.0] * len(f) for f in forced])
