"""Engine-level losslessness at temperature 1: randomized probability integral transform (PIT).

Method. `LLM(...).generate` runs a ragged workload through the real engine: 16 requests,
prompts of 2..14 tokens, max_tokens 34..63, 6 cache rows (requests are admitted while others
decode), K = 4 drafts per round, so every draft position and the bonus are reached. One
teacher-forced target forward over prompt + output then gives every conditional p_t, warped
by the engine's own `target_probs` (core/warp.py, checked against references in
test_warp.py), and each generated token x_t becomes u_t = F_t(x_t-) + V_t p_t(x_t), V_t ~
U(0, 1) from a fixed generator. If the engine is lossless, x_t ~ p_t given everything before
it, so the u_t are iid U(0, 1) for any token order the past fixes; `pit` uses two (p_t
descending; and q_t/p_t descending at drafted positions, q_t the draft's distribution, which
the past fixes). Checks: Pearson chi-square (chi_square.py) of the u histogram in each order
(20 / 5 cells), and per draft slot j (the tokens at position j of their verification round,
recovered from the verifier's results: accepted draft j, or the token sampled at j), sparse
tail slots pooled. A check fails below ALPHA = 1e-6 (~180 checks: ~0.02% false failures for
the file if the draws changed, as another CPU's float path may change them; with the fixed
seeds every run on one machine is deterministic). The smallest positive p-value seen is 2e-3.

Set-up. Target: the conftest tiny llama with a 32-token vocabulary, lm_head scaled x5 (peaked
conditionals). Drafters, each built by the registry from its spec: `ngram`; `draft-model:`
another tiny model (the target's weights with a flatter, noisy lm_head: q != p); `eagle3:`,
`dflash:`, `dspark:` checkpoints trained here for 30 AdamW steps on 64 sequences sampled
from the target (seconds). Acceptance of every run is asserted in (0.1, 0.9); seen: 0.17-0.68.
Per kind four runs: fixed K at T = 1; batch-schedule (K by running rows) with per-row warps
(top-k, top-p, both, T = 0.8, min-p and plain T = 1 in one batch); prefix-scheduler (DSpark
Algorithm 1 on DSpark's confidences, running acceptance for the others; fixed SPS table, no
timing-driven adaptation, so it repeats) with the same warps; fixed K, warped, unseeded
(rejection rule on the global RNG); plus the four pooled. Seeded runs use
reproducible_seeds=False, i.e. the rejection rule, where q matters. Under the default
position-keyed coupling every kind must reproduce plain seeded decoding token for token (and
ignore q); plain seeded decoding gets the PIT check.

Negative controls, through the same check (drafted tokens unchanged, the q given to the
verifier wrong): sampled drafts (draft-model, eagle3, dflash, dspark) report normalise(q^2);
the n-gram proposal has q = None (one-hot), so it reports a soft q claiming the draft had
probability 0.1. And one engine-side bug: the verifier resamples from p instead of the
residual max(p - q, 0) after a rejection (dspark, the four runs pooled).

p-values seen: smallest over all checks of a run (positive runs); pooled checks (controls)

    kind         fixed-T1  batch-sched  prefix-sched  unseeded  4 pooled | wrong q   resid=p bug
    ngram        0.11      0.34         0.24          0.64      0.11     | 7.9e-21   1.3e-7
    draft-model  0.0022    0.23         0.53          0.055     0.021    | 4.4e-54   1.3e-5
    eagle3       0.27      0.16         0.044         0.10      0.030    | 7.4e-34   1.0e-11
    dflash       0.20      0.021        0.068         0.032     0.0035   | 7.4e-19   9.9e-16
    dspark       0.17      0.29         0.54          0.11      0.068    | 2.9e-14   5.6e-16
    plain seeded decoding (= every coupled run): 0.048

Asserted: every wrong-q control below CONTROL_MAX_P = 1e-8, and the resampling bug (dspark)
too; the other resampling-bug columns were measured the same way (4 runs pooled). One run
alone sees that bug only weakly (1.5e-8 to 0.5, mostly above ALPHA). The orders complement each other: the
sharpened q shows in p-order (dspark: 2.9e-14 there, 0.083 in q/p-order), the n-gram control
only in q/p-order (7.9e-21 vs 0.35), the resampling bug mostly in q/p-order. Sensitivity,
measured, not asserted: q^1.5 gives 1.4e-11 / 1.8e-6 / 0.027 / 4.8e-7 (draft-model / eagle3
/ dflash / dspark); a FLATTENED q^0.5 gives 0.02 / 9.4e-5 / 0.0023 / 4e-8, so a mildly wrong
q can pass one run; n-gram claims of 0.25 / 0.5 give 3.1e-10 / 2.7e-8. ~750 tokens per run;
the file takes ~20-25 s on 2 shared cores (model files and training included).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import LLM, SamplingParams
from draftsmith.core.types import Proposal
from draftsmith.core.warp import target_probs
from draftsmith.drafters import dflash, dspark, eagle3
from draftsmith.drafters.base import NoDrafter
from draftsmith.drafters.checkpoint import save_trained_drafter
from draftsmith.drafters.registry import build_drafter
from draftsmith.models.target import load_target
from draftsmith.policy.batch_schedule import BatchSizeSchedule
from draftsmith.policy.fixed import FixedK
from draftsmith.policy.prefix_scheduler import PrefixScheduler
from draftsmith.policy.profile import SPSTable
from chi_square import chi2_pvalue  # noqa: E402  (tests/unit helper)
from drafter_wrappers import ForwardingDrafter  # noqa: E402  (tests/unit helper)
from test_trained_drafters import _batch  # noqa: E402  (features of sampled sequences -> TrainBatch)

ALPHA = 1e-6  # a check fails below this p-value: far below every honest run, far above every control
CONTROL_MAX_P = 1e-8  # a broken implementation must fail by a wide margin, not just below ALPHA
VOCAB = 32  # small vocabulary: sampled training data covers it, and drafts get accepted
SHARPEN = 5.0  # target lm_head scale: peaked conditionals
K = 4  # num_speculative_tokens (= the trained block drafters' block size)
N_REQ = 16  # requests per run, more than the batch: rows are admitted while others decode
MAX_BATCH = 6
MAX_LEN = 96
BINS = {"p-order": 20, "q/p-order": 5}  # PIT histogram cells per order (see `pit`)
KINDS = ("ngram", "draft-model", "eagle3", "dflash", "dspark")
TRAINED = {
    "eagle3": eagle3.Eagle3Config(ttt_steps=3),
    "dflash": dflash.DFlashConfig(block_size=K, num_layers=1, max_anchors=16),
    "dspark": dspark.DSparkConfig(block_size=K, num_layers=1, rank=32, max_anchors=16),
}
BUILD = {"eagle3": eagle3.build, "dflash": dflash.build, "dspark": dspark.build}


@contextlib.contextmanager
def _one_thread_ctx():
    """Tiny tensors: on a shared 2-core box extra intra-op threads only spin (and one thread
    keeps every float sum in one order, so each run is bit-for-bit repeatable)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def _one_thread():
    with _one_thread_ctx():
        yield


# ---------------------------------------------------------------------------- models


def _scale_lm_head(path: Path, factor: float, noise: float = 0.0, seed: int = 0) -> Path:
    state = load_file(str(path / "model.safetensors"))
    w = state["lm_head.weight"] * factor
    if noise:
        w = w + noise * torch.randn(w.shape, generator=torch.Generator().manual_seed(seed))
    state["lm_head.weight"] = w.contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _tiny(tiny_model_dir, seed: int) -> Path:
    # 32-token vocabulary: the byte tokenizer's special ids (256+) lie outside it, so none is set
    return tiny_model_dir("llama", seed=seed, vocab_size=VOCAB, pad_token_id=None, bos_token_id=None,
                          eos_token_id=None)


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir) -> Path:
    return _scale_lm_head(_tiny(tiny_model_dir, 0), SHARPEN)


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir) -> Path:
    """Another tiny model: the target's weights with a flatter, noisy lm_head, so q != p but
    q is close enough to p that drafts are accepted about half the time."""
    return _scale_lm_head(_tiny(tiny_model_dir, 0), 0.6 * SHARPEN, noise=0.05, seed=1)


@pytest.fixture(scope="module")
def target(target_dir):
    with _one_thread_ctx():
        return load_target(str(target_dir))


@pytest.fixture(scope="module")
def specs(target, draft_dir, tmp_path_factory) -> dict[str, str]:
    """kind -> drafter spec; the trained kinds are trained briefly on text sampled from the
    target (64 sequences, 30 AdamW steps: seconds) and saved as checkpoints, so they load
    through the registry like any trained drafter."""
    with _one_thread_ctx():
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, VOCAB, (6,), generator=g).tolist() for _ in range(64)]
        llm = LLM(target, max_batch=64, max_len=64)
        outs = llm.generate(prompts, [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True)
                                      for i in range(len(prompts))])
        batch = _batch(target, [o.prompt_token_ids + o.token_ids for o in outs], prompt_len=6)
        out = {"ngram": "ngram", "draft-model": f"draft-model:{draft_dir}"}
        for kind, cfg in TRAINED.items():
            torch.manual_seed(0)
            model = BUILD[kind](target.model, cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(0)
            for _ in range(30):
                loss = model.training_loss(batch, gen).total
                opt.zero_grad()
                loss.backward()
                opt.step()
            ckpt = save_trained_drafter(model.eval(), tmp_path_factory.mktemp(kind), target.target_id,
                                        target.weights_hash)
            out[kind] = f"{kind}:{ckpt}"
    return out


# ---------------------------------------------------------------------------- the engine under test


class Probe(ForwardingDrafter):
    """Records every verification round: per request, the number of accepted drafts and the
    q each verified draft was drawn from (so each committed token's slot in its round and
    its draft distribution can be recovered); with `corrupt`, reports a wrong q to the
    verifier while the drafted tokens stay the same."""

    def __init__(self, inner, corrupt=None) -> None:
        super().__init__(inner)
        self.corrupt = corrupt
        # request id -> per round (accepted drafts m, q of the verified drafts [kept, V])
        self.rounds: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        self.kept: list[int] = []
        self.drafted: list[int] = []  # columns drafted per round (fewer where the draft gate stopped)

    def propose(self, seqs, max_lengths, **gate):
        proposal = self.inner.propose(seqs, max_lengths, **gate)
        self.drafted.append(proposal.max_len)
        self.own = proposal  # the drafter's own proposal: its q is what the drafts came from
        if self.corrupt is not None and proposal.max_len:
            proposal = self.corrupt(proposal)
        return proposal

    def on_verified(self, seqs, proposal, result, features):
        lengths = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
        for b, s in enumerate(seqs):
            n = lengths[b]
            if self.own.q is None:  # deterministic drafts: q is one-hot at the draft
                q = torch.zeros(n, VOCAB).scatter_(1, proposal.tokens[b, :n, None].cpu(), 1.0)
            else:
                q = self.own.q[b, :n].detach().double().cpu()
            self.rounds[s.request_id].append((int(result.num_accepted[b]), q))
        if proposal.max_len:
            self.kept.extend(lengths)
        self.inner.on_verified(seqs, proposal, result, features)


def sharpened_q(proposal: Proposal) -> Proposal:
    """BROKEN (test-only), for sampled drafts: report q' = normalise(q^2) while the tokens were
    drawn from q (as if the drafter warped with half the temperature it sampled with). q'
    claims a likely draft was likelier than it was, so the verifier accepts it too rarely
    (p/q' < p/q) and its residual max(p - q', 0) takes too much from the likely tokens."""
    if proposal.q is None:
        return proposal
    q = proposal.q.clamp_min(0).square()
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)  # padding rows (all zero) stay zero
    return dataclasses.replace(proposal, q=q)


def soft_one_hot_q(proposal: Proposal, claimed: float = 0.1) -> Proposal:
    """BROKEN (test-only), for deterministic drafts. The n-gram proposal has no q to corrupt
    (q = None means one-hot at the draft, which the verifier reads as acceptance p(x) and
    residual p with x zeroed), so report one: claim the draft had probability `claimed` (the
    rest spread evenly) instead of its true 1. The verifier then accepts the draft with
    min(1, p/claimed) > p and its residual keeps mass on the draft: the output leans towards
    whatever the n-gram lookup proposes."""
    if proposal.q is not None:
        return proposal
    B, Kp = proposal.tokens.shape
    q = torch.full((B, Kp, VOCAB), (1.0 - claimed) / (VOCAB - 1))
    q.scatter_(-1, proposal.tokens.clamp(0, VOCAB - 1)[..., None], claimed)
    return dataclasses.replace(proposal, q=q)


def wrong_q(kind: str):
    return soft_one_hot_q if kind == "ngram" else sharpened_q


def _prefix_scheduler() -> PrefixScheduler:
    # A fixed, made-up SPS(B) table and no online cost model (adapt=False): the scheduler's
    # choices then depend on confidences, running acceptance and the batch size, never on
    # timings, so runs repeat exactly. (The registry's "prefix-scheduler" profiles the machine.)
    sps = SPSTable((1, 6, 30), (100.0, 98.0, 80.0))
    return PrefixScheduler(sps, max_k=K, adapt=False, min_gain=0.0)


def _prefix_scheduler_drafting_every_column() -> PrefixScheduler:
    return dataclasses.replace(_prefix_scheduler(), stop_drafting=False)


POLICIES = {
    "fixed": lambda: FixedK(K),
    # load-dependent: K by the number of running rows (6, then fewer as the queue drains)
    "batch-schedule": lambda: BatchSizeSchedule(((2, K), (4, 3), (MAX_BATCH, 2))),
    # load- and confidence-dependent: DSpark's Algorithm 1 (with its early stop) for DSpark,
    # running acceptance for the others
    "prefix-scheduler": _prefix_scheduler,
    # the same without the draft gate: DSpark drafts every column and trim() cuts (the reference
    # for the gate's "same verify lengths")
    "prefix-scheduler-ungated": _prefix_scheduler_drafting_every_column,
}


def _workload(warped: bool, seeded: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    """N_REQ ragged requests: prompts of 2..14 tokens, max_tokens 34..63. warped: rows cycle
    through top-k, top-p, both, temperature 0.8 and min-p (the others stay at T = 1)."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (2 + (5 * i) % 13,), generator=g).tolist() for i in range(N_REQ)]
    warps = [dict()]
    if warped:
        warps = [dict(top_k=6), dict(top_p=0.85), dict(top_k=10, top_p=0.9), dict(temperature=0.8),
                 dict(min_p=0.05), dict()]
    params = [SamplingParams(max_tokens=34 + (11 * i) % 30, seed=1000 + i if seeded else None, ignore_eos=True,
                             **{"temperature": 1.0, **warps[i % len(warps)]})
              for i in range(N_REQ)]
    return prompts, params


@dataclasses.dataclass
class Run:
    u: dict[str, torch.Tensor]  # order -> [N] PIT values, one per generated token (see `pit`)
    slot: torch.Tensor  # [N] position of the token within its verification round (0..K)
    acceptance: float
    kept: list[int]  # verify lengths of every round that drafted
    tokens: list[list[int]]
    zero_p: int  # generated tokens the teacher-forced warp gives probability 0 (must be 0)
    drafted: list[int]  # columns drafted per round


def generate(target, spec: str, policy: str = "fixed", warped: bool = False, mode: str = "rejection",
             corrupt=None) -> Run:
    """One LLM.generate over the ragged workload, then the PIT of every generated token.

    mode: "rejection" (seeded requests verified by the rejection rule, where q matters),
    "coupled" (seeded requests, position-keyed coupling: the engine's default), "unseeded"
    (no seeds: the rejection rule on the global RNG, seeded here for repeatability)."""
    drafter = Probe(build_drafter(spec, target, MAX_BATCH, MAX_LEN) if spec != "none" else NoDrafter(), corrupt)
    llm = LLM(target, drafter=drafter, num_speculative_tokens=K, policy=POLICIES[policy](), max_batch=MAX_BATCH,
              max_len=MAX_LEN, reproducible_seeds=mode == "coupled")
    prompts, params = _workload(warped, seeded=mode != "unseeded")
    if mode == "unseeded":
        torch.manual_seed(4242)
    outs = llm.generate(prompts, params)
    slots, qs = [], []
    for o in outs:
        rounds = drafter.rounds[o.request_id]
        s = torch.cat([torch.arange(m + 1) for m, _ in rounds])
        # the draft distribution of each committed token; zeros where it had no draft (the
        # bonus, or a round without drafts)
        q = torch.cat([torch.cat([qr[: m + 1], torch.zeros(m + 1 - len(qr[: m + 1]), VOCAB, dtype=torch.float64)])
                       for m, qr in rounds])
        assert len(s) == len(q) == len(o.token_ids) == o.outputs[0].stats["committed"], o.request_id
        slots.append(s)
        qs.append(q)
    u, zero_p = pit(target, outs, params, qs)
    return Run(u, torch.cat(slots), llm.last_stats.acceptance_rate, drafter.kept, [o.token_ids for o in outs],
               zero_p, drafter.drafted)


def pit(target, outs, params, qs) -> tuple[dict[str, torch.Tensor], int]:
    """u_t = F_t(x_t-) + V_t p_t(x_t) for every generated token x_t: p_t the target's warped
    conditional (teacher-forced: one forward over prompt + output gives all of them), F_t
    its CDF in a token order fixed by the past, V_t ~ U(0, 1) from a fixed generator.

    If the engine is lossless, x_t ~ p_t given everything before it, so the u_t are iid
    U(0, 1) for ANY order that the past determines; the order only decides which biases
    show. (With the plain id order a bias towards likely tokens, or towards drafts, lands at
    a different place of [0, 1] in every context and mostly cancels out.) Two orders:

    - "p-order": p_t descending (ties by id). Too many (too few) likely tokens -> too many
      small (large) u: catches a q reported sharper than the one sampled from.
    - "q/p-order": where x_t was drawn as draft j of its round, q_t/p_t descending, q_t that
      draft's distribution (qs[b][t]), then as p-order; elsewhere p-order. q_t is fixed by
      the past: it is computed before the draft is sampled, from committed tokens only (the
      drafts before j were accepted). A verifier that favours drafts where q > p (q reported
      too flat, a residual drawn from p instead of max(p - q, 0)) puts too many u near 0;
      a deterministic draft (n-gram, q one-hot) comes first. Ordering by the sampled draft
      itself would NOT be allowed: it is random given the past.
    """
    m = target.model
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    B, L = len(seqs), max(map(len, seqs))
    ids = torch.zeros(B, L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        logits = m(ids, m.new_cache(B, L), rows=torch.arange(B)).logits  # [B, L, V]
    p = target_probs(logits, list(params)).double()  # the engine's warp, per request
    g = torch.Generator().manual_seed(99)
    us: dict[str, list[torch.Tensor]] = {"p-order": [], "q/p-order": []}
    zero_p = 0
    for b, o in enumerate(outs):
        n0, n = len(o.prompt_token_ids), len(o.token_ids)
        pb = p[b, n0 - 1 : n0 - 1 + n]  # [n, V]: the conditional of each generated token
        pb = pb / pb.sum(-1, keepdim=True)
        x = torch.tensor(o.token_ids)[:, None]  # [n, 1]
        px = pb.gather(1, x)  # [n, 1]
        v = torch.rand(n, generator=g, dtype=torch.float64) * px[:, 0]
        vocab = torch.arange(pb.shape[1])[None]  # [1, V]
        by_p = (pb > px) | ((pb == px) & (vocab < x))  # [n, V]: y ranked before x_t by p, then id
        key = torch.where(pb > 0, qs[b] / pb.clamp_min(1e-300), 0.0)  # [n, V] q/p, all 0 without a draft
        kx = key.gather(1, x)
        by_qp = (key > kx) | ((key == kx) & by_p)
        us["p-order"].append((pb * by_p).sum(-1) + v)
        us["q/p-order"].append((pb * by_qp).sum(-1) + v)
        zero_p += int((px <= 0).sum())
    return {k: torch.cat(u) for k, u in us.items()}, zero_p


def uniform_pvalue(u: torch.Tensor, bins: int) -> float:
    counts = torch.histc(u.float(), bins=bins, min=0.0, max=1.0)
    return chi2_pvalue(counts, torch.full((bins,), 1.0 / bins))


def pvalues(u: dict[str, torch.Tensor], slot: torch.Tensor) -> dict[str, float]:
    """The pooled check in both orders, and per draft slot j in q/p-order (the tokens at
    position j of their round: accepted draft j, or the token sampled at j after a rejection
    or as the bonus); the slots from the first one with fewer than 50 tokens on are pooled."""
    pv = {order: uniform_pvalue(u[order], bins) for order, bins in BINS.items()}
    uq, bins = u["q/p-order"], BINS["q/p-order"]
    for j in range(K + 1):
        if int((slot == j).sum()) < 50:
            if int((slot >= j).sum()) >= 5 * bins:
                pv[f"slot>={j}"] = uniform_pvalue(uq[slot >= j], bins)
            break
        pv[f"slot{j}"] = uniform_pvalue(uq[slot == j], bins)
    return pv


# ---------------------------------------------------------------------------- tests

CASES = {  # id: (policy, warped, mode)
    "fixed-T1": ("fixed", False, "rejection"),
    "batch-schedule-warped": ("batch-schedule", True, "rejection"),
    "prefix-scheduler-warped": ("prefix-scheduler", True, "rejection"),
    "fixed-warped-unseeded": ("fixed", True, "unseeded"),
}


@pytest.fixture(scope="module")
def runs(target, specs):
    """(kind, case) -> Run, each generated once (the pooled-per-kind test reuses them)."""
    done: dict[tuple[str, str], Run] = {}

    def get(kind: str, case: str) -> Run:
        if (kind, case) not in done:
            done[kind, case] = generate(target, specs[kind], *CASES[case])
        return done[kind, case]

    return get


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_generated_tokens_are_uniform_under_the_pit(kind, case, runs):
    run = runs(kind, case)
    pv = pvalues(run.u, run.slot)
    assert run.zero_p == 0
    assert min(pv.values()) >= ALPHA, pv
    # both paths of the verifier ran: drafts accepted and drafts rejected
    assert 0.1 < run.acceptance < 0.9, run.acceptance
    counts = torch.bincount(run.slot, minlength=K + 1)
    if CASES[case][0] == "fixed":  # every draft position was reached (K accepted: the bonus slot)
        assert (counts >= 5).all(), counts.tolist()
    else:  # the load-dependent policy verified varied lengths
        assert len(set(run.kept)) >= 4, sorted(set(run.kept))


@pytest.mark.parametrize("kind", KINDS)
def test_all_runs_of_a_kind_pooled(kind, runs):
    """The four runs of a kind together (~3000 tokens): more power for the same checks."""
    rs = [runs(kind, case) for case in CASES]
    u = {order: torch.cat([r.u[order] for r in rs]) for order in BINS}
    pv = pvalues(u, torch.cat([r.slot for r in rs]))
    assert min(pv.values()) >= ALPHA, pv


@pytest.mark.parametrize("kind", KINDS)
def test_negative_control_wrong_q_fails_the_same_check(kind, target, specs):
    """The fixed-T1 run again, with a drafter that reports a wrong q for the same drafted
    tokens: the same check must fail, by far."""
    run = generate(target, specs[kind], *CASES["fixed-T1"], corrupt=wrong_q(kind))
    pv = pvalues(run.u, run.slot)
    assert min(pv[order] for order in BINS) < CONTROL_MAX_P, pv


def test_negative_control_verifier_bug_fails_the_pooled_check(target, specs, monkeypatch):
    """An engine-side bug instead of a drafter-side one: after a rejection the verifier
    samples from p instead of the residual max(p - q, 0) (test-only monkeypatch of
    core/verify.py). Each run alone is only weakly off (p ~ 1e-5 - 1e-2), the pooled check
    over the four runs of a kind catches it."""
    import draftsmith.core.verify as verify_module

    monkeypatch.setattr(verify_module, "_residual", lambda final, q, tokens, num_accepted, rejected: final)
    rs = [generate(target, specs["dspark"], *CASES[case]) for case in CASES]
    u = {order: torch.cat([r.u[order] for r in rs]) for order in BINS}
    pv = pvalues(u, torch.cat([r.slot for r in rs]))
    assert min(pv.values()) < CONTROL_MAX_P, pv


def test_draft_gate_changes_the_work_not_the_output(target, specs, runs):
    """DSpark under the prefix scheduler stops drafting at the first column the column search
    will not open (policy/prefix_scheduler.py, draft_gate). Against the same run drafting every
    column (sampled, warped, seeded rejection rule: the drafts' uniforms are drawn before the
    loop, so stopping changes no later draw): the same tokens and the same verify length in
    every round, with fewer columns drafted. (The gated run is the PIT-checked
    prefix-scheduler-warped run above.)"""
    gated = runs("dspark", "prefix-scheduler-warped")
    every = generate(target, specs["dspark"], "prefix-scheduler-ungated", True, "rejection")
    assert gated.tokens == every.tokens
    assert gated.kept == every.kept
    assert len(gated.drafted) == len(every.drafted)
    assert all(g <= e for g, e in zip(gated.drafted, every.drafted))
    assert sum(gated.drafted) < sum(every.drafted), (sum(gated.drafted), sum(every.drafted))


@pytest.fixture(scope="module")
def plain_coupled(target) -> Run:
    with _one_thread_ctx():
        return generate(target, "none", "fixed", True, "coupled")


def test_plain_seeded_decoding_is_uniform_under_the_pit(plain_coupled):
    pv = pvalues(plain_coupled.u, plain_coupled.slot)
    assert plain_coupled.zero_p == 0
    assert min(pv.values()) >= ALPHA, pv


@pytest.mark.parametrize("kind", KINDS)
def test_coupled_verification_is_plain_decoding_and_ignores_q(kind, target, specs, plain_coupled):
    """Position-keyed coupling (seeded requests, the engine's default): every committed token
    is the plain seeded one, so the PIT check of plain decoding above covers this mode for
    every drafter and policy; and q is never read, so the wrong q that breaks the rejection
    rule changes nothing here (no PIT negative control can exist for this mode)."""
    good = generate(target, specs[kind], "prefix-scheduler", True, "coupled")
    bad = generate(target, specs[kind], "prefix-scheduler", True, "coupled", corrupt=wrong_q(kind))
    assert good.tokens == plain_coupled.tokens
    assert bad.tokens == good.tokens
    assert 0.1 < good.acceptance < 0.9, good.acceptance
