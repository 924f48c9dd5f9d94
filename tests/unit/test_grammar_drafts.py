"""Drafts from a request's grammar (core/grammar_drafts.py): the tokens it forces are drafted and
verified, drafts it refuses are cut before the forward. On a tokenizer with merges, where forced
text has several tokenizations and llguidance drafts the canonical one: greedy outputs equal
with and without forced drafts and sampling at T = 1 is the grammar-masked target's distribution
(PIT); sampled drafts the grammar refuses are verified up to the first, and the control that
cuts that one too is far from the target's law."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from draftsmith import LLM, DraftsmithError, SamplingParams, StructuredOutputsParams as SO
from draftsmith.core.grammar_drafts import fit_forced, forced_drafts, grammar_lengths, with_forced
from draftsmith.core.request import Request
from draftsmith.core.structured import Grammars, allowed_now
from draftsmith.core.types import Proposal
from draftsmith.drafters.base import pad_proposal
from draftsmith.models.target import load_target
from draftsmith.policy.prefix_scheduler import PrefixScheduler
from draftsmith.policy.profile import SPSTable
from test_engine_pit import SHARPEN, _scale_lm_head, uniform_pvalue  # noqa: E402
from test_structured import GrammarDrafter, _pit  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ALPHA = 1e-6  # as test_engine_pit.py
MERGES = [("h", "e"), ("l", "l"), ("e", "l"), ("l", "o"), ("w", "o"), ("o", "r"), ("l", "d"), ("Ġ", "h"), ("Ġ", "w")]
WORDS = SO(regex=r"(hello|world)( (hello|world)){0,7}")  # after a word's first letter the rest is forced
PAIRS = SO(regex=r"([a-d][e-h])+")  # nothing forced


def _bpe_tokenizer() -> PreTrainedTokenizerFast:
    """conftest's byte-level tokenizer with a few merges (ids 259-267, inside the tiny vocab):
    "ello" is e|ll|o, el|lo, e|l|lo, ... and llguidance drafts its canonical e|ll|o."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for special in ("<|endoftext|>", "<|im_end|>", "<|im_start|>"):  # the byte tokenizer's ids 256-258
        vocab[special] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])


def _with_bpe(path):
    _bpe_tokenizer().save_pretrained(str(path))
    return load_target(str(path))


@pytest.fixture(scope="module")
def bpe(tiny_model_dir):
    return _with_bpe(tiny_model_dir(seed=0))


@pytest.fixture(scope="module")
def bpe_pit(tiny_model_dir):
    return _with_bpe(_scale_lm_head(tiny_model_dir(seed=0), SHARPEN))


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _request(target, spec: SO | None, output: str = "") -> Request:
    g = Grammars(target.tokenizer, target.model.config.vocab_size, [target.tokenizer.eos_token_id])
    s = Request("r", [1], SamplingParams(structured_outputs=spec), None, grammar=g.matcher(spec) if spec else None)
    if output:
        s.output_ids = _ids(target.tokenizer, output)
        assert s.grammar.consume_tokens(s.output_ids)
    return s


def test_forced_drafts_are_the_canonical_tokens_of_the_forced_text(bpe):
    tok = bpe.tokenizer
    after_h, nothing, no_grammar = _request(bpe, WORDS, "h"), _request(bpe, WORDS, "hello"), _request(bpe, None)
    assert tok.convert_ids_to_tokens(forced_drafts([after_h], [8])[0]) == ["e", "ll", "o"]
    assert forced_drafts([after_h, nothing, no_grammar], [2, 8, 8]) == [_ids(tok, "ell"), [], []]
    assert forced_drafts([after_h], [0]) == [[]]
    (ended,) = [_request(bpe, SO(regex="ab"), "ab")]
    assert ended.grammar.consume_token(tok.eos_token_id) and ended.grammar.is_stopped()
    assert forced_drafts([ended], [8]) == [[]]  # a finished grammar forces nothing


def test_drafts_are_cut_at_the_first_one_the_grammar_refuses(bpe):
    """Deterministic drafts stop before it (a rejected one-hot draft leaves p itself, which gives it
    0), sampled ones keep it (its rejection samples the residual); a row without a grammar keeps
    all; a grammar that has ended keeps one EOS draft (llguidance's validate_tokens counts none)."""
    tok = bpe.tokenizer
    eos = tok.eos_token_id
    pairs, free, ended = _request(bpe, PAIRS), _request(bpe, None), _request(bpe, SO(regex="ab"), "ab")
    drafts = [_ids(tok, "aezb"), _ids(tok, "aezb"), [eos, 5, 6, 7]]
    det = pad_proposal(drafts)
    assert grammar_lengths([pairs, free, ended], det, {eos}) == [2, 4, 1]
    sampled = pad_proposal(drafts, [torch.full((4, 272), 1 / 272)] * 3)
    assert grammar_lengths([pairs, free, ended], sampled, {eos}) == [3, 4, 2]
    assert grammar_lengths([ended], pad_proposal([_ids(tok, "a")]), {eos}) == [0]
    cut = det.truncated([2, 4, 1])
    assert cut.max_len == 4 and cut.lengths.tolist() == [2, 4, 1] and torch.equal(cut.tokens, det.tokens)
    assert det.truncated([2, 1, 0]).max_len == 2 and det.truncated([4, 4, 4]) is det
    assert pairs.grammar.validate_tokens(_ids(tok, "ae")) == 2  # the matcher did not move


def test_forced_rows_replace_empty_rows_with_one_hot_q_and_full_confidence():
    V = 10
    drafted = pad_proposal([[1, 2], []], [torch.full((2, V), 0.1), torch.zeros(0, V)])
    drafted = Proposal(drafted.tokens, drafted.lengths, drafted.q, confidences=torch.tensor([[0.75, 0.5], [0.0, 0.0]]))
    out = with_forced(drafted, [[], [7, 8, 9]])
    assert out.lengths.tolist() == [2, 3] and out.tokens[1].tolist() == [7, 8, 9]
    assert out.tokens[0, :2].tolist() == [1, 2] and torch.equal(out.q[0, :2], drafted.q[0])
    assert torch.equal(out.q[1].argmax(-1), torch.tensor([7, 8, 9])) and torch.equal(out.q[1].sum(-1), torch.ones(3))
    assert out.confidences.tolist() == [[0.75, 0.5, 0.0], [1.0, 1.0, 1.0]]
    assert with_forced(drafted, [[], []]) is drafted
    with pytest.raises(RuntimeError, match="drafts of its own and 1 of another source"):
        with_forced(drafted, [[3], []])


def test_greedy_outputs_are_the_same_with_and_without_forced_drafts(bpe):
    """Plain and n-gram, several rows at once: the same tokens whether the grammar's forced tokens
    are drafted or not; with them on, forced drafts were verified (and counted apart from the
    drafter's), and the rounds that did took fewer forwards."""
    prompts = ["hello world", "world", "hello hello", "abc"]
    specs = [WORDS, SO(json={"type": "object", "properties": {"greeting": {"enum": ["hello", "world"]}},
                             "required": ["greeting"]}, disable_any_whitespace=True)]
    for spec in specs:
        sp = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=spec)
        for drafter in ("none", "ngram"):
            runs = {}
            for n in (0, 16):
                llm = LLM(bpe, drafter=drafter, policy="fixed", num_speculative_tokens=3, max_batch=4, max_len=128,
                          forced_drafts=n)
                outs = [o.outputs[0] for o in llm.generate(prompts, sp)]
                runs[n] = ([o.token_ids for o in outs], sum(o.stats["forced_proposed"] for o in outs),
                           sum(o.stats["forced_accepted"] for o in outs), sum(o.stats["rounds"] for o in outs))
            assert runs[16][0] == runs[0][0], (spec, drafter)
            assert runs[0][1] == 0 and runs[16][1] > 0 and runs[16][2] > 0, (spec, drafter, runs)
            assert runs[16][3] < runs[0][3], (spec, drafter, runs)


N_REQ = 64


def _sample(target, drafter=None, spec: SO = WORDS, n: int = N_REQ, max_batch: int = 8):
    llm = LLM(target, drafter=drafter, policy="fixed", num_speculative_tokens=4, max_batch=max_batch, max_len=128,
              reproducible_seeds=False)
    tok = target.tokenizer
    prompts = [_ids(tok, ("hello ", "world ", "h", "w")[i % 4] * (1 + i % 3)) for i in range(n)]
    params = [SamplingParams(max_tokens=30, seed=700 + i, temperature=1.0, structured_outputs=spec) for i in range(n)]
    outs = llm.generate(prompts, params)
    return outs, [o.outputs[0].stats for o in outs]


def test_sampling_with_forced_drafts_is_the_masked_targets_distribution(bpe_pit):
    """Seen: 761 tokens, 449 forced drafts, all accepted (where llguidance forces bytes its mask
    allows only their canonical tokens, so the masked target cannot pick another tokenization);
    PIT p-value 0.89. Control: the same tokens against the unmasked target, p = 0."""
    outs, stats = _sample(bpe_pit, max_batch=1)  # one row: no other row's forward to widen
    proposed, accepted = sum(s["forced_proposed"] for s in stats), sum(s["forced_accepted"] for s in stats)
    assert proposed > 300 and accepted > 0, (proposed, accepted)
    u = _pit(bpe_pit, outs, specs=[WORDS])
    assert len(u) > 500 and uniform_pvalue(u, 20) >= ALPHA
    assert uniform_pvalue(_pit(bpe_pit, outs, constrained=False, specs=[WORDS]), 20) < 1e-12


def count_grammar_cuts(monkeypatch) -> tuple[list[int], object]:
    """Wraps the engine's grammar_lengths: per round, how many drafts it cut (appended to the list
    returned), and the real function (to put back)."""
    import draftsmith.engine.engine as engine_mod

    cuts, real = [], engine_mod.grammar_lengths

    def counting(seqs, proposal, eos_token_ids):
        out = real(seqs, proposal, eos_token_ids)
        cuts.append(sum(proposal.lengths.tolist()) - sum(out))
        return out

    monkeypatch.setattr(engine_mod, "grammar_lengths", counting)
    return cuts, real


def HalfRefusedDrafter(V: int) -> GrammarDrafter:
    """Test drafter: each draft from q = 1/2 spread over the tokens the grammar allows, 1/2 over
    those it refuses (after a refused draft it goes on drafting from the state before it, so rows
    have drafts past their first refused one for the engine to cut). Where a refused draft was drawn the
    target must sample from the residual max(p - q, 0), which leaves out the allowed tokens p gives
    less than q: cutting the refused draft (sampling p there) changes the output law."""
    return GrammarDrafter(V, refused_mass=0.5, seed=11)


def test_a_refused_sampled_draft_is_verified_and_cutting_it_is_not_lossless(bpe, monkeypatch):
    """Sampled drafts, half of them refused by the grammar: the engine verifies each row up to and
    including its first refused draft, and the output is the masked target's law (PIT). Control:
    an engine that cuts the refused sampled draft too, as it rightly does deterministic ones.
    Seen: 2,985 tokens, 1,302 of the 3,299 drafts verified accepted, PIT p-value 0.55; the control 6e-13."""
    V = bpe.model.config.vocab_size
    import draftsmith.engine.engine as engine_mod

    cuts, real_lengths = count_grammar_cuts(monkeypatch)
    outs, stats = _sample(bpe, HalfRefusedDrafter(V), PAIRS, 3 * N_REQ)
    assert sum(cuts) > 500  # drafts past a refused one were cut before the forward
    monkeypatch.setattr(engine_mod, "grammar_lengths", real_lengths)
    assert 0 < sum(s["draft_accepted"] for s in stats) < 0.7 * sum(s["draft_proposed"] for s in stats)
    u = _pit(bpe, outs, specs=[PAIRS])
    assert len(u) > 2000 and uniform_pvalue(u, 20) >= ALPHA

    def as_if_deterministic(seqs, proposal, eos_token_ids):
        return grammar_lengths(seqs, replace(proposal, q=None), eos_token_ids)

    monkeypatch.setattr(engine_mod, "grammar_lengths", as_if_deterministic)
    outs, _ = _sample(bpe, HalfRefusedDrafter(V), PAIRS, 3 * N_REQ)
    assert uniform_pvalue(_pit(bpe, outs, specs=[PAIRS]), 20) < 1e-6


def test_forced_drafts_widen_the_forward_only_where_it_pays():
    """Without a cost model the block widens only where forced runs fill the extra columns, as if a
    forward cost time in proportion to its tokens (all of them at batch 1; on a batch only what
    every row fills, or what fits in the width the kept drafts already pay for). The prefix
    scheduler weighs the wider forward with its step times: every forced draft where a forward of
    17 tokens costs about one of 1, none where time grows with tokens."""
    assert fit_forced(1, [0], [12]) == [12]
    assert fit_forced(4, [0, 0, 0, 0], [5, 0, 2, 9]) == [0, 0, 0, 0]  # one row unforced: a wider forward loses
    assert fit_forced(3, [0, 0, 0], [5, 2, 3]) == [2, 2, 2]  # all forced: as wide as they all fill
    assert fit_forced(16, [0] * 16, [5] + [0] * 15) == [0] * 16
    assert fit_forced(16, [3] + [0] * 15, [0, 5] + [0] * 14) == [0, 3] + [0] * 14  # the kept drafts' width is paid
    flat = PrefixScheduler(SPSTable((1, 64), (100.0, 95.0)))
    seqs = [Request(f"r{i}", [1], SamplingParams(), None) for i in range(32)]
    assert flat.forced_lengths(seqs[:1], [0], [12]) == [12]
    assert flat.forced_lengths(seqs, [0] * 32, [4] * 32) == [4] * 32
    linear = PrefixScheduler(SPSTable((1, 32, 512), (100.0, 50.0, 3.0)))  # time ~ tokens past 32
    assert linear.forced_lengths(seqs[:1], [0], [12]) == [12]
    assert linear.forced_lengths(seqs, [0] * 32, [6] + [0] * 31) == [0] * 32
    assert linear.forced_lengths(seqs, [2] + [0] * 31, [0, 6] + [0] * 30) == [0, 2] + [0] * 30  # the width is paid


def _split(target):
    """engine.forced_drafts with every forced token split into its single bytes: drafts the mask
    refuses after their first byte (it allows only the canonical tokens), so forced drafts get
    rejected and the verification of forced rows is exercised."""
    import draftsmith.engine.engine as engine_mod

    real, tok = engine_mod.forced_drafts, target.tokenizer

    def split(seqs, caps):
        out = []
        for f, cap in zip(real(seqs, caps), caps):
            pieces = [tok.convert_tokens_to_ids(ch) for t in tok.convert_ids_to_tokens(f) for ch in t]
            out.append(pieces[:cap])
        return out

    return split


def test_rejected_forced_drafts_keep_greedy_and_sampled_outputs(bpe, monkeypatch):
    """Forced drafts that the target rejects (split into bytes the mask refuses): greedy outputs
    equal plain's without forced drafts, and sampling at T = 1 is the masked target's law.
    Seen at T = 1: 663 tokens, 176 of 790 split forced drafts accepted; PIT p-value 0.34."""
    import draftsmith.engine.engine as engine_mod

    prompts = ["hello world", "world", "hello hello", "abc"]
    sp = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=WORDS)
    plain = [o.outputs[0].token_ids for o in LLM(bpe, max_batch=4, max_len=128, forced_drafts=0).generate(prompts, sp)]
    monkeypatch.setattr(engine_mod, "forced_drafts", _split(bpe))
    for drafter in ("none", "ngram"):
        outs = LLM(bpe, drafter=drafter, policy="fixed", num_speculative_tokens=3, max_batch=4,
                   max_len=128).generate(prompts, sp)
        assert [o.outputs[0].token_ids for o in outs] == plain, drafter
        forced = [(o.outputs[0].stats["forced_accepted"], o.outputs[0].stats["forced_proposed"]) for o in outs]
        assert 0 < sum(a for a, _ in forced) < sum(p for _, p in forced), forced
    outs, stats = _sample(bpe, spec=WORDS, max_batch=1)
    proposed, accepted = sum(s["forced_proposed"] for s in stats), sum(s["forced_accepted"] for s in stats)
    assert proposed > 200 and 0 < accepted < 0.8 * proposed, (proposed, accepted)
    assert uniform_pvalue(_pit(bpe, outs, specs=[WORDS]), 20) >= ALPHA


def test_a_drafter_outside_the_vocabulary_is_refused_before_the_grammar_reads_it(bpe):
    """An id the target does not have is the drafter's error, said as such, not a grammar matcher
    broken by it (llguidance puts a matcher that reads one in an error state)."""
    V = bpe.model.config.vocab_size

    class OutOfRange(GrammarDrafter):
        def propose(self, seqs, max_lengths):
            return pad_proposal([[_ids(bpe.tokenizer, "a")[0], V + 5][:k] for k in max_lengths])

    llm = LLM(bpe, drafter=OutOfRange(V), policy="fixed", num_speculative_tokens=2, max_len=64)
    with pytest.raises(DraftsmithError, match="proposed token id .* does not match this target"):
        llm.generate(["ab", "cd"], SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=PAIRS))


def test_a_row_whose_grammar_engine_gives_up_reading_its_forced_tokens_is_renewed_without_them(bpe, monkeypatch):
    """Where the grammar engine gives up while the engine reads what a row's grammar forces (as
    llguidance may, its lexer work counted over a matcher's life; simulated here: the row's matcher
    is swapped for one that gave up, right after its forced tokens were read), the row is renewed
    at its output and verifies none of those forced tokens, that round or after (a renewed row
    drafts no more); its output is plain decoding's."""
    import draftsmith.engine.engine as engine_mod

    g = Grammars(bpe.tokenizer, bpe.model.config.vocab_size, [bpe.tokenizer.eos_token_id])
    gave_up = g.matcher(SO(regex="(b|ca{99999999})+"))
    for t in _ids(bpe.tokenizer, "caaaaaaaa"):  # (a mask read after each token: the engine gives up a few in)
        allowed_now(gave_up, bpe.model.config.vocab_size)
        if not gave_up.consume_token(t):
            break
    assert "LexerTooComplex" in gave_up.get_error()  # (the precondition: a matcher the engine gave up on)
    real, hit = forced_drafts, []

    def giving_up(seqs, caps):
        forced = real(seqs, caps)
        if not hit and forced[0]:
            hit.append(list(forced[0]))
            seqs[0].grammar = gave_up
        return forced

    sp = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=WORDS)
    (plain,) = LLM(bpe, max_batch=2, max_len=128, forced_drafts=0).generate(["hello world"], sp)
    monkeypatch.setattr(engine_mod, "forced_drafts", giving_up)
    llm = LLM(bpe, max_batch=2, max_len=128)
    s = llm.engine.add_request(_ids(bpe.tokenizer, "hello world"), sp)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert hit and s.grammar_renewals == 1 and s.grammar is not gave_up
    assert s.stats.forced_proposed == 0 and s.error is None
    assert s.output_ids == plain.outputs[0].token_ids and s.finish_reason == plain.outputs[0].finish_reason
