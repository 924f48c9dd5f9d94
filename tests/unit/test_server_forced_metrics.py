"""/metrics counts the grammars' forced drafts (core/grammar_drafts.py) apart from the drafter's,
and the verify-tokens histogram includes them."""

from __future__ import annotations

import httpx

from test_server_unit import _metrics, tiny_dir, tiny_server  # noqa: F401 (fixtures)


def test_forced_drafts_are_counted_on_metrics(tiny_server):
    url = tiny_server()
    body = {"model": "tiny", "prompt": "x", "max_tokens": 24, "temperature": 0,
            "structured_outputs": {"regex": "ab(cdefgh)+"}}  # after "ab" and each "h": "cdefgh" is forced
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("abcdefgh")
    m = _metrics(url)
    assert m["draftsmith_forced_tokens_proposed_total"] > 0
    assert 0 < m["draftsmith_forced_tokens_accepted_total"] <= m["draftsmith_forced_tokens_proposed_total"]
    assert m["draftsmith_draft_tokens_proposed_total"] == 0  # plain decoding: no drafter's drafts
    # tokens verified per step: 1 per round plus the forced drafts (one request, so one row a step)
    assert m["draftsmith_verify_tokens_per_step_sum"] == (m["draftsmith_verification_rounds_total"]
                                                          + m["draftsmith_forced_tokens_proposed_total"])
