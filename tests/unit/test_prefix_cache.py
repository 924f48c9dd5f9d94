"""Automatic prefix caching (engine/prefix_cache.py): which row a request gets, what it reuses,
that outputs and KV match a fresh prefill, and where it must stay off."""

from __future__ import annotations

import pytest
import torch

from draftsmith import LLM, SamplingParams
from draftsmith.engine.engine import prefill_groups
from draftsmith.engine.prefix_cache import common_prefix, place
from draftsmith.kernels.build import cpu_kernels
from draftsmith.models.kv_cache import KVCache


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama", seed=0)


def small_cache(rows: int = 4, max_len: int = 64) -> KVCache:
    return KVCache(num_layers=1, max_rows=rows, num_kv_heads=1, max_len=max_len, head_dim=2)


def test_common_prefix():
    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    assert common_prefix(t([1, 2, 3]), t([1, 2, 4])) == 2
    assert common_prefix(t([1, 2, 3]), t([1, 2, 3, 4])) == 3
    assert common_prefix(t([5]), t([1])) == 0
    assert common_prefix(t([]), t([1])) == 0


def test_cache_records_are_dropped_when_a_row_is_handed_out():
    c = small_cache()
    c.remember(1, [7, 8, 9])
    assert c.remembered(1).tolist() == [7, 8, 9] and c.remembered_order() == [1]
    c.reuse(1, 2)
    assert c.remembered(1) is None and int(c.lengths[1]) == 2
    c.remember(2, [1, 2])
    with pytest.raises(ValueError, match="holds 2 remembered tokens, not 3"):
        c.reuse(2, 3)
    c.remember(3, [4])
    c.reset(3)
    assert c.remembered(3) is None
    with pytest.raises(ValueError):
        c.remember(0, list(range(65)))


def test_place_serves_the_longest_match_first_then_empty_rows_then_the_oldest_record():
    c = small_cache(rows=5)
    c.remember(0, [1, 2, 3, 4, 5, 6])  # oldest
    c.remember(1, [1, 2, 9])
    c.remember(3, [1, 2, 3, 4])
    # feed A matches row 0 for 5 tokens and row 3 for 4; feed B matches row 0 for 6 (longest: served first)
    placed = place([[1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 6, 7], [42], [43]], [0, 1, 2, 3, 4], c)
    assert placed[1] == (0, 6)
    assert placed[0] == (3, 4)  # its best row went to B: it gets its longest match among the rest
    # no match: rows that hold nothing first (2, 4), lowest first; the records stay for later
    assert placed[2] == (2, 0) and placed[3] == (4, 0)
    assert len({r for r, _ in placed}) == 4
    # with only remembered rows left, an unmatched request takes the least recently remembered
    c2 = small_cache(rows=2)
    c2.remember(1, [5, 5])
    c2.remember(0, [6, 6])
    assert place([[9]], [0, 1], c2) == [(1, 0)]


def test_prefill_groups_keep_every_row_inside_its_room():
    # equal suffixes would share one forward, but the row that starts near the end has room for 3
    assert sorted(map(sorted, prefill_groups([3, 3, 3], room=[60, 3, 60]))) == [[0, 1, 2]]
    groups = prefill_groups([3, 4, 4], room=[3, 60, 60])
    assert all(max(4 if i else 3 for i in g) <= min([3, 60, 60][i] for i in g) for g in groups)
    assert sorted(i for g in groups for i in g) == [0, 1, 2]
    assert prefill_groups([2, 2, 2]) == [[0, 1, 2]]


def test_next_turn_reuses_its_conversation_and_matches_a_fresh_engine(tiny):
    on = LLM(str(tiny), max_batch=3, max_len=256, enable_prefix_caching=True)
    off = LLM(str(tiny), max_batch=3, max_len=256, enable_prefix_caching=False)
    assert on.engine.prefix_caching and not off.engine.prefix_caching
    first = on.generate(["abcabcabc hello"], greedy(12, ignore_eos=True))[0]
    turn2 = first.prompt_token_ids + first.token_ids + on.encode(" and then")
    got = on.generate([turn2], greedy(12, ignore_eos=True))[0]
    ref = off.generate([turn2], greedy(12, ignore_eos=True))[0]
    eng = on.engine
    # the KV of every token but the last emitted one was still in the row
    assert got.stats["cached_tokens"] == len(first.prompt_token_ids) + len(first.token_ids) - 1
    assert ref.stats["cached_tokens"] == 0 and len(got.token_ids) == len(ref.token_ids)
    assert (got.num_cached_tokens, ref.num_cached_tokens) == (got.stats["cached_tokens"], 0)  # (vLLM's name)
    assert got.finished and ref.finished
    # the reused row's keys equal a fresh prefill's (decode-built entries: within float rounding,
    # so the outputs may differ at near-ties and are not compared)
    row_on = [r for r in range(3) if eng.cache.remembered(r) is not None
              and eng.cache.remembered(r).numel() > len(turn2)][0]
    n = len(turn2) - 1
    fresh = off.engine.model.new_cache(1, 256)
    off.engine.model(torch.tensor([turn2[:n]]), fresh, rows=torch.tensor([0]), compute_logits=False)
    for layer in range(len(fresh.k)):
        torch.testing.assert_close(eng.cache.k[layer][row_on, :, :n], fresh.k[layer][0, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(eng.cache.v[layer][row_on, :, :n], fresh.v[layer][0, :, :n], atol=1e-4, rtol=1e-4)


def test_shared_prefixes_in_a_batch_and_repeated_prompts_give_plain_outputs(tiny):
    prompts = ["system: be brief. user: one", "system: be brief. user: two", "system: be brief. user: three",
               "system: be brief. user: one"]
    on = LLM(str(tiny), max_batch=2, max_len=256, enable_prefix_caching=True)
    off = LLM(str(tiny), max_batch=2, max_len=256, enable_prefix_caching=False)
    a = on.generate(prompts, greedy(16))
    b = off.generate(prompts, greedy(16))
    # Short prompts run Draftsmith's step kernels, which compute a token's row the same way in any
    # batch: a prefix prefilled with another prompt is then the same bits (elsewhere: float rounding)
    exact = cpu_kernels().ok
    if exact:
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # two rows: the last two prompts start after earlier ones finished, sharing their prefix
    assert all(o.stats["cached_tokens"] > 0 for o in a[2:])
    assert a[3].stats["cached_tokens"] == len(a[3].prompt_token_ids) - 1  # the same prompt again
    # a second call: every prompt finds its prefix
    again = on.generate(prompts[:2], greedy(16))
    if exact:
        assert [o.token_ids for o in again] == [o.token_ids for o in b[:2]]
    assert all(o.stats["cached_tokens"] > 0 for o in again)


def test_an_aborted_request_leaves_nothing_to_reuse(tiny):
    llm = LLM(str(tiny), max_batch=1, max_len=256, enable_prefix_caching=True)
    eng = llm.engine
    ids = llm.encode("abcabcabc")
    s = eng.add_request(ids, greedy(8))
    eng.step()
    eng.abort(s.request_id)
    assert eng.cache.remembered(0) is None
    s2 = eng.add_request(ids, greedy(8))
    while eng.has_unfinished():
        eng.step()
    assert s2.stats.cached_tokens == 0 and eng.cache.remembered(0) is not None


def test_a_stop_cut_remembers_only_kept_tokens(tiny):
    # a self-drafting target accepts whole blocks; a stop token inside one cuts what is kept
    plain = LLM(str(tiny), max_len=256, enable_prefix_caching=False)
    ref = plain.generate(["def f(x):"], greedy(30, ignore_eos=True))[0]
    stop = ref.token_ids[9]
    llm = LLM(str(tiny), drafter=f"draft-model:{tiny}", policy="fixed", num_speculative_tokens=6, max_len=256,
              max_batch=1, drafter_dtype="float32", enable_prefix_caching=True)
    out = llm.generate(["def f(x):"], greedy(30, ignore_eos=True, stop_token_ids=(stop,)))[0]
    held = llm.engine.cache.remembered(0)
    all_ids = out.prompt_token_ids + out.token_ids
    assert held is not None and held.numel() <= len(all_ids)
    assert held.tolist() == all_ids[: held.numel()]


def test_n_gram_and_draft_models_keep_it_where_asked_and_the_default_is_off(tiny):
    target = LLM(str(tiny), max_len=128, enable_prefix_caching=False).target
    # they read no target features (context-cache drafters: test_prefix_cache_drafters.py)
    assert LLM(target, drafter="ngram", max_len=128, enable_prefix_caching=None).engine.prefix_caching
    assert not LLM(target, drafter="ngram", max_len=128).engine.prefix_caching


def test_shared_cache_between_engines_never_reuses_a_row_another_engine_wrote(tiny):
    a = LLM(str(tiny), max_batch=1, max_len=256, enable_prefix_caching=True)
    first = a.generate(["abcabc"], greedy(6))[0]
    assert a.engine.cache.remembered(0) is not None
    from draftsmith.engine.builder import build_engine

    b = build_engine(a.target, max_batch=1, max_len=256, cache=a.engine.cache)  # prefix caching off
    s = b.add_request(a.encode("zzzz"), greedy(4))
    while b.has_unfinished():
        b.step()
    assert a.engine.cache.remembered(0) is None  # b handed the row out: a's record is gone
    again = a.generate(["abcabc"], greedy(6))[0]
    assert again.stats["cached_tokens"] == 0 and again.token_ids == first.token_ids
    assert s.finished


def test_a_cache_salt_keeps_a_prefix_to_requests_with_the_same_salt(tiny):
    """vLLM's cache_salt: a row remembered under a salt is matched only by the same salt (None
    only by None); the record goes with the row when it is handed out or reset; outputs do not
    change."""
    c = small_cache()
    c.remember(0, [1, 2, 3], salt="a")
    c.remember(1, [1, 2], salt=None)
    assert c.salt(0) == "a" and c.salt(1) is None
    assert place([[1, 2, 3, 4]], [0, 1, 2], c, salts=["a"])[0] == (0, 3)
    assert place([[1, 2, 3, 4]], [0, 1, 2], c, salts=["b"])[0] == (2, 0)  # nothing of another tenant's
    assert place([[1, 2, 3, 4]], [0, 1, 2], c)[0] == (1, 2)  # no salt: only unsalted rows
    c.reuse(0, 3)
    assert c.salt(0) is None
    llm = LLM(str(tiny), max_batch=1, max_len=256, enable_prefix_caching=True)
    eng, ids = llm.engine, llm.encode("the same prompt, again and again")

    def run(salt):
        s = eng.add_request(ids, greedy(6), cache_salt=salt)
        while eng.has_unfinished():
            eng.step()
        return s

    first = run("tenant-a")
    assert run("tenant-b").stats.cached_tokens == 0  # (and now the row is tenant-b's)
    assert run(None).stats.cached_tokens == 0
    again = run(None)
    assert again.stats.cached_tokens == len(ids) - 1 and again.output_ids == first.output_ids
    assert run("tenant-a").stats.cached_tokens == 0  # the row was handed to others since
    assert run("tenant-a").stats.cached_tokens == len(ids) - 1
