"""Prefix caching with drafters fed the target's features: EAGLE-3 / DFlash / DSpark rows keep
their context (drafters/feature_queue.py, `follows_prefix_cache`), so a next turn reuses what the
KV cache and the drafter both hold (EAGLE-3: one position less); the reused context equals a fresh
one; a drafter that does not keep its context per row turns prefix caching off."""

from __future__ import annotations

import logging

import pytest
import torch

from draftsmith import LLM, SamplingParams
from draftsmith.drafters import dflash, dspark, eagle3
from draftsmith.drafters.base import FeatureSpec, NoDrafter
from draftsmith.drafters.lookup_first import LookupFirstDrafter
from draftsmith.engine.prefix_cache import common_prefix, place
from draftsmith.models.kv_cache import KVCache
from draftsmith.policy.fixed import FixedK

MAX_LEN = 256


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama", seed=0)), max_len=MAX_LEN).target


@pytest.fixture(scope="module")
def models(target):
    torch.manual_seed(0)
    return {
        "dspark": dspark.build(target.model, dspark.DSparkConfig(block_size=4, num_layers=1, rank=8, max_anchors=4)),
        "dflash": dflash.build(target.model, dflash.DFlashConfig(block_size=4, num_layers=1, max_anchors=4)),
        "eagle3": eagle3.build(target.model, eagle3.Eagle3Config()),
    }


def llm_with(target, model, *, prefix: bool | None, k: int = 3, rows: int = 1, lookup: bool = False) -> LLM:
    drafter = model.make_drafter(target.model, rows, MAX_LEN)
    return LLM(target, drafter=LookupFirstDrafter(drafter) if lookup else drafter, policy=FixedK(k), max_batch=rows,
               max_len=MAX_LEN, enable_prefix_caching=prefix)


def context_cache(llm: LLM):
    d = llm.engine.drafter
    return d.model.cache if isinstance(d, LookupFirstDrafter) else d.cache


def admit(llm: LLM, ids: list[int], n: int = 8):
    """Add a request and run one engine step (its prefill and first round: the round's propose
    consumes the prompt's queued features into the drafter's context)."""
    s = llm.engine.add_request(ids, greedy(n))
    llm.engine.step()
    return s


def context(llm: LLM, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c = context_cache(llm)
    return [(c.k[i][row, :, :n].clone(), c.v[i][row, :, :n].clone()) for i in range(len(c.k))]


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "lookup:dspark"])
@pytest.mark.parametrize("turn1_drafts", [3, 0], ids=["consumed", "still-queued"])
def test_next_turn_reuses_the_drafters_context_and_it_equals_a_fresh_one(target, models, kind, turn1_drafts):
    lookup = kind.startswith("lookup:")
    model = models[kind.removeprefix("lookup:")]
    on = llm_with(target, model, prefix=True, lookup=lookup)
    assert on.engine.prefix_caching
    on.engine.policy = FixedK(turn1_drafts)  # 0: turn 1 never drafts, so its features stay queued
    first = on.generate(["abcabcabc hello"], greedy(12))[0]
    kept = on.engine.drafter.held_ids(0)
    conv = first.prompt_token_ids + first.token_ids
    # the drafter holds every position the KV cache remembers (all but the last emitted token)
    assert kept is not None and kept.tolist() == conv[:-1]
    cached = int(context_cache(on).lengths[0])  # the rest of them still queued
    if not lookup:  # (lookup drafts some rounds itself: the model's queue is consumed only when it drafts)
        assert (cached == 0) if turn1_drafts == 0 else (0 < cached < len(conv) - 1)

    on.engine.policy = FixedK(3)
    turn2 = conv + on.encode(" and then")
    s = admit(on, turn2)
    margin = 1 if kind == "eagle3" else 0  # its context position j also reads token j + 1
    assert s.stats.cached_tokens == len(conv) - 1 - margin
    fresh = llm_with(target, model, prefix=False, lookup=lookup)
    f = admit(fresh, turn2)
    assert f.stats.cached_tokens == 0
    n = len(turn2) - 1
    for (k_on, v_on), (k_f, v_f) in zip(context(on, s.row, n), context(fresh, f.row, n)):
        torch.testing.assert_close(k_on, k_f, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v_on, v_f, atol=1e-4, rtol=1e-4)
    # and the turn finishes as a fresh engine's plain decoding does (the tiny target has no near-ties)
    for eng in (on.engine, fresh.engine):
        while eng.has_unfinished():
            eng.step()
    plain = LLM(target, max_len=MAX_LEN).generate([turn2], greedy(8))[0]
    assert s.output_ids == f.output_ids == plain.token_ids


def test_a_dropped_queue_limits_reuse_to_the_drafters_context(target, models):
    on = llm_with(target, models["dspark"], prefix=True, k=0, rows=2)  # never drafts: every feature stays queued
    eng = on.engine
    short = eng.add_request(on.encode("abcabcabc hello"), greedy(4))
    long = eng.add_request(on.encode("zzz yyy"), greedy(12))
    while not short.finished:
        eng.step()
    row = next(r for r in range(2) if eng.cache.remembered(r) is not None)
    assert eng.drafter.held_ids(row).numel() == eng.cache.remembered(row).numel() > 0  # all of it, queued
    eng.drafter.queue_bytes = 1
    eng.step()  # the other row's round: over the bound, so the free row's kept queue goes first
    assert not long.finished
    assert eng.drafter.held_ids(row).numel() == int(eng.drafter.cache.lengths[row]) == 0
    while eng.has_unfinished():
        eng.step()
    eng.policy = FixedK(3)
    turn2 = short.all_ids + on.encode(" more")
    got = on.generate([turn2], greedy(8))[0]
    assert got.stats["cached_tokens"] == 0  # the row's KV alone is not enough
    assert got.token_ids == LLM(target, max_len=MAX_LEN).generate([turn2], greedy(8))[0].token_ids


def test_a_row_another_engine_rewrote_is_not_reused_past_what_the_drafter_holds(target, models):
    a = llm_with(target, models["dspark"], prefix=True)
    a.generate(["abcabcabc hello"], greedy(6))
    from draftsmith.engine.builder import build_engine

    b = build_engine(a.target, max_batch=1, max_len=MAX_LEN, cache=a.engine.cache, enable_prefix_caching=True)
    ids = a.encode("zzzz yyyy xxxx")
    s = b.add_request(ids, greedy(6))
    while b.has_unfinished():
        b.step()
    rewritten = a.engine.cache.remembered(0)
    assert rewritten is not None and rewritten.tolist() == s.all_ids[: rewritten.numel()]  # b's tokens
    mine = a.engine.drafter.held_ids(0)  # what a's drafter holds there: its own request's
    shared = common_prefix(rewritten, mine)
    assert shared < 3
    prompt = s.all_ids + a.encode(" w")
    got = a.generate([prompt], greedy(6))[0]
    assert got.stats["cached_tokens"] == shared
    assert got.token_ids == LLM(target, max_len=MAX_LEN).generate([prompt], greedy(6))[0].token_ids


def test_place_matches_what_the_kv_cache_and_the_drafter_both_hold():
    c = KVCache(num_layers=1, max_rows=4, num_kv_heads=1, max_len=64, head_dim=2)
    c.remember(0, [1, 2, 3, 4, 5])
    c.remember(1, [1, 2, 3, 9])
    c.remember(2, [1, 2, 3, 4, 5, 6])
    drafter = {0: torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32),  # all of it
               1: torch.tensor([1, 2], dtype=torch.int32),  # a dropped queue: only its context cache
               2: torch.tensor([7, 7], dtype=torch.int32)}  # another engine rewrote the KV row
    feeds = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9]]
    assert place(feeds, [0, 1, 2, 3], c) == [(2, 6), (1, 4)]
    assert place(feeds, [0, 1, 2, 3], c, lambda r: drafter.get(r)) == [(0, 5), (1, 2)]
    assert place(feeds, [0, 1, 2, 3], c, lambda r: None) == [(3, 0), (0, 0)]  # nothing held: the empty row first


def test_on_for_context_cache_drafters_off_with_a_warning_only_when_asked_for_one_that_keeps_no_rows(
        target, models, caplog):
    for model in models.values():
        assert llm_with(target, model, prefix=None).engine.prefix_caching  # "wherever the drafter allows"
        assert not llm_with(target, model, prefix=False).engine.prefix_caching

    class PromptOnly(NoDrafter):  # reads features, keeps nothing per row
        name = "prompt-only"
        needs = FeatureSpec(layer_ids=(0,))

    def with_it(**kw) -> LLM:
        return LLM(target, drafter=PromptOnly(), max_batch=2, max_len=MAX_LEN, **kw)

    with caplog.at_level(logging.WARNING):
        quiet = with_it(enable_prefix_caching=None)
    assert not quiet.engine.prefix_caching and "prefix caching is off" not in caplog.text
    with caplog.at_level(logging.WARNING):
        asked = with_it(enable_prefix_caching=True)
    assert not asked.engine.prefix_caching and "prefix caching is off" in caplog.text
    out = quiet.generate(["abcabc", "abcabc"], greedy(6))
    assert all(o.stats["cached_tokens"] == 0 for o in out)
