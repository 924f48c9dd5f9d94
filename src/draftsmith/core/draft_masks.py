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
may hold none of them), after an EOS draft and at its cap: its drafts from there on are not
kept (`limit`), and it is masked no more. The matchers are borrowed: every draft consumed is
rolled back by `release` (the drafter calls it in a `finally`, before verification), so
verification finds each matcher at the committed output. Where a grammar has
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
    several rows need their mask at one position, they are computed in one call on its threads.
    `caps`: the most drafts each row may keep (a row that has them ends; none by default)."""

    def __init__(self, seqs: Sequence, vocab_size: int, draft_ids: torch.Tensor | None = None,
                 pool: MaskPool | None = None, caps: Sequence[int] | None = None) -> None:
        self.matchers = [getattr(s, "grammar", None) for s in seqs]
        self.greedy = [s.params.greedy for s in seqs]
        self.vocab_size = vocab_size
        self.draft_ids = draft_ids.cpu() if draft_ids is not None else None
        self.pool = pool
        self.caps = list(caps) if caps is not None else None
        self.consumed = [0] * len(seqs)  # drafts each matcher took (rolled back by release)
        self.kept = [0] * len(seqs)  # drafts each row keeps
        self.ended = [m is not None and self.caps is not None and self.caps[b] <= 0
                      for b, m in enumerate(self.matchers)]

    @classmethod
    def of(cls, seqs: Sequence, vocab_size: int, draft_ids: torch.Tensor | None = None,
           pool: MaskPool | None = None, caps: Sequence[int] | None = None) -> DraftMasks | None:
        """Masks for `seqs`, or None where no row has a grammar (nothing to mask)."""
        if all(getattr(s, "grammar", None) is None for s in seqs):
            return None
        return cls(seqs, vocab_size, draft_ids, pool, caps)

    def restrict(self, logits: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
        """logits [R, Vd] of the next draft of `rows` (indices into `seqs`; all of them by
        default) with -inf where each row's grammar refuses the token; rows without a grammar,
        and rows that have ended, as they are. A row whose grammar allows none of the drafter's
        tokens ends here. Returns `logits` itself where nothing was masked, else a new tensor."""
        rows = range(len(self.matchers)) if rows is None else rows
        live = [(j, b) for j, b in enumerate(rows) if self.matchers[b] is not None and not self.ended[b]]
        if not live:
            return logits
        top = None
        if any(self.greedy[b] for _, b in live):  # the unmasked argmax is the masked one where allowed
            top = logits.argmax(-1).tolist()
            if self.draft_ids is not None:
                top = self.draft_ids[top].tolist()
        need = []  # (j, b): the rows whose mask is read
        for j, b in live:
            m = self.matchers[b]
            if self.greedy[b] and not m.is_stopped() and m.validate_tokens([top[j]]) == 1:
                continue
            need.append((j, b))
        if not need:
            return logits
        allowed = self._allowed([self.matchers[b] for _, b in need])  # [n, V]
        if self.draft_ids is not None:
            allowed = allowed[:, self.draft_ids]
        some = allowed.any(-1).tolist()
        for (_, b), ok in zip(need, some):
            self.ended[b] = self.ended[b] or not ok  # nothing of the drafter's allowed: the row ends here
        fill = [i for i, ok in enumerate(some) if ok]
        if not fill:
            return logits
        js = torch.tensor([need[i][0] for i in fill], device=logits.device)
        out = logits.clone()
        out[js] = out[js].masked_fill(~allowed[fill].to(logits.device), float("-inf"))
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
        row that has ended, or whose grammar refuses the draft, keeps no more drafts; one that
        took an EOS or reached its cap ends."""
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
                self.ended[b] = m.is_stopped() and m.stop_reason() == "EndOfSentence" or (
                    self.caps is not None and self.kept[b] >= self.caps[b])
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
