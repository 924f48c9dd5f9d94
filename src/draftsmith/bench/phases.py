"""The phases of a bench: one per concurrency tier, plus a `peers` phase (concurrency 1, closed
loop) when peers (HF transformers, llama.cpp) are asked for and no tier is a concurrency-1 closed loop to join."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.bench.config import Arrival, BenchConfig
from draftsmith.bench.llamacpp import LLAMACPP_GENERATE, LLAMACPP_LOOKUP
from draftsmith.bench.peers import HF_ASSISTANT, HF_GENERATE, HF_LOOKUP


@dataclass(frozen=True)
class Phase:
    key: str  # "c4" for a tier, "peers" for the peers-only phase
    concurrency: int
    arrival: Arrival
    with_peers: bool
    tier: bool  # part of the concurrency sweep


def plan_phases(cfg: BenchConfig) -> list[Phase]:
    closed = cfg.arrival.mode == "closed"
    phases = [Phase(f"c{c}", c, cfg.arrival, bool(cfg.peers) and c == 1 and closed, True) for c in cfg.concurrency]
    if cfg.peers and not any(p.with_peers for p in phases):
        phases.insert(0, Phase("peers", 1, Arrival("closed"), True, False))
    return phases


def phase_labels(cfg: BenchConfig, phase: Phase) -> set[str]:
    """The configurations a finished `phase` has a results line for."""
    labels = list(cfg.config_labels)
    if phase.with_peers:
        if "hf" in cfg.peers:
            labels += [HF_GENERATE, HF_LOOKUP] + ([HF_ASSISTANT] if cfg.peer_assistant else [])
        if "llamacpp" in cfg.peers:
            labels += [LLAMACPP_GENERATE, LLAMACPP_LOOKUP]
    return set(labels)
