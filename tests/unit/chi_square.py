"""Pearson chi-square goodness of fit, shared by the losslessness tests."""

from __future__ import annotations

import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts [C] against probs [C]: cells with an expected count below 5 are pooled
    into one; a cell hit where probs has zero mass fails outright (p = 0)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if bool((counts[probs <= 0] > 0).any()):
        return 0.0
    expected = counts.sum() * probs
    big, small = expected >= 5, (expected > 0) & (expected < 5)
    obs, exp = counts[big], expected[big]
    if bool(small.any()):
        obs = torch.cat([obs, counts[small].sum().view(1)])
        exp = torch.cat([exp, expected[small].sum().view(1)])
    df = obs.numel() - 1
    if df < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def exact_first_two_laws(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A target decoder's law of the first sampled token [V], the second [V] and the pair [V, V]
    after `prompt` at temperature 1 (float64; every second-token context in one batch)."""
    V, L = model.config.vocab_size, len(prompt)
    with torch.no_grad():
        ids = torch.cat([torch.tensor([prompt]).expand(V, L), torch.arange(V)[:, None]], 1)
        logits = model(ids, model.new_cache(V, L + 1), rows=torch.arange(V)).logits.double()
    p1 = torch.softmax(logits[0, L - 1], -1)
    pair = p1[:, None] * torch.softmax(logits[:, L], -1)
    return p1, pair.sum(0), pair
