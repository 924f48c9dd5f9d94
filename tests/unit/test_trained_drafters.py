"""EAGLE-3, DFlash and DSpark drafters on a tiny random target, through the real engine.

Set-up: the tiny llama of conftest with its lm_head scaled ×3. The stock tiny target is
nearly uniform over its 272 tokens, which gives a distribution check little power; the
sharper one puts ~70% of the (first, second) token mass in ~50 cells. Each drafter kind is
trained for 30 AdamW steps (seconds) on 32 sequences sampled from that target, enough for
~50–75% first-draft acceptance — so proposals are accepted often and a wrong q would show.

Checks: greedy output equals plain greedy; at T = 1 the first two committed tokens after a
fixed prompt follow the target's exact law (chi-square on the first token, the second token
and the pair; p-value ≥ ALPHA = 1e-4 with fixed seeds, as in test_losslessness.py), with a
negative control: DSpark drafters that report a q without the sequential bias, or with the
bias conditioned on the wrong prefix, fail the same check. Training and inference compute
the same distributions (parity), packed training blocks cannot see each other, checkpoints
round-trip, and a checkpoint for another target is refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import LLM, DraftsmithError, SamplingParams
from draftsmith.core.warp import target_probs
from draftsmith.data.features import FeatureExtractor
from draftsmith.drafters import dflash, dspark, eagle3
from draftsmith.drafters.base import TargetFeatures
from draftsmith.drafters.block import choose_mask_token_id, packed_forward
from draftsmith.drafters.block_step import one_call_reason
from draftsmith.drafters.vocab import build_vocab_map
from draftsmith.drafters.checkpoint import save_trained_drafter
from draftsmith.drafters.lookup_first import LookupFirstConfig, LookupFirstDrafter
from draftsmith.drafters.registry import config_for as config_from_dict
from draftsmith.drafters.registry import load_checkpoint as load_trained_drafter
from draftsmith.drafters.registry import load_checkpoint_model as load_trained_model
from draftsmith.drafters.registry import trainable_kinds
from draftsmith.core.request import Request
from draftsmith.models.target import load_target
from draftsmith.drafters.protocol import TrainBatch
from chi_square import chi2_pvalue, exact_first_two_laws  # noqa: E402  (tests/unit helper)
from drafter_wrappers import ForwardingDrafter  # noqa: E402  (tests/unit helper)

ALPHA = 1e-4
N_SAMPLES = 2000
PROMPT = [72, 101, 108, 108, 111, 32]  # "Hello "
TEXT_PROMPTS = ["hello world, hello world, hello", "def f(x):\n    return x + 1\n", "abcabcabcabc", "z"]

CONFIGS = {
    "eagle3": eagle3.Eagle3Config(ttt_steps=3),
    "eagle3-small-vocab": eagle3.Eagle3Config(ttt_steps=3, draft_vocab_size=160),
    "eagle3-frozen-head": eagle3.Eagle3Config(ttt_steps=3, draft_vocab_size=160, freeze_lm_head=True),
    "dflash": dflash.DFlashConfig(block_size=4, num_layers=1, max_anchors=16),
    "dspark": dspark.DSparkConfig(block_size=4, num_layers=1, rank=32, max_anchors=16),
    "dspark-gated": dspark.DSparkConfig(block_size=4, num_layers=1, rank=32, max_anchors=16, head="gated"),
    "dspark-rnn": dspark.DSparkConfig(block_size=4, num_layers=1, rank=32, max_anchors=16, head="rnn"),
    "dflash-small-vocab": dflash.DFlashConfig(block_size=4, num_layers=1, max_anchors=16, draft_vocab_size=160),
    "dflash-mask-first": dflash.DFlashConfig(block_size=4, num_layers=1, max_anchors=16, layout="mask-first"),
    "dspark-qk-norm": dspark.DSparkConfig(block_size=4, num_layers=2, rank=32, max_anchors=16, qk_norm=True),
    "dspark-small-vocab": dspark.DSparkConfig(block_size=4, num_layers=1, rank=32, max_anchors=16,
                                              draft_vocab_size=160),
}
BUILD = {"eagle3": eagle3.build, "dflash": dflash.build, "dspark": dspark.build}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------------------- fixtures


def _sharpen(path: Path, factor: float = 3.0) -> Path:
    state = load_file(str(path / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * factor
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir) -> Path:
    return _sharpen(tiny_model_dir("llama", seed=0))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir))


@pytest.fixture(scope="module")
def train_batch(target_dir, target) -> TrainBatch:
    """32 sequences sampled from the target (16 after PROMPT), features of every layer."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prompts = [PROMPT] * 16 + [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(16)]
    llm = LLM(str(target_dir), max_batch=32, max_len=64)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True)
                                  for i in range(len(prompts))])
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    return _batch(target, seqs, prompt_len=6)


def _batch(target, seqs: list[list[int]], prompt_len: int) -> TrainBatch:
    m = target.model
    layers = tuple(range(m.config.num_layers))
    feats = FeatureExtractor(m, layers)(seqs)
    B, T, H = len(seqs), max(map(len, seqs)), m.config.hidden_size
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    hidden = {i: torch.zeros(B, T, H) for i in layers}
    final = torch.zeros(B, T, H)
    for b, (s, (h, f)) in enumerate(zip(seqs, feats)):
        n = len(s)
        ids[b, :n] = torch.tensor(s)
        mask[b, prompt_len:n] = True
        for i in layers:
            hidden[i][b, :n] = h[i]
        final[b, :n] = f
    return TrainBatch(ids, mask, torch.tensor([len(s) for s in seqs]), hidden, final)


def _build(target, name: str, seed: int = 0):
    cfg = CONFIGS[name]
    torch.manual_seed(seed)
    return BUILD[cfg.kind](target.model, cfg)


@pytest.fixture(scope="module")
def trained(target, train_batch):
    """name -> (model trained 30 steps, [loss per step]); each kind is trained once."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            torch.set_num_threads(1)
            model = _build(target, name)
            if getattr(model.config, "draft_vocab_size", None):
                model.init_draft_vocab(torch.bincount(train_batch.input_ids.flatten(), minlength=272))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(0)
            losses = []
            for _ in range(30):
                out = model.training_loss(train_batch, gen)
                opt.zero_grad()
                out.total.backward()
                opt.step()
                losses.append(float(out.total.detach()))
            cache[name] = (model.eval(), losses)
        return cache[name]

    return get


# ---------------------------------------------------------------------------- helpers


class Recorder(ForwardingDrafter):
    """Keeps every proposal (the engine sees the same object)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.proposals: list = []

    def propose(self, seqs, max_lengths):
        p = self.inner.propose(seqs, max_lengths)
        self.proposals.append(([s.params for s in seqs], p))
        return p


def _first_two_pvalues(target_dir, target, drafter, reproducible_seeds=False,
                       prompt: list[int] = PROMPT) -> tuple[dict[str, float], float]:
    # reproducible_seeds=False: seeded requests take the rejection rule (where q matters);
    # True: position-keyed coupling (q plays no part; tested below)
    llm = LLM(str(target_dir), drafter=drafter, policy="fixed", num_speculative_tokens=4, max_batch=64, max_len=64,
              reproducible_seeds=reproducible_seeds)
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(N_SAMPLES)]
    outs = llm.generate([prompt] * N_SAMPLES, params)
    first = torch.tensor([o.token_ids[0] for o in outs])
    second = torch.tensor([o.token_ids[1] for o in outs])
    V = target.model.config.vocab_size
    p1, p2, pair = exact_first_two_laws(target.model, prompt)
    pv = {
        "first": chi2_pvalue(torch.bincount(first, minlength=V), p1),
        "second": chi2_pvalue(torch.bincount(second, minlength=V), p2),
        "pair": chi2_pvalue(torch.bincount(first * V + second, minlength=V * V), pair),
    }
    return pv, llm.last_stats.prefix_survival[0]


# ---------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_learns_and_leaves_the_target_alone(name, target, trained):
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    model, losses = trained(name)
    assert losses[-1] < 0.8 * losses[0], losses
    after = target.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the target is frozen
    assert all(p.grad is None for p in target.model.parameters())
    keys = set(model.state_dict())
    assert not any("embed" in k for k in keys)  # the target's embedding is shared, never saved
    if model.config.kind != "eagle3":  # EAGLE-3 trains its own (draft-vocabulary) lm_head
        assert not any("lm_head" in k for k in keys)
    elif model.config.freeze_lm_head:  # ... unless frozen: the target's rows of the draft vocabulary
        assert torch.equal(model.lm_head.weight, target.model.lm_head.weight[model.draft_ids].to(model.lm_head.weight))


# ---------------------------------------------------------------------------- losslessness


@pytest.fixture(scope="module")
def plain_greedy(target_dir):
    """Plain greedy outputs of TEXT_PROMPTS (32 tokens), decoded once for the module on one thread
    (as the tests run: one_thread): the reference of every test_greedy_equals_plain_greedy."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return LLM(str(target_dir), max_batch=4, max_len=128).generate(TEXT_PROMPTS, SamplingParams(max_tokens=32, temperature=0))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_plain_greedy(name, target_dir, target, trained, plain_greedy):
    model, _ = trained(name)
    plain = plain_greedy
    llm = LLM(str(target_dir), drafter=model.make_drafter(target.model, 4, 128), policy="fixed", num_speculative_tokens=5,
              max_batch=4, max_len=128)
    spec = llm.generate(TEXT_PROMPTS, SamplingParams(max_tokens=32, temperature=0))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.last_stats.draft_proposed > 0 and llm.last_stats.draft_accepted > 0


def test_replayed_plans_through_the_engine_keep_greedy_outputs(target_dir, target, trained, plain_greedy):
    """choose_plan="replay" with the DSpark drafter's gate in the engine: every round's gate leaves
    each row's confidence vector (the refused column included), choose() replays them, and greedy
    outputs stay plain decoding's."""
    from draftsmith.policy.prefix_scheduler import PrefixScheduler
    from draftsmith.policy.profile import SPSTable
    from draftsmith.policy.recent_confidences import RECENT, recent_confidences

    cheap = SPSTable.from_step_times((1, 2, 4, 8, 16, 32), (1.0, 1.02, 1.05, 1.1, 1.2, 1.4))  # verify nearly free
    pol = PrefixScheduler(cheap, max_k=5, choose_plan="replay", adapt=False)
    llm = LLM(str(target_dir), drafter=trained("dspark")[0].make_drafter(target.model, 4, 128), policy=pol,
              num_speculative_tokens=5, max_batch=4, max_len=128)
    params = SamplingParams(max_tokens=32, temperature=0)
    reqs = [llm.engine.add_request(llm.tokenizer.encode(p), params) for p in TEXT_PROMPTS]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [r.output_ids for r in reqs] == [list(o.token_ids) for o in plain_greedy]
    kept = [recent_confidences(r) for r in reqs]
    assert all(0 < len(k) <= RECENT for k in kept) and all(0 < len(v) <= 5 for k in kept for v in k)
    assert sum(r.stats.accepted for r in reqs) > 0


@pytest.mark.parametrize("name", ["eagle3-small-vocab", "dflash", "dspark", "dspark-gated", "dspark-rnn",
                                  "dspark-small-vocab"])
def test_first_tokens_follow_the_target_at_temperature_one(name, target_dir, target, trained):
    model, _ = trained(name)
    pv, first_acceptance = _first_two_pvalues(target_dir, target, model.make_drafter(target.model, 64, 64))
    assert min(pv.values()) >= ALPHA, pv
    assert first_acceptance > 0.3  # drafts are often accepted: a wrong q could not hide


@pytest.mark.parametrize("name", ["dspark", "eagle3-small-vocab"])
def test_seeded_coupled_verification_follows_the_target(name, target_dir, target, trained):
    """Seeded requests under position-keyed coupling (the default): the output law is the
    target's, and the drafts, drawn from the same per-position uniforms, are still accepted."""
    model, _ = trained(name)
    pv, first_acceptance = _first_two_pvalues(target_dir, target, model.make_drafter(target.model, 64, 64),
                                              reproducible_seeds=True)
    assert min(pv.values()) >= ALPHA, pv
    assert first_acceptance > 0.05


class _QWithoutSequentialBias(dspark.DSparkModel):
    """Test-only bug: samples with U_k + B_k but reports q = warp(U_k)."""

    def draft(self, hidden, anchors, params, uniforms):
        tokens, q, z = super().draft(hidden, anchors, params, uniforms)
        return tokens, target_probs(self.backbone.head.logits(hidden), list(params)), z


class _QConditionedOnTheAnchor(dspark.DSparkModel):
    """Test-only bug: q_k for k ≥ 2 uses the bias of x_0 instead of the sampled x_{k−1}."""

    def draft(self, hidden, anchors, params, uniforms):
        tokens, q, z = super().draft(hidden, anchors, params, uniforms)
        bias = self.seq_head.w2(self.seq_head.w1(anchors))[:, None].float()
        wrong = target_probs(self.backbone.head.logits(hidden) + bias, list(params))
        return tokens, torch.cat([q[:, :1], wrong[:, 1:]], 1), z


@pytest.mark.parametrize("bug", [_QWithoutSequentialBias, _QConditionedOnTheAnchor])
def test_negative_control_wrong_q_fails_the_check(bug, target_dir, target, trained):
    good, _ = trained("dspark")
    model = bug(target.model, good.config)
    model.load_state_dict(good.state_dict())
    pv, _ = _first_two_pvalues(target_dir, target, model.make_drafter(target.model, 64, 64))
    assert min(pv.values()) < ALPHA, pv


# ---------------------------------------------------------------------------- train / inference parity


def _sequence(prompt: list[int], params: SamplingParams) -> Request:
    s = Request(request_id="parity", prompt_ids=list(prompt), params=params, generator=None)
    s.row = 0
    return s


def _row(batch: TrainBatch, b: int) -> TrainBatch:
    return TrainBatch(batch.input_ids[b : b + 1], batch.loss_mask[b : b + 1], batch.lengths[b : b + 1],
                      {i: h[b : b + 1] for i, h in batch.hidden.items()}, batch.final_hidden[b : b + 1])


@pytest.mark.parametrize("name", ["dflash", "dflash-mask-first", "dspark", "dspark-gated", "dspark-rnn",
                                  "dflash-small-vocab", "dspark-small-vocab"])
def test_block_drafter_proposes_what_training_scores(name, target, train_batch, trained):
    """The inference round at anchor n computes the distributions the packed training
    forward computes for a block anchored at n (with the drafted prefix as x_<k)."""
    model, _ = trained(name)
    row, n, gamma = _row(train_batch, 3), 12, model.config.block_size
    seq = _sequence(row.input_ids[0, : n + 1].tolist(), SamplingParams(temperature=1.0, seed=11))
    drafter = model.make_drafter(target.model, 1, 64)
    drafter.start(seq, TargetFeatures(hidden={i: h[:, :n] for i, h in row.hidden.items()}))
    prop = drafter.propose([seq], [gamma])
    first = model.config.anchor_first
    bb = model.backbone
    with torch.no_grad():
        pf = packed_forward(bb, row, gamma, first, torch.tensor([[n]]), torch.tensor([[True]]))
        logits = bb.draft_logits(pf.hidden[0, 0])  # [γ, Vd]
        if model.config.kind == "dspark":
            prev = torch.cat([row.input_ids[0, n : n + 1], prop.tokens[0, :-1]])[None, None]  # x_0, d_1..
            o, z = model.seq_head.teacher_forced(pf.hidden, bb.to_draft(prev))
            logits = logits + model.seq_head.w2(o[0, 0]).float()
            torch.testing.assert_close(prop.confidences[0], torch.sigmoid(z[0, 0]), atol=1e-5, rtol=1e-4)
    q = torch.softmax(logits, -1)
    if bb.vocab is not None:  # scattered into target ids, zero outside the draft vocabulary
        assert logits.shape[-1] == 160 and float(prop.q[0][:, ~bb.vocab.t2d].abs().max()) == 0.0
        assert bool(bb.vocab.t2d[prop.tokens[0]].all())
        q = torch.zeros(gamma, bb.head.vocab_size).index_copy_(1, bb.draft_ids, q)
    torch.testing.assert_close(prop.q[0], q, atol=1e-5, rtol=1e-4)


class _RecordingSampler:
    def __init__(self, model, hidden: list) -> None:
        self.model, self.hidden = model, hidden

    def draft(self, h, *args):
        self.hidden.append(h.float().clone())
        return self.model.draft(h, *args)


@pytest.mark.parametrize("name,dtype", [("dflash", torch.float32), ("dspark", torch.float32),
                                        ("dspark-qk-norm", torch.float32), ("dspark-qk-norm", torch.bfloat16)])
def test_one_call_draft_layers_equal_the_layer_by_layer_forward(name, dtype, target, train_batch):
    """The block's draft layers as one kernel call each (drafters/block_step.py: the block's K/V
    written past the context, every key visible) compute what the two-part attention layers
    compute: for one row and for a run of rows at one context length, fp32 and bf16, with q/k norm;
    and rows of mixed context lengths, op by op through the same kernels (`forward_rows`). The
    fast drafter also projects its context through the one-pass norm kernel (_append), the
    reference through the norm modules."""
    if one_call_reason(_build(target, name).backbone) is not None:
        pytest.skip(f"no one-call draft layers here: {one_call_reason(_build(target, name).backbone)}")
    if dtype == torch.bfloat16 and not torch.ops.draftsmith.has_bf16():
        pytest.skip("this CPU's kernels have no bfloat16 linear")
    model = _build(target, name)
    with torch.no_grad():  # norms not at their initial ones, so that a swapped or dropped norm shows
        for pname, p in model.backbone.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    gamma = model.config.block_size
    runs = {}
    for one_call in (True, False):
        drafter = model.make_drafter(target.model, 3, 64)
        assert drafter.step is not None
        if not one_call:
            drafter.step = None
        calls, hidden = [], []
        if one_call:
            inner, inner_rows = drafter.step.forward, drafter.step.forward_rows
            drafter.step.forward = lambda *a, **k: calls.append("one run") or inner(*a, **k)
            drafter.step.forward_rows = lambda *a, **k: calls.append("rows") or inner_rows(*a, **k)
        # the sampler is the model itself (shared by both drafters): record on this drafter's object only
        drafter.sampler = _RecordingSampler(model, hidden)
        seqs = []
        for r, (b, n) in enumerate([(3, 12), (4, 9), (5, 9)]):  # rows 1 and 2: one run at one length
            row = _row(train_batch, b)
            seq = _sequence(row.input_ids[0, : n + 1].tolist(), SamplingParams(temperature=0.0))
            seq.row = r
            drafter.start(seq, TargetFeatures(hidden={i: h[:, :n].to(dtype) for i, h in row.hidden.items()}))
            seqs.append(seq)
        props = [drafter.propose(seqs[:1], [gamma]), drafter.propose(seqs[1:], [gamma, gamma]),
                 drafter.propose(seqs, [gamma] * 3)]  # contexts of 12, 9 and 9 positions
        runs[one_call] = (props, hidden, calls)
    (fast, h_fast, calls), (ref, h_ref, _) = runs[True], runs[False]
    assert calls == ["one run", "one run", "rows"]
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    for a, b in zip(h_fast, h_ref):
        torch.testing.assert_close(a, b, **tol)
    if dtype == torch.float32:
        for a, b in zip(fast, ref):
            assert torch.equal(a.tokens, b.tokens)


def test_one_call_draft_layers_follow_weights_changed_in_place(target, train_batch):
    """A drafter that is also trained: the one-call layers lay their weights out again after an
    in-place update, as the layer-by-layer path's linears do."""
    model = _build(target, "dspark")
    if one_call_reason(model.backbone) is not None:
        pytest.skip(f"no one-call draft layers here: {one_call_reason(model.backbone)}")
    row, n = _row(train_batch, 3), 12
    feats = TargetFeatures(hidden={i: h[:, :n] for i, h in row.hidden.items()})

    def hidden_of(drafter):
        got = []
        drafter.sampler = _RecordingSampler(model, got)
        seq = _sequence(row.input_ids[0, : n + 1].tolist(), SamplingParams(temperature=0.0))
        drafter.start(seq, feats)
        drafter.propose([seq], [model.config.block_size])
        return got[0]

    fast = model.make_drafter(target.model, 1, 64)
    before = hidden_of(fast)
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mlp.down_proj.weight.mul_(3.0)
            layer.self_attn.k_proj.weight.mul_(-1.0)
    after = hidden_of(fast)
    slow = model.make_drafter(target.model, 1, 64)
    slow.step = None
    torch.testing.assert_close(after, hidden_of(slow), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(before, after, atol=1e-3)


class _EveryThirdRound:
    """Drafts K on every third round only: the rounds between leave the block drafter's
    context pending (projected lazily, drafters/block.py)."""

    name = "every-third"

    def __init__(self, k: int) -> None:
        self.k, self.round = k, 0

    def choose(self, seqs):
        self.round += 1
        return [self.k if self.round % 3 == 0 else 0] * len(seqs)

    def trim(self, seqs, proposal):
        return proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)

    def update(self, seqs, proposal, result):
        pass


def _greedy_rounds_every_third(model, target_dir, target, k: int):
    """Greedy generation drafting k on every third round, with an early projection every 7
    pending positions: (final sequences, [(committed ids at a drafting round, drafted tokens)])."""
    drafter = model.make_drafter(target.model, 2, 128)
    drafter.flush_tokens = 7
    made: list[tuple[list[int], torch.Tensor]] = []
    inner_propose = drafter.propose

    def propose(seqs, max_lengths):
        prop = inner_propose(seqs, max_lengths)
        for b, s in enumerate(seqs):
            if prop.max_len and int(prop.lengths[b]):
                made.append((list(s.all_ids), prop.tokens[b, : int(prop.lengths[b])].clone()))
        return prop

    drafter.propose = propose
    prompts = [PROMPT, [104, 101, 108, 108, 111, 32, 119]]
    params = SamplingParams(max_tokens=40, temperature=0)
    llm = LLM(str(target_dir), drafter=drafter, num_speculative_tokens=k, policy=_EveryThirdRound(k),
              max_batch=2, max_len=128)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs == [o.token_ids for o in LLM(str(target_dir), max_batch=2, max_len=128).generate(prompts, params)]
    assert len(made) >= 6
    return [p + o for p, o in zip(prompts, outs)], made


class _Hearing:
    """A policy as `inner` decides, that records the backlogs the engine tells it (queued())."""

    def __init__(self, inner, heard: list[int]) -> None:
        self.inner, self.name, self.heard = inner, inner.name, heard

    def choose(self, seqs):
        return self.inner.choose(seqs)

    def trim(self, seqs, proposal):
        return self.inner.trim(seqs, proposal)

    def update(self, seqs, proposal, result) -> None:
        self.inner.update(seqs, proposal, result)

    def queued(self, positions: int) -> None:
        self.heard.append(positions)


def test_a_backlog_is_kept_out_of_the_drafting_time_a_drafting_rows_upkeep_is_not(target_dir, target, trained):
    """The engine subtracts `consumed_s` from a round's drafting time. A prompt (or the positions of
    rounds that did not draft) is a backlog and counts there; a row that drafts every round
    consumes its last round's commits (<= STEADY_TOKENS) when it next drafts: a cost of drafting
    that round, so not in `consumed_s` (the cost model then sees it)."""
    from draftsmith.drafters.feature_queue import STEADY_TOKENS

    drafter = trained("dspark")[0].make_drafter(target.model, 1, 128)
    flushed: list[list[int]] = []
    consume = drafter._consume

    def counting(rows, hidden, counts):
        flushed.append(list(counts))
        return consume(rows, hidden, counts)

    drafter._consume = counting
    llm = LLM(str(target_dir), drafter=drafter, policy="fixed", num_speculative_tokens=2, max_batch=1, max_len=128)
    heard: list[int] = []  # what the engine tells a policy that prices backlogs, before each choose()
    llm.engine.policy = _Hearing(llm.engine.policy, heard)
    prompt = list(range(97, 97 + 2 * STEADY_TOKENS))
    llm.engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    llm.engine.step()  # the prefill round drafts: the prompt's positions are a backlog
    backlog = drafter.consumed_s
    assert flushed[0][0] > STEADY_TOKENS and backlog > 0
    # the backlog the policy heard is what the round then consumed, and the round reports it
    assert heard == [flushed[0][0]] == [drafter.consumed_positions]
    assert llm.engine.last_step.consumed_positions == flushed[0][0] and llm.engine.last_step.consumed_s == backlog
    steady = len(flushed)
    while llm.engine.has_unfinished():
        llm.engine.step()
        assert llm.engine.last_step.draft_s > 0 and llm.engine.last_step.consumed_positions == 0
    assert len(flushed) > steady + 1 and all(0 < c[0] <= STEADY_TOKENS for c in flushed[steady:])
    assert drafter.consumed_s == backlog and drafter.consumed_positions == flushed[0][0]
    assert len(heard) > 1 and heard[1:] == [0] * (len(heard) - 1)  # a drafting row's upkeep is no backlog


def test_a_draft_models_catch_up_on_a_prompt_is_a_backlog_its_rounds_upkeep_is_not(target_dir):
    """The draft model feeds each round what was committed since its last one (drafters/draft_model.py):
    a prompt is a backlog, counted in `consumed_s` (so the engine keeps it out of the drafting time the
    prefix scheduler learns) and told to the policy before the round; the last round's commits are
    drafting work. (Counted as drafting time, a 0.5B draft model's prompt prefill made it look too dear
    to draft or probe, for good: stop 63.)"""
    from draftsmith.drafters.feature_queue import STEADY_TOKENS

    llm = LLM(str(target_dir), drafter=f"draft-model:{target_dir}", policy="fixed", num_speculative_tokens=2,
              max_batch=1, max_len=128)
    drafter = llm.engine.drafter
    heard: list[int] = []
    llm.engine.policy = _Hearing(llm.engine.policy, heard)
    prompt = list(range(97, 97 + 2 * STEADY_TOKENS))
    llm.engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    llm.engine.step()  # the prefill round drafts: the draft model runs the prompt first
    backlog, positions = drafter.consumed_s, drafter.consumed_positions
    assert positions >= len(prompt) and backlog > 0
    assert heard == [positions]
    assert llm.engine.last_step.consumed_positions == positions and llm.engine.last_step.consumed_s == backlog
    while llm.engine.has_unfinished():
        llm.engine.step()
        assert llm.engine.last_step.draft_s > 0 and llm.engine.last_step.consumed_positions == 0
    assert (drafter.consumed_s, drafter.consumed_positions) == (backlog, positions)
    assert len(heard) > 1 and heard[1:] == [0] * (len(heard) - 1)  # a drafting row's upkeep is no backlog


@pytest.mark.parametrize("name", ["dflash-small-vocab", "dflash-mask-first", "dspark", "eagle3",
                                  "eagle3-small-vocab"])
def test_lazy_context_upkeep_drafts_what_training_scores(name, target_dir, target, trained):
    """Rounds without drafts only queue the committed features (a full queue is projected
    early): every greedy proposal still equals the training forward at its anchor, computed
    from scratch (block: packed forward on the final sequence; EAGLE-3: training-time test
    on the committed ids + the drafts)."""
    model, _ = trained(name)
    k = model.config.block_size if name != "eagle3" and name != "eagle3-small-vocab" else 3
    seqs, made = _greedy_rounds_every_third(model, target_dir, target, k)
    if model.config.kind == "eagle3":
        for prefix, tokens in made:
            rerun = _batch(target, [prefix + tokens.tolist()], prompt_len=0)
            with torch.no_grad():
                steps = model.ttt_forward(rerun, steps=len(tokens))
            picks = [int(model.draft_ids[model.draft_logits(h[0, len(prefix) - 2]).argmax()]) for h in steps]
            assert picks == tokens.tolist()
        return
    full = _batch(target, seqs, prompt_len=0)
    first = model.config.anchor_first
    bb, gamma = model.backbone, model.config.block_size
    for prefix, tokens in made:
        b = next(i for i, sq in enumerate(seqs) if sq[: len(prefix)] == prefix)
        anchor = len(prefix) - 1
        with torch.no_grad():
            pf = packed_forward(bb, _row(full, b), gamma, first, torch.tensor([[anchor]]), torch.tensor([[True]]))
            logits = bb.draft_logits(pf.hidden[0, 0])[: len(tokens)]
            if model.config.kind == "dspark":
                prev = torch.cat([torch.tensor([prefix[anchor]]), tokens[:-1]])
                o, _ = model.seq_head.teacher_forced(pf.hidden[:, :, : len(tokens)], bb.to_draft(prev)[None, None])
                logits = logits + model.seq_head.w2(o[0, 0]).float()
        assert bb.to_target(logits.argmax(-1)).tolist() == tokens.tolist()


@pytest.mark.parametrize("name", ["eagle3", "eagle3-small-vocab"])
def test_eagle_drafts_what_training_time_test_scores(name, target, train_batch, trained):
    """Draft i+1 at inference = TTT step i at the context's last column, when the data
    tokens are the drafted ones; with a reduced vocabulary q is scattered into target ids."""
    model, _ = trained(name)
    row, n, K = _row(train_batch, 3), 12, 3
    prompt = row.input_ids[0, : n + 1].tolist()
    seq = _sequence(prompt, SamplingParams(temperature=1.0, seed=11))
    drafter = model.make_drafter(target.model, 1, 64)
    drafter.start(seq, TargetFeatures(hidden={i: h[:, :n] for i, h in row.hidden.items()}))
    prop = drafter.propose([seq], [K])
    assert int(prop.lengths[0]) == K
    rerun = _batch(target, [prompt + prop.tokens[0].tolist()], prompt_len=0)
    with torch.no_grad():
        steps = model.ttt_forward(rerun, steps=K)
    V = target.model.config.vocab_size
    for i in range(K):
        q_draft = torch.softmax(model.draft_logits(steps[i][0, n - 1]), -1)
        q = torch.zeros(V).index_copy_(0, model.draft_ids, q_draft)
        torch.testing.assert_close(prop.q[0, i], q, atol=1e-5, rtol=1e-4)
    if model.reduced_vocab:
        assert float(prop.q[0][:, ~model.t2d].abs().max()) == 0.0


def test_target_statistics_give_the_full_vocabulary_loss(target, train_batch):
    """With a reduced draft vocabulary, DSpark's loss from the batch's target statistics (the
    log-sum-exp outside the draft vocabulary and the argmax, target_stats) and the lm_head rows
    of the draft ids equals its loss from the full lm_head (every term, float32); statistics of
    the full vocabulary (a rest that double-counts the draft ids) do not."""
    model = _build(target, "dspark-small-vocab")
    model.init_draft_vocab(torch.bincount(train_batch.input_ids.flatten(), minlength=272))
    B, T, H = train_batch.final_hidden.shape
    rest, top = model.target_stats(train_batch.final_hidden.reshape(-1, H))
    with_stats = dataclasses.replace(train_batch, target_rest_lse=rest.view(B, T), target_top1=top.view(B, T))

    def loss(batch):
        out = model.training_loss(batch, torch.Generator().manual_seed(3))
        return float(out.total), out.parts

    full, split = loss(train_batch), loss(with_stats)
    assert split[0] == pytest.approx(full[0], rel=1e-5) and split[1] == pytest.approx(full[1], rel=1e-5)
    lg = train_batch.final_hidden.reshape(-1, H) @ target.model.lm_head.weight.T
    assert torch.equal(top, lg.argmax(-1))
    wrong = dataclasses.replace(with_stats, target_rest_lse=torch.logsumexp(lg, -1).view(B, T))
    assert abs(loss(wrong)[0] - full[0]) > 1e-3
    assert _build(target, "dspark").target_stats(train_batch.final_hidden[0]) is None  # full vocabulary: none
    ce_only = dataclasses.replace(CONFIGS["dspark-small-vocab"], tv_weight=0.0, kl_weight=0.0, conf_weight=0.0)
    assert dspark.build(target.model, ce_only).target_stats(train_batch.final_hidden[0]) is None  # not read


def test_packed_blocks_never_see_each_other(target, train_batch):
    model = _build(target, "dspark")
    row = _row(train_batch, 0)
    anchors, valid = torch.tensor([[8, 14, 20]]), torch.ones(1, 3, dtype=torch.bool)

    def hidden(batch):
        with torch.no_grad():
            return packed_forward(model.backbone, batch, 4, True, anchors, valid).hidden[0]  # [A, γ, H]

    base = hidden(row)
    ids = row.input_ids.clone()
    ids[0, 14] = (ids[0, 14] + 1) % 256  # the anchor token of block 2 only
    other = hidden(TrainBatch(ids, row.loss_mask, row.lengths, row.hidden, row.final_hidden))
    assert torch.equal(other[0], base[0]) and torch.equal(other[2], base[2])
    assert not torch.allclose(other[1], base[1])
    feats = {i: h.clone() for i, h in row.hidden.items()}
    for h in feats.values():
        h[0, 15] += 1.0  # a context position only block 3 (anchor 20) may see
    other = hidden(TrainBatch(row.input_ids, row.loss_mask, row.lengths, feats, row.final_hidden))
    assert torch.equal(other[0], base[0]) and torch.equal(other[1], base[1])
    assert not torch.allclose(other[2], base[2])


# ---------------------------------------------------------------------------- proposals


def test_mixed_batch_confidences_and_one_hot_greedy_rows(target_dir, target, trained):
    model, _ = trained("dspark")
    rec = Recorder(model.make_drafter(target.model, 4, 64))
    llm = LLM(str(target_dir), drafter=rec, policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=64)
    llm.generate(TEXT_PROMPTS[:2], [SamplingParams(max_tokens=12, temperature=0.0),
                                    SamplingParams(max_tokens=12, temperature=1.0, seed=1)])
    # Proposal contract (core/types.py): q may be None only when every row that drafted is
    # greedy (its q is one-hot). Whether a round where only the greedy row drafts occurs depends
    # on the drafts a CPU's float path produces, so both cases are checked, never assumed.
    two_rows = [(params, p) for params, p in rec.proposals if len(params) == 2 and p.max_len]
    both = [(params, p) for params, p in two_rows if bool((p.lengths > 0).all())]
    assert both, "the first round drafts for both rows (each has 11 tokens to go)"
    for params, p in two_rows:
        K = p.max_len
        valid = torch.arange(K)[None, :] < p.lengths[:, None]
        assert p.confidences is not None and p.confidences.shape == (2, K)
        drafted_sampled = any(int(p.lengths[b]) and not params[b].greedy for b in range(2))
        if p.q is None:
            assert not drafted_sampled, "q is None although a sampled row drafted"
            continue
        assert bool(((p.confidences > 0) & (p.confidences < 1))[valid].all())
        assert float(p.confidences[~valid].abs().sum()) == 0.0
        for b in range(2):
            n = int(p.lengths[b])
            if params[b].greedy and n:
                one_hot = torch.zeros(n, p.q.shape[-1]).scatter_(1, p.tokens[b, :n, None], 1.0)
                assert torch.equal(p.q[b, :n], one_hot)
            torch.testing.assert_close(p.q[b, :n].sum(-1), torch.ones(n))


# ---------------------------------------------------------------------------- lookup first


def test_lookup_first_greedy_equals_plain_and_mixes_both_sources(target_dir, target, trained):
    model, _ = trained("dspark")
    plain = LLM(str(target_dir), max_batch=4, max_len=128).generate(TEXT_PROMPTS, SamplingParams(max_tokens=32, temperature=0))
    drafter = LookupFirstDrafter(model.make_drafter(target.model, 4, 128))
    llm = LLM(str(target_dir), drafter=drafter, policy="fixed", num_speculative_tokens=5, max_batch=4, max_len=128)
    spec = llm.generate(TEXT_PROMPTS, SamplingParams(max_tokens=32, temperature=0))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert drafter.lookup_rounds > 0 and drafter.model_rounds > 0  # both sources drafted
    assert llm.last_stats.draft_accepted > 0


def test_lookup_first_mixed_batch_q_and_confidences(target_dir, target, trained):
    """Sampled rows: lookup drafts carry a one-hot q, model drafts the model's q; confidences
    of lookup rows are the wrapper's running acceptance of its own lookup drafts."""
    model, _ = trained("dspark")
    rec = Recorder(LookupFirstDrafter(model.make_drafter(target.model, 4, 64), LookupFirstConfig(min_match=1)))
    llm = LLM(str(target_dir), drafter=rec, policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=64)
    llm.generate(TEXT_PROMPTS, SamplingParams(max_tokens=16, temperature=1.0, seed=3))
    inner = rec.inner
    mixed = 0
    for params, p in rec.proposals:
        if not p.max_len:
            continue
        assert p.q is not None and p.confidences is not None
        for b in range(p.batch_size):
            n = int(p.lengths[b])
            torch.testing.assert_close(p.q[b, :n].sum(-1), torch.ones(n))
            if n and bool((p.q[b, :n].max(-1).values == 1).all()) and bool((p.confidences[b, :n] >= 0).all()):
                mixed += 1
    assert inner.lookup_rounds > 0 and inner.model_rounds > 0
    assert mixed > 0
    ra = inner.running_acceptance(4)
    assert all(0 < a < 1 for a in ra) and ra != [inner.config.prior_mean] * 4  # it learnt from its drafts


def test_lookup_first_is_lossless_at_temperature_one(target_dir, target, trained):
    model, _ = trained("dspark")
    drafter = LookupFirstDrafter(model.make_drafter(target.model, 64, 64), LookupFirstConfig(min_match=1))
    # "Hello Hello ": the first round's drafts come from lookup (" " occurred before), later
    # rounds from either, depending on the sampled tokens: mixed batches at T = 1
    pv, _ = _first_two_pvalues(target_dir, target, drafter, prompt=PROMPT + PROMPT)
    assert min(pv.values()) >= ALPHA, pv
    assert drafter.lookup_rounds > 0 and drafter.model_rounds > 0


class _LookupWithUniformQ(LookupFirstDrafter):
    """Negative control: lookup drafts claim to be drawn from a uniform q (they are not)."""

    def propose(self, seqs, max_lengths):
        p = super().propose(seqs, max_lengths)
        if p.q is not None:
            for b, n in enumerate(self._rows):
                if n:
                    p.q[b, :n] = 1.0 / p.q.shape[-1]
        return p


def test_negative_control_lookup_rows_with_a_wrong_q_fail_the_check(target_dir, target, trained):
    model, _ = trained("dspark")
    drafter = _LookupWithUniformQ(model.make_drafter(target.model, 64, 64), LookupFirstConfig(min_match=1))
    pv, _ = _first_two_pvalues(target_dir, target, drafter, prompt=PROMPT + PROMPT)
    assert min(pv.values()) < ALPHA, pv


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("name", ["eagle3-small-vocab", "dflash", "dspark-rnn", "dspark-small-vocab"])
def test_checkpoint_round_trip(name, tmp_path, target_dir, target, trained):
    model, _ = trained(name)
    save_trained_drafter(model, tmp_path, target.target_id, target.weights_hash)
    loaded = load_trained_model(tmp_path, target)
    assert loaded.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(4)]
    outs = []
    for d in (model.make_drafter(target.model, 4, 64), load_trained_drafter(tmp_path, target, 4, 64)):
        llm = LLM(str(target_dir), drafter=d, policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=64)
        outs.append(([o.token_ids for o in llm.generate(TEXT_PROMPTS, params)], llm.last_stats.draft_accepted))
    assert outs[0] == outs[1]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["kind"] == model.config.kind and saved["target_id"] == target.target_id
    assert saved["target_weights_hash"] == target.weights_hash and saved["format_version"] == 1


def test_dflash_checkpoint_from_before_the_layout_field_is_mask_first(tmp_path, target, trained):
    """DFlash was mask-first before `layout` existed (its default is now anchor-first): a
    config.json without the field loads as mask-first and drafts what that model drafts."""
    model, _ = trained("dflash-mask-first")
    save_trained_drafter(model, tmp_path, target.target_id, target.weights_hash)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg.pop("layout") == "mask-first"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_trained_model(tmp_path, target)
    assert loaded.config == model.config and loaded.config.layout == "mask-first"
    torch.manual_seed(0)
    h = torch.randn(2, model.config.block_size + 1, target.model.config.hidden_size)
    with torch.no_grad():  # the drafted slots are 1..γ of the anchor + γ masks
        assert loaded.make_drafter(target.model, 1, 64).offset == 1
        ref = model.draft(h[:, 1:], torch.tensor([3, 4]), [SamplingParams(temperature=0.0)] * 2, torch.rand(2, 4))
        got = loaded.draft(h[:, 1:], torch.tensor([3, 4]), [SamplingParams(temperature=0.0)] * 2, torch.rand(2, 4))
    assert torch.equal(ref[0], got[0])


def test_flipped_byte_in_checkpoint_weights_is_refused(tmp_path, target, trained):
    model, _ = trained("dflash")
    save_trained_drafter(model, tmp_path, target.target_id, target.weights_hash)
    f = tmp_path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01  # inside the last tensor's data
    f.write_bytes(bytes(data))
    with pytest.raises(DraftsmithError, match="content hash"):
        load_trained_drafter(tmp_path, target, 4, 64)


def test_calibration_temperatures_rescale_confidences(tmp_path, target_dir, target, trained):
    model, _ = trained("dspark")
    save_trained_drafter(model, tmp_path, target.target_id, target.weights_hash)
    temps = [2.0, 0.5, 1.5, 3.0]
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": temps}))
    runs = []
    for d in (model.make_drafter(target.model, 4, 64), load_trained_drafter(tmp_path, target, 4, 64)):
        rec = Recorder(d)
        LLM(str(target_dir), drafter=rec, policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=64).generate(
            TEXT_PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
        runs.append([p for _, p in rec.proposals if p.max_len])
    assert runs[0] and len(runs[0]) == len(runs[1])
    for raw, cal in zip(*runs):
        assert torch.equal(raw.tokens, cal.tokens)
        K = raw.max_len
        valid = torch.arange(K)[None, :] < raw.lengths[:, None]
        z = torch.logit(raw.confidences.double()) / torch.tensor(temps[:K], dtype=torch.float64)
        torch.testing.assert_close(cal.confidences[valid].double(), torch.sigmoid(z)[valid], atol=1e-5, rtol=1e-4)
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": [1.0, -2.0]}))
    with pytest.raises(DraftsmithError, match="positive"):
        load_trained_drafter(tmp_path, target, 4, 64)
    (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": temps, "regime": "fast"}))
    with pytest.raises(DraftsmithError, match="not a calibration file"):
        load_trained_drafter(tmp_path, target, 4, 64)


def test_a_calibration_applies_to_the_rows_of_the_regime_it_was_fitted_in(tmp_path, target_dir, target, trained):
    """A confidence means "the draft is the target's argmax" at T = 0 and "the draft is accepted"
    at T > 0, and STS fitted on one does not calibrate the other (stop 61: the built-in's T = 1 fit
    took its T = 0 ECE from 0.011 to 0.047). A fit applies to the rows of its own regime, named in
    calibration.json ("regime") or read from the temperature it was fitted at; the other rows keep
    their raw confidences, in one batch too. A file with neither applies to every row (as before)."""
    from draftsmith.drafters.calibration import STSFit

    model, _ = trained("dspark")
    save_trained_drafter(model, tmp_path, target.target_id, target.weights_hash)
    temps = [2.0, 0.5, 1.5, 3.0]

    def greedy_confidences(drafter):
        rec = Recorder(drafter)
        LLM(str(target_dir), drafter=rec, policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=64).generate(
            TEXT_PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
        return [(p.tokens, p.confidences) for _, p in rec.proposals if p.max_len]

    raw = greedy_confidences(model.make_drafter(target.model, 4, 64))
    for cal, scaled in (({"regime": "sampled"}, False), ({"fitted_on": {"temperature": 1.0}}, False),
                        ({"regime": "greedy"}, True), ({"fitted_on": {"temperature": 0.0}}, True), ({}, True)):
        (tmp_path / "calibration.json").write_text(json.dumps({"temperatures": temps, **cal}))
        d = load_trained_drafter(tmp_path, target, 4, 64)
        assert d.temperatures == tuple(temps) and d.sts.greedy is (None if not cal else scaled)
        got = greedy_confidences(d)
        assert len(got) == len(raw) and all(torch.equal(a[0], b[0]) for a, b in zip(raw, got))
        same = all(torch.equal(a[1], b[1]) for a, b in zip(raw, got))
        assert same is not scaled, cal
    # one batch, both regimes: a sampled fit scales the sampled row's logits only
    d = model.make_drafter(target.model, 4, 64, temperatures=STSFit(tuple(temps), greedy=False))
    rows = d._row_temperatures([SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)])
    assert rows.tolist() == [[1.0] * 4, temps]
    assert d._row_temperatures([SamplingParams(temperature=0.0)]) is None
    z = torch.tensor([0.7, 0.7])
    assert d._confidences(z, 1, rows).tolist() == pytest.approx([torch.sigmoid(z[0]).item(),
                                                                 torch.sigmoid(z[1] / 0.5).item()])
    # Through the engine, greedy and seeded sampled rows in one batch (one row ending early, so some
    # rounds draft for a subset of the rows): every proposal's sampled rows are scaled, greedy rows raw.
    params = [SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(max_tokens=12, temperature=0.9, seed=3),
              SamplingParams(max_tokens=4, temperature=0.0), SamplingParams(max_tokens=12, temperature=0.9, seed=5)]
    runs = []
    for drafter in (model.make_drafter(target.model, 4, 64), d):
        rec = Recorder(drafter)
        LLM(str(target_dir), drafter=rec, policy="fixed", num_speculative_tokens=4, max_batch=4, max_len=64).generate(
            TEXT_PROMPTS[:4], params)
        runs.append([(ps, p) for ps, p in rec.proposals if p.max_len])
    assert runs[0] and len(runs[0]) == len(runs[1])
    mixed = subset = 0
    for (ps, raw), (_, cal) in zip(*runs):
        assert torch.equal(raw.tokens, cal.tokens) and torch.equal(raw.lengths, cal.lengths)
        mixed += len({p.greedy for p, n in zip(ps, raw.lengths.tolist()) if n}) == 2
        subset += bool((raw.lengths == 0).any())
        for b, (p, n) in enumerate(zip(ps, raw.lengths.tolist())):
            want = raw.confidences[b, :n].double()
            if not p.greedy:
                want = torch.sigmoid(torch.logit(want) / torch.tensor(temps[:n], dtype=torch.float64))
            torch.testing.assert_close(cal.confidences[b, :n].double(), want, atol=1e-5, rtol=1e-4)
    assert mixed and subset  # (the batches this test is about did occur)


@pytest.mark.parametrize("name", ["eagle3-small-vocab", "dspark-small-vocab"])
def test_bfloat16_drafter_beside_a_float32_target_keeps_greedy_outputs_and_the_target(name, tmp_path, target_dir,
                                                                                     target, trained):
    """`drafter_dtype="bfloat16"` (drafters/precision.py) beside a float32 target: the drafter's
    weights and the lm_head rows it scores with are bfloat16 copies, the target's own tensors
    stay float32 and unchanged, and greedy outputs equal plain decoding's."""
    model, _ = trained(name)
    save_trained_drafter(model, tmp_path, target.target_id, target.weights_hash)
    spec = f"{model.config.kind}:{tmp_path}"
    plain = LLM(str(target_dir), max_batch=4, max_len=64)
    before = {k: v.clone() for k, v in plain.target.model.state_dict().items()}
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    ref = [o.token_ids for o in plain.generate(TEXT_PROMPTS, sp)]
    llm = LLM(plain.target, drafter=spec, drafter_dtype="bfloat16", policy="fixed", num_speculative_tokens=4,
              max_batch=4, max_len=64)
    assert [o.token_ids for o in llm.generate(TEXT_PROMPTS, sp)] == ref
    assert llm.last_stats.draft_proposed > 0
    drafter_model = getattr(llm.drafter, "backbone", None) or llm.drafter.model
    assert {p.dtype for p in drafter_model.parameters()} == {torch.bfloat16}
    if getattr(drafter_model, "lm_rows", None) is not None:
        assert drafter_model.lm_rows.dtype == torch.bfloat16
    after = plain.target.model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())
    fp32 = load_trained_drafter(tmp_path, target, 4, 64)  # the default of a direct load: the target's dtype
    assert {p.dtype for p in (getattr(fp32, "backbone", None) or fp32.model).parameters()} == {torch.float32}


def test_checkpoint_for_another_target_is_refused(tmp_path, tiny_model_dir, target, trained):
    model, _ = trained("dflash")
    save_trained_drafter(model, tmp_path, target.target_id, target.weights_hash)
    other = load_target(str(tiny_model_dir("llama", seed=1)))
    with pytest.raises(DraftsmithError) as e:
        load_trained_drafter(tmp_path, other, 4, 64)
    assert target.target_id in str(e.value) and other.target_id in str(e.value)
    with pytest.raises(DraftsmithError, match="no config.json"):
        load_trained_drafter(tmp_path / "missing", target, 4, 64)


# ---------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "data, message",
    [
        ({"kind": "dspark", "block_sise": 7}, "unknown field"),
        ({"kind": "dspark", "block_size": "7"}, "must be an integer"),
        ({"kind": "dspark", "block_size": 0}, "block_size must be an integer >= 1"),
        ({"kind": "dspark", "head": "lstm"}, "must be one of"),
        ({"kind": "eagle3", "ttt_steps": 0}, "ttt_steps"),
        ({"kind": "eagle3", "freeze_lm_head": "yes"}, "freeze_lm_head. must be true or false"),
        ({"kind": "dflash", "layer_ids": [0, 0]}, "repeat"),
        ({"kind": "dflash", "draft_vocab_size": 0}, "draft_vocab_size must be a positive integer"),
        ({"kind": "medusa"}, "unknown trainable drafter kind"),
    ],
)
def test_config_errors_are_clear(data, message):
    with pytest.raises(DraftsmithError, match=message):
        config_from_dict(data)


def test_draft_vocabulary_larger_than_the_target_is_refused(target):
    with pytest.raises(DraftsmithError, match="draft_vocab_size 300 exceeds the target vocabulary 272"):
        dspark.build(target.model, dspark.DSparkConfig(block_size=4, num_layers=1, draft_vocab_size=300))


def test_config_defaults_and_target_resolution(target):
    assert set(trainable_kinds()) == {"eagle3", "dflash", "dspark"}
    d = config_from_dict({"kind": "dspark"})
    assert (d.block_size, d.num_layers, d.rank, d.head) == (7, 5, 256, "markov")
    assert (d.ce_weight, d.tv_weight, d.conf_weight) == (0.1, 0.9, 1.0)
    e = config_from_dict({"kind": "eagle3", "layer_ids": [0, 2]})
    assert e.layer_ids == (0, 2) and e.ttt_steps == 7 and e.ttt_decay == 0.8
    with pytest.raises(DraftsmithError, match="out of range"):
        dflash.build(target.model, dflash.DFlashConfig(layer_ids=(0, 9)))
    m = dflash.build(target.model, dflash.DFlashConfig(num_layers=1))
    assert m.config.layer_ids == (1,) and m.config.mask_token_id == 271


def test_mask_token_choice(target):
    # The tiny tokenizer has 259 entries in a 272-row embedding: the first unused row.
    assert choose_mask_token_id(272, target.tokenizer) == 259

    class SmolLike:  # SmolLM2: no padding rows; 17 added tokens, 0-2 used by chat
        all_special_ids = [1, 2, 0]
        added_tokens_decoder = {i: None for i in range(17)}

        def __len__(self):
            return 49152

    assert choose_mask_token_id(49152, SmolLike()) == 16  # <empty_output>
    assert choose_mask_token_id(100) == 99


def test_build_vocab_map():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = build_vocab_map(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]  # the 3 most frequent, ascending
    assert t2d.tolist() == [False, False, True, True, False, True]
    d2t, _ = build_vocab_map(torch.tensor([1, 1, 1, 1]), 2)
    assert (torch.arange(2) + d2t).tolist() == [0, 1]  # ties -> lower ids
    with pytest.raises(DraftsmithError):
        build_vocab_map(counts, 7)


def test_init_from_target_copies_the_last_target_layers(target):
    cfg = dspark.DSparkConfig(block_size=4, num_layers=2, rank=8, max_anchors=4, init_from_target=True)
    model = dspark.build(target.model, cfg)
    layers = list(target.model.model.layers)
    for mine, theirs in zip(model.backbone.layers, layers[-2:]):
        own = mine.state_dict()
        assert own and all(torch.equal(own[k], theirs.state_dict()[k]) for k in own)
    fresh = dspark.build(target.model, dspark.DSparkConfig(block_size=4, num_layers=2, rank=8, max_anchors=4))
    w = fresh.backbone.layers[0].self_attn.q_proj.weight
    assert not torch.equal(w, layers[-2].self_attn.q_proj.weight)  # off by default
    with pytest.raises(DraftsmithError, match="init_from_target"):
        dspark.build(target.model, dataclasses.replace(cfg, intermediate_size=8))


class _Never:
    """Drafts nothing, ever (a server past the load where speculation pays)."""

    name = "never"

    def choose(self, seqs):
        return [0] * len(seqs)

    def trim(self, seqs, proposal):
        return [0] * len(seqs)

    def update(self, seqs, proposal, result):
        pass


def test_queued_context_is_consumed_only_past_its_memory_bound(target_dir, target, trained):
    """Rows that never draft consume no context while the queues fit in `queue_bytes`; past it,
    the longest queues are consumed first, until the rows hold at most half of it."""
    model, _ = trained("dspark")
    prompts = [PROMPT * 4, [104, 101, 108, 108, 111, 32, 119]]  # 24 and 7 prompt tokens
    params = SamplingParams(max_tokens=30, temperature=0)
    want = [o.token_ids for o in LLM(str(target_dir), max_batch=2, max_len=128).generate(prompts, params)]

    def run(queue_bytes: int | None):
        drafter = model.make_drafter(target.model, 2, 128)
        if queue_bytes is not None:
            drafter.queue_bytes = queue_bytes
        consumed: list[list[int]] = []  # per flush: the positions each consumed row had queued
        inner = drafter._consume

        def spy(rows, hidden, counts):
            consumed.append(list(counts))
            return inner(rows, hidden, counts)

        drafter._consume = spy
        outs = LLM(str(target_dir), drafter=drafter, policy=_Never(), max_batch=2, max_len=128).generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        per_position = target.model.config.hidden_size * 4 * len(drafter.feature_layers)  # float32
        return consumed, per_position

    consumed, per_position = run(None)
    assert consumed == []  # the default bound holds both rows' whole context: nothing consumed
    budget = 40 * per_position  # 40 positions in all: the two rows pass it after a few rounds
    consumed, _ = run(budget)
    assert consumed, "past the bound, queued context must be consumed"
    assert len(consumed[0]) == 1 and consumed[0][0] >= 23  # the longest queue alone: the 24-token prompt's row
    assert all(n < 40 for flush in consumed for n in flush)  # never a row's whole run: consumed as the bound is passed
