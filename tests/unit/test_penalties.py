"""Repetition / presence / frequency penalties (core/penalties.py) under speculative decoding:
the formulas position by position, greedy equality with HF transformers and with plain
decoding, and statistical losslessness at T = 1 (the PIT of test_engine_pit.py against the
penalised target), with two negative controls: the unpenalised target, and an engine that
penalises a whole verify block by the committed output only (ignoring the drafts before each
position: the count of tokens that repeat their round's earlier tokens sees it)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith import LLM, DraftsmithError, SamplingParams
from draftsmith.core.penalties import penalize
from draftsmith.core.request import Request
from draftsmith.core.warp import target_probs
from draftsmith.models.target import load_target
from draftsmith.drafters.registry import build_drafter
from test_engine_pit import SHARPEN, VOCAB, Probe, _scale_lm_head, _tiny, uniform_pvalue  # noqa: E402

PROMPTS = ["hello world, hello world, hello", "def f(x):\n    return x + 1\n", "abcabcabcabc"]
ALPHA = 1e-6  # as test_engine_pit.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _reference(logits: torch.Tensor, prompt: list[int], history: list[int], sp: SamplingParams) -> torch.Tensor:
    """The penalised logits [V] of one position after `history` (the output so far), by the formulas."""
    x = logits.clone().double()
    for t in set(prompt) | set(history):
        if sp.repetition_penalty != 1.0:
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(history):
        x[t] -= sp.frequency_penalty * history.count(t) + sp.presence_penalty
    return x


def test_penalize_follows_the_formulas_position_by_position():
    g = torch.Generator().manual_seed(0)
    V, S = 10, 4
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.3),
              SamplingParams(),  # no penalty: untouched
              SamplingParams(frequency_penalty=-0.5, presence_penalty=1.5)]
    seqs = [Request(f"r{b}", prompt_ids=[3, 3, 9], params=p, generator=None, output_ids=[1, 1, 2][: 3 - b])
            for b, p in enumerate(params)]
    drafts = torch.tensor([[4, 1, 2], [0, 0, 0], [2, 2, -1]])  # -1: padding past a row's drafts
    logits = torch.randn(3, S, V, generator=g) * 3
    got = penalize(logits, seqs, drafts)
    for b, s in enumerate(seqs):
        for j in range(S - (b == 2)):  # row 2 has two drafts: its last position is never used
            want = _reference(logits[b, j], s.prompt_ids, s.output_ids + drafts[b, :j].tolist(), s.params)
            torch.testing.assert_close(got[b, j].double(), want, atol=1e-5, rtol=0)
    assert torch.equal(got[1], logits[1])
    assert penalize(logits, [seqs[1]] * 3, drafts) is logits  # nothing to do: no copy


def test_logit_bias_everywhere_and_min_tokens_by_position():
    """logit_bias at every position; min_tokens masks the ends (EOS 7 and stop token 8) at the
    positions whose token would be output token < min_tokens: position j is output token n + j."""
    V, S = 10, 4
    logits = torch.randn(2, S, V, generator=torch.Generator().manual_seed(1))
    seqs = [Request("a", [1], SamplingParams(max_tokens=9, min_tokens=4, stop_token_ids=(8,), logit_bias={2: 5.0, 3: -1.5}),
                    None, output_ids=[0, 5]),
            Request("b", [1], SamplingParams(max_tokens=9, min_tokens=2), None, output_ids=[0, 5])]
    got = penalize(logits, seqs, torch.tensor([[1, 2, 3], [1, 2, 3]]), eos_token_ids=(7,))
    want = logits.clone()
    want[0, :, 2] += 5.0
    want[0, :, 3] -= 1.5
    want[0, :2, 7] = want[0, :2, 8] = float("-inf")  # output tokens 2 and 3 may not end it; 4 on may
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("bad,says", [(dict(repetition_penalty=0.0), "penalty must be"),
                                      (dict(repetition_penalty=float("nan")), "penalty must be"),
                                      (dict(presence_penalty=2.5), "penalty must be"),
                                      (dict(frequency_penalty=-3.0), "penalty must be"),
                                      (dict(logit_bias={3: 101.0}), r"\[-100, 100\]"),
                                      (dict(logit_bias={"x": 1.0}), "map token ids"),
                                      (dict(allowed_token_ids=[]), "non-empty list of token ids"),
                                      (dict(bad_words="word"), "list of non-empty strings"),
                                      (dict(min_tokens=200), r"min_tokens must be an integer in \[0, max_tokens"),
                                      (dict(min_tokens=-1), "min_tokens must be")])
def test_bad_adjustments_say_the_range(bad, says):
    with pytest.raises(DraftsmithError, match=says):
        SamplingParams(max_tokens=100, **bad)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama", seed=0)


def test_greedy_repetition_penalty_equals_hf_and_plain(tiny):
    """HF's RepetitionPenaltyLogitsProcessor (prompt + output tokens) gives plain decoding's
    tokens; n-gram and self-drafting give plain's; and the penalty changes the output (control)."""
    sp = SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.5)
    plain = LLM(str(tiny), max_batch=4, max_len=256).generate(PROMPTS, sp)
    unpenalised = LLM(str(tiny), max_batch=4, max_len=256).generate(PROMPTS, SamplingParams(max_tokens=40,
                                                                                           temperature=0.0))
    assert any(a.token_ids != b.token_ids for a, b in zip(plain, unpenalised))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    for o in plain:
        ids = torch.tensor([o.prompt_token_ids])
        ref = hf.generate(ids, max_new_tokens=40, do_sample=False, repetition_penalty=1.5, eos_token_id=None,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
        n = len(o.token_ids)  # plain stops at EOS; HF was told no EOS
        assert o.token_ids == ref[:n]
    for drafter in ("ngram", f"draft-model:{tiny}"):
        llm = LLM(str(tiny), drafter=drafter, policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=256,
                  drafter_dtype="float32")
        assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == [o.token_ids for o in plain]
        assert llm.last_stats.draft_accepted > 0


def test_greedy_presence_and_frequency_penalties_equal_plain(tiny):
    sp = SamplingParams(max_tokens=40, temperature=0.0, presence_penalty=0.7, frequency_penalty=0.6)
    plain = LLM(str(tiny), max_batch=4, max_len=256).generate(PROMPTS, sp)
    llm = LLM(str(tiny), drafter=f"draft-model:{tiny}", policy="fixed", num_speculative_tokens=4, max_batch=4,
              max_len=256, drafter_dtype="float32")
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == [o.token_ids for o in plain]
    assert llm.last_stats.draft_accepted > 0


def test_greedy_logit_bias_and_min_tokens_equal_plain(tiny):
    """logit_bias +100 makes a token the only greedy choice, -100 removes one; min_tokens keeps a
    stop token (the most frequent greedy token) out of the first tokens. Speculative = plain for
    every min_tokens 1..9, so a block that straddles the boundary is masked position by position."""
    plain_llm = LLM(str(tiny), max_batch=4, max_len=256)
    spec_llm = LLM(str(tiny), drafter=f"draft-model:{tiny}", policy="fixed", num_speculative_tokens=4, max_batch=4,
                   max_len=256, drafter_dtype="float32")
    free = plain_llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    (forced,) = plain_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, logit_bias={65: 100.0}))
    assert forced.token_ids == [65] * 8
    first = free[0].token_ids[0]
    banned = spec_llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, logit_bias={first: -100.0}))
    assert all(first not in o.token_ids for o in banned)
    stop = max(set(free[0].token_ids), key=free[0].token_ids.count)
    for m in range(1, 10):
        sp = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop,), min_tokens=m)
        plain = plain_llm.generate(PROMPTS, sp)
        assert all(len(o.token_ids) >= m and stop not in o.token_ids[: m - 1] for o in plain)
        assert [o.token_ids for o in spec_llm.generate(PROMPTS, sp)] == [o.token_ids for o in plain], m
    assert spec_llm.last_stats.draft_accepted > 0
    with pytest.raises(DraftsmithError, match="logit_bias: token id 9999 is outside"):
        plain_llm.generate(["x"], SamplingParams(max_tokens=4, logit_bias={9999: 1.0}))


def test_allowed_token_ids_and_bad_words_by_position():
    """allowed_token_ids masks every other token everywhere; a bad word [5, 6] bans 6 at the
    positions whose context (output, then drafts 0..j-1) ends with 5, a one-token bad word [9]
    everywhere."""
    g = torch.Generator().manual_seed(2)
    V, S = 10, 4
    seqs = [Request("w", [1], SamplingParams(), None, output_ids=[3, 5], bad_words_ids=[[5, 6], [9]]),
            Request("a", [1], SamplingParams(allowed_token_ids=(7, 2, 3)), None, output_ids=[3])]
    drafts = torch.tensor([[6, 5, 2], [0, 0, 0]])
    logits = torch.randn(2, S, V, generator=g)
    got = penalize(logits, seqs, drafts)
    banned6 = [torch.isinf(got[0, j, 6]).item() for j in range(S)]
    assert banned6 == [True, False, True, False]  # contexts end ...5 | 5,6 | 6,5 | 5,2
    assert torch.isinf(got[0, :, 9]).all()
    keep = [t for t in range(V) if t not in (6, 9)]
    assert torch.equal(got[0][:, keep], logits[0][:, keep])
    assert set(torch.isfinite(got[1]).all(0).nonzero().flatten().tolist()) == {2, 3, 7}
    assert torch.equal(got[1][:, [2, 3, 7]], logits[1][:, [2, 3, 7]])
    # allowed {2, 3} and every two-token word of them banned: after output [.., 2] both would go,
    # so the bans give way there (p stays defined); where one is left they hold
    boxed = Request("x", [1], SamplingParams(allowed_token_ids=(2, 3)), None, output_ids=[2],
                    bad_words_ids=[[2, 2], [2, 3], [3, 2]])
    got = penalize(logits[:1], [boxed], torch.tensor([[3, 3, 3]]))
    assert torch.isfinite(got[0, 0, [2, 3]]).all()  # after 2: both banned -> neither is
    assert torch.isinf(got[0, 1, 2]) and torch.isfinite(got[0, 1, 3])  # after 3: only 2 is banned


def test_greedy_allowed_token_ids_and_bad_words_equal_plain(tiny):
    """The tokens plain decoding picks under allowed_token_ids / bad_words (each word alone and
    after a space) are n-gram and draft-model speculation's; the constraints bite (controls)."""
    plain_llm = LLM(str(tiny), max_batch=4, max_len=256)
    free = plain_llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    tok = plain_llm.tokenizer
    pairs = [o.token_ids[i: i + 2] for o in free for i in range(len(o.token_ids) - 1)]
    pair = next(p for p in pairs if (w := tok.decode(p)).isascii() and w.isprintable() and " " not in w)
    word = tok.decode(pair)  # two tokens plain decoding writes (ASCII: they tokenize back the same)
    allowed = tuple(sorted(set(free[1].token_ids[:3]) | {70, 71}))
    cases = [SamplingParams(max_tokens=24, temperature=0.0, bad_words=(word,)),
             SamplingParams(max_tokens=24, temperature=0.0, allowed_token_ids=allowed)]
    plain = [plain_llm.generate(PROMPTS, sp) for sp in cases]
    assert all(o.token_ids[i: i + 2] != pair for o in plain[0] for i in range(len(o.token_ids)))
    assert [o.token_ids for o in plain[0]] != [o.token_ids for o in free]
    assert all(set(o.token_ids) <= set(allowed) for o in plain[1])
    for drafter in ("ngram", f"draft-model:{tiny}"):
        llm = LLM(str(tiny), drafter=drafter, policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=256,
                  drafter_dtype="float32")
        for sp, want in zip(cases, plain):
            assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == [o.token_ids for o in want], drafter
    # each word alone and after a space, however the user spaced it (vLLM's two spellings)
    eng = plain_llm.engine
    assert eng._bad_words_ids((" ab",)) == eng._bad_words_ids(("ab",)) == [tok.encode("ab", add_special_tokens=False),
                                                                            tok.encode(" ab", add_special_tokens=False)]
    with pytest.raises(DraftsmithError, match="allowed_token_ids: token id 9999 is outside"):
        plain_llm.generate(["x"], SamplingParams(max_tokens=4, allowed_token_ids=(9999,)))
    with pytest.raises(DraftsmithError, match="leaves no token"):
        (a,) = tok.encode("A", add_special_tokens=False)
        plain_llm.generate(["x"], SamplingParams(max_tokens=4, allowed_token_ids=(a,), bad_words=("A",)))


# ---- statistical losslessness at T = 1 ------------------------------------------------------

N_REQ, MAX_BATCH, MAX_LEN, K = 48, 8, 96, 4
PEN = [dict(repetition_penalty=3.0), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
       dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0)]


@pytest.fixture(scope="module")
def pit_target(tiny_model_dir):
    return load_target(str(_scale_lm_head(_tiny(tiny_model_dir, 0), SHARPEN)))


@pytest.fixture(scope="module")
def pit_drafter(tiny_model_dir):
    return str(_scale_lm_head(_tiny(tiny_model_dir, 0), 0.6 * SHARPEN, noise=0.05, seed=1))


def _penalised_run(target, drafter: str):
    """→ (outputs, params, slots): slots[b][t] = the position of token t in its verification round."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (2 + (5 * i) % 13,), generator=g).tolist() for i in range(N_REQ)]
    params = [SamplingParams(max_tokens=34 + (11 * i) % 30, seed=1000 + i, ignore_eos=True, **PEN[i % len(PEN)])
              for i in range(N_REQ)]
    probe = Probe(build_drafter(f"draft-model:{drafter}", target, MAX_BATCH, MAX_LEN))
    llm = LLM(target, drafter=probe, policy="fixed", num_speculative_tokens=K, max_batch=MAX_BATCH,
              max_len=MAX_LEN, reproducible_seeds=False)
    outs = llm.generate(prompts, params)
    assert 0.1 < llm.last_stats.acceptance_rate < 0.95
    slots = [torch.cat([torch.arange(m + 1) for m, _ in probe.rounds[o.request_id]]) for o in outs]
    return outs, params, slots


def _conditionals(target, outs, params, slots, penalised: bool = True):
    """Every generated token x_t with p_t, the teacher-forced target's distribution (T = 1) with
    the penalties of the output before t (by `_reference`) or without them, and the tokens
    already committed in t's verification round (fixed by the past: the round's start is).
    Yields (x_t, p_t [V] float64, earlier tokens of the round)."""
    m = target.model
    for o, sp, slot in zip(outs, params, slots):
        seq = o.prompt_token_ids + o.token_ids
        with torch.no_grad():
            logits = m(torch.tensor([seq]), m.new_cache(1, len(seq))).logits[0]
        n0 = len(o.prompt_token_ids)
        for t, x in enumerate(o.token_ids):
            z = logits[n0 - 1 + t]
            if penalised:
                z = _reference(z, o.prompt_token_ids, o.token_ids[:t], sp).float()
            p = target_probs(z[None, None], [SamplingParams(temperature=1.0)])[0, 0].double()
            yield x, p, sorted(set(o.token_ids[t - int(slot[t]): t]))


def _pit(target, outs, params, slots, penalised: bool = True) -> torch.Tensor:
    """u_t = F_t(x_t-) + V p_t(x_t) (test_engine_pit.pit) for every generated token, F_t in
    "round order": the tokens already committed in t's round first (then p descending, then
    id). u is uniform for a lossless engine; an engine that forgets those tokens when
    penalising position t gives them too much mass: u piles up near 0."""
    us = []
    gen = torch.Generator().manual_seed(99)
    for x, p, earlier in _conditionals(target, outs, params, slots, penalised):
        ids = torch.arange(len(p))
        by_p = (p > p[x]) | ((p == p[x]) & (ids < x))
        in_round = torch.zeros(len(p), dtype=torch.bool)
        in_round[earlier] = True
        before = (in_round & ~in_round[x]) | ((in_round == in_round[x]) & by_p)
        us.append(float((p * before).sum() + torch.rand(1, generator=gen, dtype=torch.float64) * p[x]))
    return torch.tensor(us)


def _pvalues(target, outs, params, slots, penalised: bool = True) -> tuple[float, float]:
    """(all tokens, the tokens after a draft in their round: slot >= 1)."""
    u, slot = _pit(target, outs, params, slots, penalised), torch.cat(slots)
    return uniform_pvalue(u, 20), uniform_pvalue(u[slot >= 1], 10)


def _repeat_z(target, outs, params, slots) -> float:
    """How many tokens after a draft (slot >= 1) repeat a token committed earlier in their round,
    against what the penalised target expects: the sum of p_t(the round's earlier tokens), a set
    the past fixes, so for a lossless engine (observed - expected) / sd is ~N(0, 1)."""
    obs = exp = var = 0.0
    for x, p, earlier in _conditionals(target, outs, params, slots):
        if earlier:
            q = float(p[earlier].sum())
            obs, exp, var = obs + (x in earlier), exp + q, var + q * (1 - q)
    return (obs - exp) / var ** 0.5


def test_penalised_sampling_is_lossless_and_the_controls_fail(pit_target, pit_drafter, monkeypatch):
    """Seen: PIT p-values 0.84 / 0.35 (all tokens / slot >= 1), repeat z -0.44; against the
    unpenalised target 0.0 / 0.0; the block-wide bug: PIT 2e-5 / 3e-10, repeat z 11.0 (399
    repeats where 284 were due)."""
    run = _penalised_run(pit_target, pit_drafter)
    assert min(_pvalues(pit_target, *run)) >= ALPHA
    assert abs(_repeat_z(pit_target, *run)) < 5
    # control 1: against the unpenalised target the same tokens are far from uniform
    assert _pvalues(pit_target, *run, penalised=False)[0] < 1e-12
    # control 2: an engine that penalises every position of a block by the committed output only
    import draftsmith.engine.engine as engine_mod

    monkeypatch.setattr(engine_mod, "penalize", lambda logits, seqs, drafts, eos: _blockwide(logits, seqs))
    assert _repeat_z(pit_target, *_penalised_run(pit_target, pit_drafter)) > 8


def _blockwide(logits: torch.Tensor, seqs) -> torch.Tensor:
    """BROKEN (test-only): every position of the block penalised as if no draft came before it."""
    S = logits.shape[1]
    return torch.cat([penalize(logits[:, j: j + 1], seqs, None) for j in range(S)], dim=1)
