"""Confidence calibration a drafter applies at inference: STS temperatures and the sampling regime
they were fitted in (calibration.json, drafters/checkpoint.py reads and writes it; eval/sts.py fits
it). One fit per checkpoint: `draftsmith calibrate --temperature T` fits the regime of T and
replaces the file."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class STSFit:
    """STS temperatures T_1..T_γ and the sampling regime of the rounds they were fitted on. A
    confidence's label differs between regimes (greedy: the draft is the target's argmax; sampled:
    the draft is accepted, 1 - TV), and so does the scale that calibrates it: a fit applies to the
    rows of its own regime only, the others keep their raw confidences (stop 61: temperatures fitted
    at T = 1 took the built-in's T = 0 ECE from 0.011 to 0.047). `greedy` None: unknown (a file
    written before regimes), applied to every row as then."""

    temperatures: tuple[float, ...]
    greedy: bool | None = None

    @property
    def regime(self) -> str | None:
        return regime_name(self.greedy)

    def applies_to(self, greedy: bool) -> bool:
        """Whether rows sampled greedily (or not) use these temperatures."""
        return self.greedy is None or self.greedy == greedy


def regime_name(greedy: bool | None) -> str | None:
    """"greedy", "sampled", or None (unknown: every row)."""
    return None if greedy is None else "greedy" if greedy else "sampled"


def sts_regime(raw: Mapping[str, Any]) -> bool | None:
    """A calibration file's regime: its "regime", else the temperature it was fitted at
    (fitted_on.temperature: 0 = greedy), else None (unknown)."""
    regime = raw.get("regime")
    if regime is not None:
        if regime not in ("greedy", "sampled"):
            raise ValueError(f"regime must be 'greedy' or 'sampled', got {regime!r}")
        return regime == "greedy"
    t = (raw.get("fitted_on") or {}).get("temperature")
    return None if t is None else float(t) == 0.0
