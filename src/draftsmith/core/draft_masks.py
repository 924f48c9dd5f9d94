"""Grammar-masked drafting: a drafter that drafts left to right proposes, on a row with a
grammar, only tokens that grammar allows after the committed output and the row's drafts so far.

A draft the grammar refuses has p = 0 under the masked target: it is rejected for certain and
ends the row's round there. Masked, the drafter drafts its best allowed token instead. The law
of the output is unchanged: verification is exact for any draft distribution q as long as q is
the one the draft was drawn from, and here q_k = warp(logits_k with -inf where the grammar
refuses), the mask read at the drafted prefix x_1..x_{k-1} (as the target's own mask at that
block position is, core/structured.py). On greedy rows the masked argmax is the unmasked one
whenever the grammar allows it, so the full mask is computed only where it does not (one
validate_tokens call otherwise).

A row ends where its grammar allows none of the drafter's tokens (a reduced draft vocabulary
may hold none of them) and after an EOS draft: its drafts from there on are not kept (`limit`).
The matchers are borrowed: every draft consumed is rolled back by `release` (a `with` block
does it), so verification finds each matcher at the committed output. Where a grammar has
ended (llguidance: stopped) only EOS may follow; the matcher takes it without recording it
(llguidance 1.9), so that draft is kept without being consumed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.core.structured import allowed_now, allowed_tokens


class MaskPool:
    """llguidance's thread pool for the masks of several rows at once, started on first use
    (each drafter owns one; the engine's verify masks use the Grammars' own)."""

    def __init__(self) -> None:
        self._executor = None

    def executor(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor


class DraftMasks:
    """The grammar masks of one drafting round over `seqs` (the rows being drafted, in the
    drafter's order). `draft_ids`: the target id of each drafter logit (a reduced draft
    vocabulary), None when the drafter's logits are over the target's V tokens. `pool`: where
    several rows need their mask at one position, they are computed in one call on its threads."""

    def __init__(self, seqs: Sequence, vocab_size: int, draft_ids: torch.Tensor | None = None,
                 pool: MaskPool | None = None) -> None:
        self.matchers = [getattr(s, "grammar", None) for s in seqs]
        self.greedy = [s.params.greedy for s in seqs]
        self.vocab_size = vocab_size
        self.draft_ids = draft_ids.cpu() if draft_ids is not None else None
        self.pool = pool
        self.consumed = [0] * len(seqs)  # drafts each matcher took (rolled back by release)
        self.kept = [0] * len(seqs)  # drafts each row keeps
        self.ended = [False] * len(seqs)

    @classmethod
    def of(cls, seqs: Sequence, vocab_size: int, draft_ids: torch.Tensor | None = None,
           pool: MaskPool | None = None) -> DraftMasks | None:
        """Masks for `seqs`, or None where no row has a grammar (nothing to mask)."""
        if all(getattr(s, "grammar", None) is None for s in seqs):
            return None
        return cls(seqs, vocab_size, draft_ids, pool)

    def __enter__(self) -> DraftMasks:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _target_id(self, j: int) -> int:
        return j if self.draft_ids is None else int(self.draft_ids[j])

    def restrict(self, logits: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
        """logits [R, Vd] of the next draft of `rows` (indices into `seqs`; all of them by
        default) with -inf where each row's grammar refuses the token; rows without a grammar,
        and rows that have ended, as they are. A row whose grammar allows none of the drafter's
        tokens ends here. Returns `logits` itself where nothing was masked, else a new tensor."""
        rows = range(len(self.matchers)) if rows is None else rows
        need = []  # (j, b): the rows whose mask is read
        for j, b in enumerate(rows):
            m = self.matchers[b]
            if m is None or self.ended[b]:
                continue
            if m.is_stopped() and m.stop_reason() == "EndOfSentence":  # an EOS draft: nothing follows
                self.ended[b] = True
                continue
            if self.greedy[b] and not m.is_stopped():
                # the unmasked argmax is the masked one where the grammar allows it
                if m.validate_tokens([self._target_id(int(logits[j].argmax()))]) == 1:
                    continue
            need.append((j, b))
        if not need:
            return logits
        allowed = self._allowed([self.matchers[b] for _, b in need])  # [n, V]
        if self.draft_ids is not None:
            allowed = allowed[:, self.draft_ids]
        out = logits.clone()
        for (j, b), a in zip(need, allowed):
            if not bool(a.any()):
                self.ended[b] = True
                continue
            out[j].masked_fill_(~a.to(logits.device), float("-inf"))
        return out

    def _allowed(self, matchers: list) -> torch.Tensor:
        """The tokens each matcher allows next, bools [n, V]: one call on the pool's threads for
        several, the matcher itself for one."""
        V = self.vocab_size
        if len(matchers) == 1 or self.pool is None:
            return torch.stack([allowed_now(m, V) for m in matchers])
        words = (V + 31) // 32
        bits = torch.zeros(len(matchers), words, dtype=torch.int32)
        self.pool.executor().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.data_ptr(),
                                                     4 * words, len(matchers))
        return allowed_tokens(bits, V)

    def consume(self, tokens: Sequence[int], rows: Sequence[int] | None = None) -> None:
        """The drafts just drawn (target ids) for `rows`: each grammar row's matcher takes its
        draft (checked first: a refused token would leave the matcher in its error state); a
        row that has ended, or whose grammar refuses the draft, keeps no more drafts."""
        rows = range(len(self.matchers)) if rows is None else rows
        for t, b in zip(tokens, rows):
            m = self.matchers[b]
            if m is None or self.ended[b]:
                continue
            t = int(t)
            if m.is_stopped():  # only EOS may follow, taken unrecorded: keep it and end
                self.kept[b] += int(bool(allowed_now(m, self.vocab_size)[t]))
                self.ended[b] = True
            elif m.validate_tokens([t]) == 1 and m.consume_token(t):
                self.consumed[b] += 1
                self.kept[b] += 1
            else:
                self.ended[b] = True

    def limit(self, b: int, n: int) -> int:
        """How many of row b's n drafts to keep: those its grammar took (all, without a grammar)."""
        return n if self.matchers[b] is None else min(n, self.kept[b])

    def all_ended(self) -> bool:
        """Every row has a grammar and has ended: no further draft would be kept."""
        return all(m is not None and e for m, e in zip(self.matchers, self.ended))

    def release(self) -> None:
        """Roll every matcher back to the committed output (`limit` still answers)."""
        for b, m in enumerate(self.matchers):
            if m is not None and self.consumed[b]:
                m.rollback(self.consumed[b])
            self.consumed[b] = 0
