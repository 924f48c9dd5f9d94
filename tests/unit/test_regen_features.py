"""`regen --features-out`: the feature cache recorded while regenerating equals the one
`draftsmith cache` builds from the output (same samples, ids, masks; features within float
summation order), with and without prefix caching; what regen could not record (conversations
of an earlier run, one too long for the tail request) is computed by the catch-up pass; bad
combinations fail before anything is generated."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from draftsmith.data.cache import CacheConfig, FeatureCache, read_manifest, run_cache
from draftsmith.data.regen import RegenConfig, load_records, run_regen
from draftsmith.data.sources.conversation import Conversation
from draftsmith.errors import DraftsmithError

pytestmark = pytest.mark.usefixtures("one_thread")

SYSTEM = "You are a careful assistant. Answer briefly and show the arithmetic."


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("llama", seed=5)


def _conv(i: int, turns: int, system: bool) -> Conversation:
    msgs = [{"role": "system", "content": SYSTEM}] if system else []
    for t in range(turns):
        msgs += [{"role": "user", "content": f"q{i}.{t}: {i} + {t} = ?"}, {"role": "assistant", "content": "x"}]
    return Conversation(id=f"f/{i}", source="test", split="train", messages=msgs)


CONVS = [_conv(i, turns=1 + i % 3, system=i % 2 == 0) for i in range(7)]


def _cfg(tiny: Path, tmp: Path, **kw) -> RegenConfig:
    base = dict(target=str(tiny), out=tmp / "regen.jsonl", max_new_tokens=8, max_len=256, batch_size=3,
                overwrite=True, features_out=tmp / "features", feature_layers="0,1", feature_dtype="fp32",
                progress=False)
    base.update(kw)
    return RegenConfig(**base)


def _cache_pass(tiny: Path, data: Path, out: Path) -> FeatureCache:
    run_cache(CacheConfig(target=str(tiny), data=data, out=out, layers="0,1", dtype="fp32", progress=False))
    return FeatureCache(out)


def _assert_same(recorded: FeatureCache, reference: FeatureCache, records: list[dict]) -> None:
    assert sorted(recorded.sample_ids) == sorted(reference.sample_ids) == sorted(r["id"] for r in records)
    for rec in records:
        a, b = recorded.features(rec["id"]), reference.features(rec["id"])
        assert a.input_ids.tolist() == b.input_ids.tolist() == rec["input_ids"]
        assert a.loss_mask.tolist() == b.loss_mask.tolist() == [bool(m) for m in rec["loss_mask"]]
        for i in (0, 1):
            torch.testing.assert_close(a.hidden[i], b.hidden[i], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.final_hidden, b.final_hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_recorded_features_equal_the_cache_pass(tiny, tmp_path, prefix_caching):
    cfg = _cfg(tiny, tmp_path, enable_prefix_caching=prefix_caching)
    s = run_regen(cfg, conversations=CONVS)
    records = load_records(cfg.out)
    assert s.written == len(records) == len(CONVS) and s.errors == 0
    assert (s.recorded_features, s.computed_features) == (len(CONVS), 0)  # one pass, nothing left over
    if prefix_caching:  # later turns (and the shared system prompt) were not prefilled again
        assert s.cached_prompt_tokens > 0
    assert read_manifest(cfg.features_out)["complete"] is True
    _assert_same(FeatureCache(cfg.features_out), _cache_pass(tiny, cfg.out, tmp_path / "ref"), records)
    # The recorder does not change what is generated: the same run without it.
    plain = run_regen(replace(cfg, out=tmp_path / "plain.jsonl", features_out=None), conversations=CONVS)
    assert plain.written == len(CONVS)
    assert {r["id"]: r["input_ids"] for r in load_records(tmp_path / "plain.jsonl")} == \
        {r["id"]: r["input_ids"] for r in records}


def test_catch_up_pass_computes_what_regen_did_not_record(tiny, tmp_path):
    # An earlier run wrote three conversations without features; the resumed run records the
    # other four and the catch-up pass computes the first three.
    first = _cfg(tiny, tmp_path, features_out=None)
    run_regen(first, conversations=CONVS[:3])
    s = run_regen(_cfg(tiny, tmp_path, overwrite=False, resume=True), conversations=CONVS)
    assert (s.skipped_done, s.written, s.recorded_features, s.computed_features) == (3, 4, 4, 3)
    records = load_records(first.out)
    _assert_same(FeatureCache(tmp_path / "features"), _cache_pass(tiny, first.out, tmp_path / "ref"), records)
    # Resumed again with nothing left to do: nothing changes, the cache stays complete.
    s = run_regen(_cfg(tiny, tmp_path, overwrite=False, resume=True), conversations=CONVS)
    assert (s.written, s.recorded_features, s.computed_features) == (0, 0, 0)
    assert len(FeatureCache(tmp_path / "features")) == len(CONVS)


def test_conversation_too_long_for_the_tail_request_gets_features_after(tiny, tmp_path):
    # max_len 60 with 40 new tokens: an answer that runs to the limit leaves a conversation
    # whose last tokens do not fit one more request; the catch-up pass covers it.
    cfg = _cfg(tiny, tmp_path, max_len=60, max_new_tokens=40)
    s = run_regen(cfg, conversations=CONVS[:4])
    records = load_records(cfg.out)
    long = [r for r in records if len(r["input_ids"]) >= 60]
    assert long and s.computed_features == len(long) and s.recorded_features == len(records) - len(long)
    _assert_same(FeatureCache(cfg.features_out), _cache_pass(tiny, cfg.out, tmp_path / "ref"), records)


def test_features_out_bad_combinations_fail_before_generating(tiny, tmp_path):
    with pytest.raises(DraftsmithError, match="built-in engine"):
        run_regen(_cfg(tiny, tmp_path, endpoint="http://127.0.0.1:9/v1"), conversations=CONVS)
    (tmp_path / "features").mkdir()
    (tmp_path / "features" / "notes.txt").write_text("someone else's")
    with pytest.raises(DraftsmithError, match="not empty"):
        run_regen(_cfg(tiny, tmp_path, overwrite=False), conversations=CONVS)
    assert not (tmp_path / "regen.jsonl").exists()
    with pytest.raises(DraftsmithError, match="out of range"):
        run_regen(_cfg(tiny, tmp_path / "b", feature_layers="0,99"), conversations=CONVS)
