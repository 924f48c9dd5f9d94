"""Grammar-masked drafting (core/draft_masks.py): drafters that draft left to right (DSpark,
DFlash, EAGLE-3, a draft model) propose only what each row's grammar allows after the drafts
before it. Greedy outputs equal plain decoding's and no draft is ever refused; at T = 1 the
output is the grammar-masked target's law (PIT), and the control that draws masked drafts but
reports the unmasked q is far from it."""

from __future__ import annotations

import re

import pytest
import torch

from draftsmith import LLM, SamplingParams, StructuredOutputsParams as SO
from draftsmith.core.draft_masks import DraftMasks, MaskPool
from draftsmith.core.structured import allowed_now
from draftsmith.drafters import dflash, dspark, eagle3
from draftsmith.drafters.block_drafter import BlockDrafter
from draftsmith.drafters.draft_model import DraftModelDrafter
from test_engine_pit import uniform_pvalue  # noqa: E402
from test_grammar_drafts import (  # noqa: E402,F401
    PAIRS, WORDS, _ids, _request, _sample, _with_bpe, bpe, bpe_pit, count_grammar_cuts)
from test_structured import _pit  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ALPHA = 1e-6  # as test_engine_pit.py
RECORD = SO(json={"type": "object", "properties": {"greeting": {"enum": ["hello", "world"]}, "n": {"type": "integer"}},
                  "required": ["greeting", "n"]}, disable_any_whitespace=True)


# ---------------------------------------------------------------------------- the masks


def test_restrict_masks_what_each_grammar_refuses_and_release_rolls_back(bpe):
    tok, V = bpe.tokenizer, bpe.model.config.vocab_size
    pairs, free = _request(bpe, PAIRS, "ae"), _request(bpe, None)
    assert not pairs.params.greedy  # sampled (T = 1): the full mask
    masks = DraftMasks.of([pairs, free], V)
    logits = torch.zeros(2, V)
    out = masks.restrict(logits)
    allowed = allowed_now(pairs.grammar, V)
    assert torch.equal(out[0].isfinite(), allowed) and set(tok.decode([i]) for i in allowed.nonzero().flatten()) >= set("abcd")
    assert torch.equal(out[1], logits[1]) and torch.equal(logits, torch.zeros(2, V))  # the input is not written
    masks.consume(_ids(tok, "ab"))  # "a" taken; the row without a grammar takes nothing
    assert masks.consumed == [1, 0] and not any(masks.ended)
    masks.consume(_ids(tok, "ab"), rows=[0])  # "a" after "a": refused, the row ends
    assert masks.ended == [True, False] and masks.limit(0, 5) == 1 and masks.limit(1, 5) == 5
    assert masks.restrict(logits) is logits  # an ended row is left as it is
    masks.release()
    assert pairs.grammar.validate_tokens(_ids(tok, "bfcg")) == 4 and not pairs.grammar.is_error()  # at "ae" again
    assert DraftMasks.of([free], V) is None


def test_rows_masked_at_once_on_the_pool_get_their_own_masks(bpe):
    """Several rows at one position: one call on the pool's threads, each row's mask its own."""
    tok, V = bpe.tokenizer, bpe.model.config.vocab_size
    rows = [_request(bpe, PAIRS, "ae"), _request(bpe, PAIRS, "a"), _request(bpe, WORDS, "hello w"), _request(bpe, None),
            _request(bpe, SO(regex="ab"), "ab")]
    expect = [allowed_now(r.grammar, V) if r.grammar is not None else torch.ones(V, dtype=torch.bool) for r in rows]
    out = DraftMasks(rows, V, pool=MaskPool()).restrict(torch.zeros(len(rows), V))
    assert [torch.equal(o.isfinite(), e) for o, e in zip(out, expect)] == [True] * len(rows)
    assert len({tuple(e.nonzero().flatten().tolist()) for e in expect}) == 5  # five different masks


def test_greedy_rows_compute_the_mask_only_where_the_argmax_is_refused(bpe, monkeypatch):
    tok, V = bpe.tokenizer, bpe.model.config.vocab_size
    row = _request(bpe, PAIRS)
    row.params = SamplingParams(temperature=0.0, structured_outputs=PAIRS)
    import draftsmith.core.draft_masks as dm

    calls = []
    monkeypatch.setattr(dm, "allowed_now", lambda m, V: calls.append(1) or allowed_now(m, V))
    masks = DraftMasks([row], V)
    logits = torch.zeros(1, V)
    logits[0, _ids(tok, "c")[0]] = 5.0  # allowed at the start: left as it is, no mask computed
    assert masks.restrict(logits) is logits and calls == []
    logits[0, _ids(tok, "x")[0]] = 9.0  # refused: masked, the allowed "c" is the argmax again
    out = masks.restrict(logits)
    assert calls == [1] and out[0].argmax() == _ids(tok, "c")[0]


def test_a_reduced_vocabulary_without_an_allowed_token_ends_the_row(bpe):
    tok, V = bpe.tokenizer, bpe.model.config.vocab_size
    row = _request(bpe, PAIRS)
    ids = torch.tensor(_ids(tok, "xyzae"))  # draft logit j is target token ids[j]
    masks = DraftMasks([row], V, ids)
    out = masks.restrict(torch.tensor([[9.0, 0, 0, 1, 0]]))  # "x" refused: only "a" (j = 3) of "xyza" allowed
    assert out[0].isfinite().tolist() == [False, False, False, True, False]
    masks.consume([ids[3].item()])
    assert masks.restrict(torch.zeros(1, 5))[0].isfinite().tolist() == [False] * 4 + [True]  # "e" after "a"
    only_xyz = DraftMasks([row], V, ids[:3])
    assert only_xyz.restrict(torch.zeros(1, 3)).isfinite().all() and only_xyz.ended == [True]
    assert only_xyz.all_ended() and only_xyz.limit(0, 4) == 0


def test_eos_ends_a_row_and_a_finished_grammar_keeps_one_eos_draft(bpe):
    """Where the grammar has ended only EOS may follow: one EOS draft is kept (llguidance takes it
    without recording it, so release rolls back nothing of the committed output); after an EOS
    drafted where the grammar could go on, nothing more."""
    tok, V = bpe.tokenizer, bpe.model.config.vocab_size
    eos = tok.eos_token_id
    done = _request(bpe, SO(regex="ab"), "ab")
    masks = DraftMasks([done], V)
    assert masks.restrict(torch.zeros(1, V))[0].isfinite().nonzero().flatten().tolist() == [eos]
    masks.consume([eos])
    assert masks.ended == [True] and masks.limit(0, 3) == 1
    masks.release()
    assert done.grammar.is_stopped() and allowed_now(done.grammar, V).nonzero().flatten().tolist() == [eos]
    more = _request(bpe, SO(regex="ab(c)?"), "ab")
    masks = DraftMasks([more], V)
    masks.consume([eos])  # taken and recorded: the row ends with it
    assert masks.consumed == [1] and masks.ended == [True] and masks.limit(0, 3) == 1
    logits = torch.zeros(1, V)
    assert masks.restrict(logits) is logits and masks.all_ended()
    masks.release()
    assert not more.grammar.is_stopped() and more.grammar.validate_tokens(_ids(tok, "c")) == 1


# ---------------------------------------------------------------------------- drafters under a grammar


BLOCKS = {
    "dspark": dspark.DSparkConfig(block_size=4, num_layers=1, rank=32, max_anchors=16),
    "dspark-small-vocab": dspark.DSparkConfig(block_size=4, num_layers=1, rank=32, max_anchors=16, draft_vocab_size=160),
    "dflash": dflash.DFlashConfig(block_size=4, num_layers=1, max_anchors=16),
    "eagle3": eagle3.Eagle3Config(ttt_steps=1),
    "eagle3-small-vocab": eagle3.Eagle3Config(ttt_steps=1, draft_vocab_size=160),
}
KINDS = [*BLOCKS, "draft-model"]


@pytest.fixture(scope="module")
def draft_target(tiny_model_dir):
    return _with_bpe(tiny_model_dir(seed=3))


def _counts(tok, V: int) -> torch.Tensor:
    """Token counts that make a reduced vocabulary of 160 a scattered set of ids: the letters of
    the tests' grammars and "Ġ" in it, the space and EOS not (a row whose grammar allows only
    those can draft nothing)."""
    counts = torch.randperm(V, generator=torch.Generator().manual_seed(5)).float()
    counts[_ids(tok, "abcdefghlorwdĠ")] += 1e6
    counts[[_ids(tok, " ")[0], tok.eos_token_id]] = -1.0
    return counts


def _drafter(name: str, target, draft_target, masks: bool = True):
    """An untrained drafter of kind `name` (random weights: its unmasked drafts are nearly all
    refused; DSpark's sequential stage made non-zero so that a masked draft feeds the next)."""
    torch.manual_seed(0)
    if name == "draft-model":
        d = DraftModelDrafter(draft_target.model, target.model.config.vocab_size, 8, 128)
    else:
        cfg = BLOCKS[name]
        model = {"dspark": dspark, "dflash": dflash, "eagle3": eagle3}[cfg.kind].build(target.model, cfg)
        if getattr(cfg, "draft_vocab_size", None):
            model.init_draft_vocab(_counts(target.tokenizer, target.model.config.vocab_size))
        if cfg.kind == "dspark":
            torch.nn.init.normal_(model.seq_head.w2.weight, std=2.0)
        d = model.make_drafter(target.model, 8, 128)
    d.grammar_masks = masks
    return d


def test_the_reduced_vocabularies_are_scattered(bpe, draft_target):
    for name in ("dspark-small-vocab", "eagle3-small-vocab"):
        d = _drafter(name, bpe, draft_target)
        ids = (d.backbone.draft_ids if name.startswith("dspark") else d.model.draft_ids).tolist()
        assert len(ids) == 160 and ids != list(range(160)) and bpe.tokenizer.eos_token_id not in ids, name


GREEDY_PROMPTS = ["hello world", "world", "abc", "h"]
GREEDY_SPECS = (WORDS, PAIRS, RECORD)


def _greedy(spec) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=spec)


@pytest.fixture(scope="module")
def plain_greedy(bpe) -> list[list[list[int]]]:
    """Plain greedy token ids of GREEDY_PROMPTS under each of GREEDY_SPECS, decoded once for the
    module (on one thread, as the tests run): the reference of every drafter kind below."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [[o.outputs[0].token_ids for o in LLM(bpe, max_batch=4, max_len=128).generate(GREEDY_PROMPTS, _greedy(spec))]
                for spec in GREEDY_SPECS]
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("name", KINDS)
def test_greedy_equals_plain_and_masked_drafts_are_never_refused(name, bpe, draft_target, plain_greedy, monkeypatch):
    """Greedy, four rows at once, three grammars: the same tokens as plain decoding; with masks no
    draft is cut for the grammar and more are accepted than unmasked. Seen (untrained drafters):
    7-74 drafts accepted masked, 0 (once 1) unmasked."""
    cuts, _ = count_grammar_cuts(monkeypatch)
    prompts = GREEDY_PROMPTS
    for spec, plain in zip(GREEDY_SPECS, plain_greedy):
        sp = _greedy(spec)
        accepted = {}
        for masks in (True, False):
            cuts.clear()
            llm = LLM(bpe, drafter=_drafter(name, bpe, draft_target, masks), policy="fixed", num_speculative_tokens=4,
                      max_batch=4, max_len=128, forced_drafts=0)
            outs = llm.generate(prompts, sp)
            assert [o.outputs[0].token_ids for o in outs] == plain, (name, spec.kind, masks)
            accepted[masks] = llm.last_stats.draft_accepted
            if masks:
                assert sum(cuts) == 0 and llm.last_stats.draft_proposed > 0, (name, spec.kind)
        assert accepted[True] > accepted[False], (name, spec.kind, accepted)


class UnmaskedQ:
    """Control: the drafts drawn under the grammar's mask, the q reported the unmasked drafter's
    (a drafter that forgot to mask the distribution it reports)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def draft(self, hidden, anchors, params, uniforms, stop=None, masks=None):
        tokens, q, conf = self.sampler.draft(hidden, anchors, params, uniforms, stop, masks)
        _, q_free, _ = self.sampler.draft(hidden, anchors, params, uniforms, stop)
        return tokens, q_free[:, : tokens.shape[1]], conf


@pytest.mark.parametrize("name", ["dspark-small-vocab", "dflash", "eagle3-small-vocab", "draft-model"])
def test_masked_sampled_drafts_keep_the_masked_targets_law(name, bpe_pit, draft_target):
    """T = 1, sampled drafts under PAIRS: the PIT of the outputs against the masked target is uniform.
    Seen: see the asserts' messages (run with -s)."""
    outs, stats = _sample(bpe_pit, _drafter(name, bpe_pit, draft_target), PAIRS)
    proposed, accepted = sum(s["draft_proposed"] for s in stats), sum(s["draft_accepted"] for s in stats)
    assert proposed > 300 and accepted > 200, (proposed, accepted)
    u = _pit(bpe_pit, outs, specs=[PAIRS])
    print(f"{name}: {accepted}/{proposed} drafts accepted, {len(u)} tokens, PIT p {uniform_pvalue(u, 20):.2g}")
    assert len(u) > 500 and uniform_pvalue(u, 20) >= ALPHA, (len(u), uniform_pvalue(u, 20))


@pytest.mark.parametrize("name", ["dspark-small-vocab", "dflash", "eagle3-small-vocab", "draft-model"])
def test_a_mixed_batch_drafts_each_row_by_its_own_rule(name, bpe, draft_target):
    """Sampled rows under two grammars (the WORDS rows reach states where only a space or EOS may
    follow, which a scattered reduced vocabulary does not hold: those rows keep no drafts), a
    sampled row without a grammar, and greedy rows under a grammar: every output keeps its grammar
    and the greedy rows equal plain decoding's."""
    prompts = ["hello world", "hello", "abc", "world", "h"]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=1, structured_outputs=WORDS),
              SamplingParams(max_tokens=24, temperature=1.0, seed=2, structured_outputs=PAIRS),
              SamplingParams(max_tokens=12, temperature=1.0, seed=3),
              SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=WORDS),
              SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=PAIRS)]
    llm = LLM(bpe, drafter=_drafter(name, bpe, draft_target), policy="fixed", num_speculative_tokens=4, max_batch=8,
              max_len=128, forced_drafts=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert llm.last_stats.draft_accepted > 0
    for o, p in zip(outs, params):
        if p.structured_outputs is not None and o.finish_reason == "stop":
            assert re.fullmatch(p.structured_outputs.regex, o.text), (name, o.text)
    plain = LLM(bpe, max_batch=8, max_len=128).generate(prompts[3:], params[3:])
    assert [o.token_ids for o in outs[3:]] == [o.outputs[0].token_ids for o in plain]


def test_matchers_are_rolled_back_when_drafting_raises(bpe, draft_target, monkeypatch):
    """An error in the middle of a drafting round (after drafts were consumed) leaves every
    matcher where the committed output put it. Control: without the rollback they are not."""
    import draftsmith.core.draft_masks as dm

    V = bpe.model.config.vocab_size
    seen, real_consume = [], dm.DraftMasks.consume

    def consume_then_fail(self, tokens, rows=None):
        real_consume(self, tokens, rows)
        if not seen:
            seen.extend((m, allowed_now(m, V)) for m in self.matchers if m is not None)  # (after consuming)
        if sum(self.consumed) >= 2:
            raise RuntimeError("drafting failed")

    def masks_at_start(self, *a, **k):
        real_init(self, *a, **k)
        starts.append([(m, allowed_now(m, V)) for m in self.matchers if m is not None])

    starts, real_init = [], dm.DraftMasks.__init__
    monkeypatch.setattr(dm.DraftMasks, "__init__", masks_at_start)
    monkeypatch.setattr(dm.DraftMasks, "consume", consume_then_fail)
    sp = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=PAIRS)
    for release in (True, False):
        if not release:
            monkeypatch.setattr(dm.DraftMasks, "release", lambda self: None)
        starts.clear()
        llm = LLM(bpe, drafter=_drafter("dspark", bpe, draft_target), policy="fixed", num_speculative_tokens=4,
                  max_batch=4, max_len=128, forced_drafts=0)
        with pytest.raises(Exception, match="drafting failed"):
            llm.generate(["abc", "aeb"], sp)
        back = [torch.equal(allowed_now(m, V), a) and not m.is_error() for m, a in starts[-1]]
        assert all(back) if release else not all(back), (release, back)


def test_the_control_with_the_unmasked_q_is_not_lossless(bpe_pit, draft_target):
    """Masked drafts verified against the unmasked q: accepted far too often. Seen: p = 1e-259."""
    d = _drafter("dspark", bpe_pit, draft_target)
    assert isinstance(d, BlockDrafter)
    d.sampler = UnmaskedQ(d.sampler)
    outs, _ = _sample(bpe_pit, d, PAIRS)
    assert uniform_pvalue(_pit(bpe_pit, outs, specs=[PAIRS]), 20) < 1e-8
