"""Greedy equality on the real default target (SmolLM2-135M-Instruct).

Speculative token ids must equal plain greedy token ids of the same engine for every
drafter, on 32 mixed code/chat prompts × 64 new tokens; and the engine's plain greedy must
equal HF transformers' greedy.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from draftsmith import LLM, SamplingParams
from draftsmith.data.sources import HumanEvalSource, MTBenchSource

pytestmark = pytest.mark.slow

N_NEW = 64


@pytest.fixture(scope="module")
def plain(default_target_dir) -> LLM:
    """Plain decoding on the float32 default target, loaded once for the module: every float32
    LLM below shares its target (LLM(plain.target, ...): the same weights, not loaded again)."""
    return LLM(str(default_target_dir), drafter="none", max_batch=16)


@pytest.fixture(scope="module")
def prompts(plain) -> list[list[int]]:
    # Short prompts keep prefill cheap on 2 CPU cores; both kinds stay represented. The
    # code prompts keep their (repetitive) signature + docstring head, which n-gram feeds on.
    code = [c.messages[0]["content"][-160:] for c in itertools.islice(HumanEvalSource().conversations(), 16)]
    chat = [c.messages[0]["content"][:120] for c in itertools.islice(MTBenchSource().conversations(), 16)]
    return [plain.apply_chat_template([{"role": "user", "content": p}]) for p in code + chat]


@pytest.fixture(scope="module")
def plain_outputs(plain, prompts):
    return [o.token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=N_NEW, temperature=0))]


@pytest.mark.parametrize("drafter", ["ngram", "draft-model:smollm2-135m", "dspark:smollm2-135m"])
def test_speculative_equals_plain_greedy(plain, prompts, plain_outputs, drafter):
    llm = LLM(plain.target, drafter=drafter, policy="fixed", num_speculative_tokens=4, max_batch=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=N_NEW, temperature=0))
    assert len(prompts) >= 32 and all(len(p) > 0 for p in plain_outputs)
    mismatches = [i for i, (o, ref) in enumerate(zip(outs, plain_outputs)) if o.token_ids != ref]
    assert not mismatches, f"{drafter}: prompts {mismatches} differ from plain greedy"
    assert llm.last_stats.draft_accepted > 0


class _CountingGate:
    """The scheduler's column search, counting the columns it refuses (the drafter stops there)."""

    def __init__(self, search, refusals: list[int]) -> None:
        self.search, self.refusals = search, refusals

    def open_next(self, column):
        opened = self.search.open_next(column)
        self.refusals.append(int(not opened))
        return opened


def test_built_in_dspark_with_the_draft_gate_equals_plain_greedy(plain, prompts, plain_outputs):
    """The prefix scheduler's column search stops the built-in DSpark drafter at the first column
    that will not be verified (draft_gate): greedy outputs stay plain's. A fixed CPU-like cost
    curve (no profiling, no timing-driven choices), all rows of a batch at once; every fourth
    prompt (4 code, 4 chat) keeps the suite's time down."""
    from draftsmith.policy.prefix_scheduler import PrefixScheduler
    from draftsmith.policy.profile import SPSTable

    refusals: list[int] = []

    class Counting(PrefixScheduler):
        def draft_gate(self, seqs, caps):
            gate = super().draft_gate(seqs, caps)
            return None if gate is None else _CountingGate(gate, refusals)

    sps = SPSTable.from_step_times((1, 4, 8, 16, 32, 64, 128), (1.0, 1.1, 1.25, 1.5, 2.0, 3.2, 6.0))
    policy = Counting(sps, max_k=7, adapt=False, min_gain=0.0)
    llm = LLM(plain.target, drafter="dspark:smollm2-135m", policy=policy, max_batch=16)
    picked = list(range(0, len(prompts), 4))
    outs = llm.generate([prompts[i] for i in picked], SamplingParams(max_tokens=N_NEW, temperature=0))
    mismatches = [i for i, o in zip(picked, outs) if o.token_ids != plain_outputs[i]]
    assert not mismatches, f"prompts {mismatches} differ from plain greedy"
    assert llm.last_stats.draft_accepted > 0 and sum(refusals) > 0


def test_plain_greedy_equals_hf_transformers(default_target_dir, prompts, plain_outputs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(default_target_dir), dtype=torch.float32).eval()
    for i in (0, 20):
        ids = torch.tensor([prompts[i]])
        ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        assert plain_outputs[i][: len(ref)] == ref


def test_bfloat16_speculative_equals_bfloat16_plain_greedy(default_target_dir, prompts):
    """bfloat16 rounds every activation, so a verify block and a one-token step agree only if
    every op computes a token's row the same way whatever the number of tokens: the "kernels"
    linears, the step attention and the one-pass RMSNorm (kernels/gemv.cpp) do. Where those
    kernels do not load (torch's SDPA and oneDNN block by size) bf16 near-ties can differ."""
    from draftsmith.kernels.build import cpu_kernels

    if not (cpu_kernels().ok and cpu_kernels().bf16):
        pytest.skip(f"Draftsmith's bf16 CPU kernels do not run here: {cpu_kernels().reason}")
    sp = SamplingParams(max_tokens=N_NEW, temperature=0)
    plain = LLM(str(default_target_dir), drafter="none", dtype="bfloat16", max_batch=16)
    ref = [o.token_ids for o in plain.generate(prompts, sp)]
    llm = LLM(plain.target, drafter="ngram", policy="fixed", num_speculative_tokens=4, max_batch=16)  # the bf16 target
    assert llm.target.model.dtype == torch.bfloat16
    outs = llm.generate(prompts, sp)
    mismatches = [i for i, (o, r) in enumerate(zip(outs, ref)) if o.token_ids != r]
    assert not mismatches, f"bf16 n-gram: prompts {mismatches} differ from bf16 plain greedy"
    assert llm.last_stats.draft_accepted > 0


def test_built_in_dspark_follows_prefix_caching_on_a_chats_next_turn(plain):
    """`enable_prefix_caching` keeps the built-in DSpark drafter on (its rows keep their context
    with the KV: drafters/feature_queue.py): a chat's second turn reuses the first, its drafter
    context equals a fresh engine's, and greedy outputs equal plain decoding's with prefix caching
    (both build the reused KV by the same steps; a fresh long prefill rounds differently)."""
    from draftsmith.kernels.build import cpu_kernels

    convs = [c for c in itertools.islice(MTBenchSource().conversations(), 2)]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    # the drafter in float32 on every CPU (auto picks bfloat16 on AVX-512): the context comparison below is
    # at float32 tolerances, and a bfloat16 context rounds a feature's last-bit difference to a whole ulp
    spec = LLM(plain.target, drafter="dspark:smollm2-135m", policy="fixed", num_speculative_tokens=4,
               max_batch=2, enable_prefix_caching=True, drafter_dtype="float32")
    cached_plain = LLM(spec.target, max_batch=2, enable_prefix_caching=True)
    assert spec.engine.prefix_caching
    turns: dict[str, list] = {}
    for name, llm in (("spec", spec), ("plain", cached_plain)):
        msgs = [[{"role": "user", "content": c.messages[0]["content"][:200]}] for c in convs]
        first = llm.generate([llm.apply_chat_template(m) for m in msgs], greedy)
        second = [m + [{"role": "assistant", "content": o.text}, {"role": "user", "content": "Say more."}]
                  for m, o in zip(msgs, first)]
        turns[name] = [llm.apply_chat_template(m) for m in second]
        outs = llm.generate(turns[name], greedy)
        assert all(o.stats["cached_tokens"] > len(f.prompt_token_ids) for o, f in zip(outs, first))
        turns[name + "-out"] = [o.token_ids for o in outs]
    assert spec.last_stats.draft_accepted > 0
    if cpu_kernels().ok:
        assert turns["spec-out"] == turns["plain-out"]
    # the drafter's context of the reused rows = a fresh engine's for the same prompts
    fresh = LLM(spec.target, drafter="dspark:smollm2-135m", policy="fixed", num_speculative_tokens=4, max_batch=2,
                drafter_dtype="float32")
    for llm in (spec, fresh):
        for ids in turns["spec"]:
            llm.engine.add_request(ids, greedy)
        llm.engine.step()  # admission + the first round, which consumes the prompts' features
    for i in range(len(spec.engine.drafter.cache.k)):
        for a in spec.engine.running:
            b = next(r for r in fresh.engine.running if r.prompt_ids == a.prompt_ids)
            n = len(a.prompt_ids) - 1
            assert a.stats.cached_tokens == n and b.stats.cached_tokens == 0
            for t in ("k", "v"):
                got = getattr(spec.engine.drafter.cache, t)[i][a.row, :, :n]
                want = getattr(fresh.engine.drafter.cache, t)[i][b.row, :, :n]
                torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
