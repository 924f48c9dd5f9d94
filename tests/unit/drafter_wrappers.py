"""A drafter that forwards everything to another one: tests subclass it to record or to break
one method (a recorder of proposals, a wrong-q negative control)."""

from __future__ import annotations


class ForwardingDrafter:
    def __init__(self, inner) -> None:
        self.inner, self.name, self.needs = inner, inner.name, inner.needs

    def start(self, seq, features):
        self.inner.start(seq, features)

    @property
    def gated(self) -> bool:  # the engine passes the policy's draft gate only to drafters that take one
        return getattr(self.inner, "gated", False)

    def propose(self, seqs, max_lengths, **gate):
        return self.inner.propose(seqs, max_lengths, **gate)

    def on_verified(self, seqs, proposal, result, features):
        self.inner.on_verified(seqs, proposal, result, features)

    def release(self, seq):
        self.inner.release(seq)
