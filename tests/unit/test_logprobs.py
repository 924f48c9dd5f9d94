"""Log probabilities of generated tokens (`SamplingParams(logprobs=k)`): the target's raw
log_softmax at each generated position, equal to HF transformers' teacher-forced logits, the
same with speculative decoding as without."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith import LLM, DraftsmithError, SamplingParams

PROMPTS = ["hello world, hello world, hello", "def f(x):\n    return x + 1\n", "abcabcabcabc"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama", seed=0)


@pytest.fixture(scope="module")
def hf_logprobs(tiny):
    hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()

    def run(prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        """HF's log_softmax(logits / temperature) at the positions that predicted output_ids: [n, V]."""
        ids = torch.tensor([prompt_ids + output_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt_ids) - 1: -1]
        return torch.log_softmax(logits.float() / temperature, dim=-1)

    return run


def _check_against(ref: torch.Tensor, out, k: int) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) > 0
    for j, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
        assert next(iter(d)) == tok  # the generated token first
        assert d[tok].logprob == pytest.approx(float(ref[j, tok]), abs=1e-4)
        # vLLM's rank: the tokens at least as likely, itself included (up to near-ties)
        above = lambda eps: int((ref[j] > ref[j, tok] + eps).sum())  # noqa: E731
        assert above(1e-4) + 1 <= d[tok].rank <= above(-1e-4)
        top = ref[j].topk(k)
        others = list(d)[1:]  # the top k but the generated token: most likely first
        assert len(d) == k + (tok not in top.indices.tolist()) or abs(float(ref[j, tok]) - float(top.values[-1])) < 1e-4
        assert sorted(others, key=lambda t: -d[t].logprob) == others
        assert [d[t].rank for t in others] == [r for r, t in enumerate(top.indices.tolist(), 1) if t in others]
        for v, i in zip(top.values.tolist(), top.indices.tolist()):
            if abs(v - float(top.values[-1])) > 1e-4:  # a near-tie at the k-th place may swap
                assert d[i].logprob == pytest.approx(v, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs)))


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft-model:SELF"])
def test_greedy_logprobs_equal_hf_teacher_forced(tiny, hf_logprobs, drafter):
    llm = LLM(str(tiny), drafter=drafter.replace("SELF", str(tiny)), policy="fixed", num_speculative_tokens=4,
              max_batch=4, max_len=256, drafter_dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, logprobs=3))
    for o in outs:
        _check_against(hf_logprobs(o.prompt_token_ids, o.token_ids), o.outputs[0], 3)
        assert all(next(iter(d.values())).rank == 1 for d in o.outputs[0].logprobs)  # greedy = the top token
    if drafter != "none":
        assert llm.last_stats.draft_accepted > 0  # tokens committed from verify blocks


def test_speculative_logprobs_equal_plain_decodings(tiny):
    """Greedy: the same tokens and the same numbers from verify blocks as from one-token steps."""
    sp = SamplingParams(max_tokens=32, temperature=0.0, logprobs=5)
    plain = LLM(str(tiny), drafter="none", max_batch=4, max_len=256).generate(PROMPTS, sp)
    spec_llm = LLM(str(tiny), drafter="ngram", policy="fixed", num_speculative_tokens=5, max_batch=4, max_len=256)
    spec = spec_llm.generate(PROMPTS, sp)
    assert spec_llm.last_stats.draft_accepted > 0
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(da) == list(db)
            for t in da:
                assert db[t].logprob == pytest.approx(da[t].logprob, abs=1e-5) and db[t].rank == da[t].rank


def test_sampled_logprobs_are_the_raw_distribution(tiny, hf_logprobs):
    """At T = 0.7 with top-p the numbers are still log_softmax(logits): not the warped p
    (the control: the temperature-scaled log-probabilities differ)."""
    llm = LLM(str(tiny), drafter="ngram", policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=3, logprobs=2))
    far = 0
    for o in outs:
        _check_against(hf_logprobs(o.prompt_token_ids, o.token_ids), o.outputs[0], 2)
        warped = hf_logprobs(o.prompt_token_ids, o.token_ids, temperature=0.7)
        far += sum(abs(d[t].logprob - float(warped[j, t])) > 1e-2
                   for j, (t, d) in enumerate(zip(o.token_ids, o.outputs[0].logprobs)))
    assert far > 0


def test_shape_text_and_default(tiny):
    from draftsmith.models.token_text import TokenText

    llm = LLM(str(tiny), drafter="ngram", policy="fixed", max_batch=4, max_len=256)
    none, zero = llm.generate([PROMPTS[0]] * 2, [SamplingParams(max_tokens=24, temperature=0.0),
                                                 SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)])
    assert none.outputs[0].logprobs is None and none.outputs[0].cumulative_logprob is None
    assert [len(d) for d in zero.outputs[0].logprobs] == [1] * len(zero.token_ids)
    tt = TokenText(llm.tokenizer)
    for t, d in zip(zero.token_ids, zero.outputs[0].logprobs):
        assert d[t].decoded_token == tt.text(t)


def test_a_stop_rule_that_cuts_a_verify_block(tiny):
    """The target drafting for itself (greedy, K = 4): each round commits a block of up to 5
    tokens; a stop token inside the first block keeps fewer than it committed. The logprobs
    are one per kept token, with the numbers of the run without the stop."""
    llm = LLM(str(tiny), drafter=f"draft-model:{tiny}", policy="fixed", num_speculative_tokens=4, max_batch=1,
              max_len=256, drafter_dtype="float32")
    sp = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3)
    (full,) = llm.generate([PROMPTS[0]], sp)
    stop = full.token_ids[2]
    cut = full.token_ids.index(stop) + 1
    (stopped,) = llm.generate([PROMPTS[0]], replace(sp, stop_token_ids=(stop,)))
    st = stopped.outputs[0].stats
    assert st["committed"] < st["draft_accepted"] + st["rounds"]  # the last round kept less than it verified
    assert stopped.token_ids == full.token_ids[:cut] and stopped.finish_reason == "stop"
    got, want = stopped.outputs[0].logprobs, full.outputs[0].logprobs[:cut]
    assert len(got) == cut and [list(d) for d in got] == [list(d) for d in want]
    for a, b in zip(got, want):
        for t in a:
            assert (a[t].logprob, a[t].rank) == pytest.approx((b[t].logprob, b[t].rank), abs=1e-6)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_bad_logprobs_say_what_is_allowed(name, bad):
    with pytest.raises(DraftsmithError, match=rf"{name} must be None or an integer in \[0, 20\]"):
        SamplingParams(**{name: bad})


def test_prompt_logprobs_equal_hf_and_skip_the_prefix_cache(tiny, hf_logprobs):
    """`prompt_logprobs=k`: None for the first prompt token, then each token's log-probability
    under the tokens before it (HF's teacher-forced numbers); a request that asks for them
    prefills its whole prompt even where the prefix cache holds it."""
    llm = LLM(str(tiny), drafter="ngram", policy="fixed", max_batch=2, max_len=256, enable_prefix_caching=True)
    sp = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    first, again = llm.generate([PROMPTS[1]], sp)[0], llm.generate([PROMPTS[1]], sp)[0]
    plain = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert plain.outputs[0].stats["cached_tokens"] > 0  # the cache held it: a request without the option reuses it
    ids = first.prompt_token_ids
    ref = hf_logprobs(ids[:1], ids[1:])  # rows predicting prompt tokens 1..
    for out in (first, again):
        assert out.outputs[0].stats["cached_tokens"] == 0 and out.outputs[0].logprobs is None
        lp = out.prompt_logprobs
        assert len(lp) == len(ids) and lp[0] is None
        for j, (t, d) in enumerate(zip(ids[1:], lp[1:])):
            assert next(iter(d)) == t and d[t].logprob == pytest.approx(float(ref[j, t]), abs=1e-4)
            assert d[t].decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
            assert len(d) in (2, 3)
    assert plain.prompt_logprobs is None
    (one,) = llm.generate([ids[:1]], sp)
    assert one.prompt_logprobs == [None]
