"""bfloat16 targets keep every losslessness guarantee, with respect to the bf16 target itself:
greedy speculative output equals bf16 plain decoding, and at T = 1 the committed tokens follow
the bf16 target's law (χ², with a negative control that misreports the drafter's q)."""

from __future__ import annotations

import pytest
import torch

from draftsmith import LLM, SamplingParams
from chi_square import chi2_pvalue, exact_first_two_laws  # noqa: E402  (tests/unit helper)
from drafter_wrappers import ForwardingDrafter  # noqa: E402  (tests/unit helper)

ALPHA = 1e-4
N_SAMPLES = 2000
PROMPT = [72, 101, 108, 108, 111, 32]  # "Hello "
PROMPTS = ["hello world, hello world, hello", "def f(x):\n    return x + 1\n", "abcabcabcabc", "z"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("qwen3", seed=0)


@pytest.fixture(scope="module")
def tiny_draft(tiny_model_dir):
    return tiny_model_dir("qwen3", seed=1)


@pytest.mark.parametrize("drafter", ["ngram", "draft-model:SELF", "draft-model:OTHER"])
def test_bf16_greedy_equals_bf16_plain(tiny, tiny_draft, drafter):
    drafter = drafter.replace("SELF", str(tiny)).replace("OTHER", str(tiny_draft))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny), dtype="bfloat16", max_batch=4, max_len=128)
    assert plain.target.model.dtype == torch.bfloat16
    cache = plain.engine.cache
    assert cache.k[0].dtype == torch.bfloat16  # the KV cache is kept in the model's dtype
    spec = LLM(str(tiny), dtype="bfloat16", drafter=drafter, policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=128)
    ref = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == ref
    stats = spec.last_stats
    assert stats.draft_proposed > 0
    if drafter == f"draft-model:{tiny}":  # self-drafting: most drafts accepted
        assert stats.draft_accepted > 0.5 * stats.draft_proposed


class _SharpenedQ(ForwardingDrafter):
    """Test-only bug: reports q² (renormalised) instead of the q the drafts were sampled from.
    (Dropping q altogether would not do: verifying a sampled draft as one-hot is still exact.)"""

    def propose(self, seqs, max_lengths):
        p = self.inner.propose(seqs, max_lengths)
        if p.q is not None:
            q2 = p.q.double() ** 2
            p.q = (q2 / q2.sum(-1, keepdim=True).clamp_min(1e-300)).to(p.q.dtype)
        return p


def _pvalues(tiny, tiny_draft, wrap) -> tuple[dict[str, float], float]:
    llm = LLM(str(tiny), dtype="bfloat16", drafter=f"draft-model:{tiny_draft}", policy="fixed", num_speculative_tokens=3,
              max_batch=64, max_len=32)
    assert llm.drafter.model.dtype == torch.bfloat16  # the draft model follows the target's dtype
    llm.engine.drafter = wrap(llm.engine.drafter)
    # unseeded: seeded requests verify by position-keyed coupling (q unused), and this checks
    # the rejection rule; the global seed keeps the run reproducible
    torch.manual_seed(20261130)
    params = [SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True) for _ in range(N_SAMPLES)]
    outs = llm.generate([PROMPT] * N_SAMPLES, params)
    V = llm.target.model.config.vocab_size
    first = torch.tensor([o.token_ids[0] for o in outs])
    second = torch.tensor([o.token_ids[1] for o in outs])
    p1, p2, pair = exact_first_two_laws(llm.target.model, PROMPT)
    pv = {
        "first": chi2_pvalue(torch.bincount(first, minlength=V), p1),
        "second": chi2_pvalue(torch.bincount(second, minlength=V), p2),
        "pair": chi2_pvalue(torch.bincount(first * V + second, minlength=V * V), pair),
    }
    return pv, llm.last_stats.acceptance_rate


def test_bf16_sampling_follows_the_bf16_target(tiny, tiny_draft):
    pv, acceptance = _pvalues(tiny, tiny_draft, lambda d: d)
    assert min(pv.values()) >= ALPHA, pv
    assert 0.05 < acceptance < 0.95  # both the accept and the residual paths are exercised


def test_bf16_negative_control_wrong_q_fails(tiny, tiny_draft):
    pv, _ = _pvalues(tiny, tiny_draft, _SharpenedQ)
    assert min(pv.values()) < ALPHA, pv


@pytest.mark.parametrize("isa,ok,says", [
    ("avx512", True, "32+ rows) are no faster"),  # AVX-512 without BF16: widened in registers
    ("avx2", True, "16+ rows) are slower"),
    ("", False, "emulated"),  # no kernels: torch's own bf16 path
])
def test_bf16_without_bf16_hardware_warns_what_applies(monkeypatch, isa, ok, says):
    """--dtype bfloat16 on a CPU without AVX512-BF16 / AMX: a warning that says whether Draftsmith's
    kernels stream the bf16 weights (faster decoding, not batch throughput) or it runs emulated;
    float32, and bf16 on bf16 hardware, say nothing."""
    import warnings

    from draftsmith.kernels import build
    from draftsmith.models import target

    status = build.KernelStatus(ok, ok, "test", isa)
    monkeypatch.setattr(build, "cpu_kernels", lambda: status)
    monkeypatch.setattr(target, "cpu_has_fast_bf16", lambda: False)
    cpu = torch.device("cpu")
    with pytest.warns(UserWarning, match="no hardware support") as rec:
        assert target.pick_dtype("bfloat16", cpu) == torch.bfloat16
    assert says in str(rec[0].message) and ("stream the bfloat16 weights" in str(rec[0].message)) == ok
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert target.pick_dtype("float32", cpu) == torch.float32
        monkeypatch.setattr(target, "cpu_has_fast_bf16", lambda: True)
        assert target.pick_dtype("bfloat16", cpu) == torch.bfloat16


def test_float16_without_float16_hardware_names_the_float16_flags(monkeypatch):
    """--dtype float16 on a CPU: the warning listed bfloat16's flags (AVX512-BF16 / AMX / BF16) and
    keyed on them, so a CPU with bf16 but no fp16 hardware said nothing while float16 ran emulated.
    Now float16 is judged by AVX512-FP16 / AMX-FP16 / Arm FP16, and the warning names those."""
    import warnings

    from draftsmith.models import target

    cpu = torch.device("cpu")
    monkeypatch.setattr(target, "cpu_flags", lambda: {"avx512_bf16", "amx_bf16"})  # bf16 hardware only
    with pytest.warns(UserWarning, match="no hardware support") as rec:
        assert target.pick_dtype("float16", cpu) == torch.float16
    msg = str(rec[0].message)
    assert "no AVX512-FP16 / AMX-FP16 / Arm FP16 flag" in msg and "BF16" not in msg, msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert target.pick_dtype("bfloat16", cpu) == torch.bfloat16
        monkeypatch.setattr(target, "cpu_flags", lambda: {"avx512_fp16", "amx_fp16"})
        assert target.pick_dtype("fp16", cpu) == torch.float16
