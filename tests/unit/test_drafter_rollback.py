"""Drafter rollback: after a verify round that rejects part of a block, the next proposal must be
exactly what a freshly started drafter proposes for the committed prefix.

A stateful drafter (the draft model's own KV cache; the EAGLE-3 / DFlash / DSpark context caches
fed by target features; n-gram, stateless, as the baseline) that keeps anything of the rejected
drafts proposes worse drafts from then on. Output stays lossless, only acceptance drops, so
greedy-equality tests cannot see it. Here a recording wrapper keeps, at every propose() of a real
`LLM.generate` run (6 ragged prompts of 1..31 tokens on 3 rows, so rows are freed and reused; K = 4),
each drafting row's committed sequence, cap and proposal. Then, for each recorded row, a NEW
drafter of the same kind is started on that committed prefix, with the target's features of all
but the pending last token computed in one prefill as the engine's admission does
(engine.py: _admit), and must propose the same tokens (q and DSpark's confidences within 1e-4:
the run's features come from verify forwards, the fresh ones from one prefill). Two runs per kind:
greedy, and a batch mixing greedy rows with seeded T = 1 rows (a seeded draft k uses its output
position's uniform, drafters/base.py: row_uniforms, so the proposal is a function of its inputs).
Each run must contain partial rejections (0 < accepted < proposed) and compare the proposals right
after them.

The draft model is the target plus 5% weight noise; the trained kinds are the tiny configs of
test_trained_drafters.py, trained 30 steps on the target's own continuations of these prompts.

Seen on a 2-core CPU (float32; the counts are deterministic there; the file takes 10-15 s):

    kind / run             rounds  proposals compared  partial rejections  compared right after one  mismatches
    ngram greedy           178     175                 9                   8                         0
    ngram greedy+T=1       198     192                 11                  10                        0
    draft-model greedy     45      44                  14                  14                        0
    draft-model greedy+T=1 58      57                  17                  17                        0
    eagle3 greedy          67      65                  11                  10                        0
    eagle3 greedy+T=1      77      73                  10                  8                         0
    dflash greedy          67      65                  10                  9                         0
    dflash greedy+T=1      73      69                  13                  12                        0
    dspark greedy          42      39                  18                  17                        0
    dspark greedy+T=1      62      59                  17                  15                        0

Negative controls (greedy; the output stays equal to plain greedy, the check must fail):
- draft-model, `KeepsRejectedDrafts`: never truncates its KV cache; the rejected drafts stay in
  its context and each round appends what was committed after them: 69 of 82 proposals differ.
  (Merely skipping the trim is not silent in draft_model.py: with 0 <= accepted < K - 1 the next
  catch-up feed is empty and the decoder fails with "index -1 is out of bounds".)
- eagle3 / dflash / dspark, `RejectedFeatures`: on a rejection the committed positions' features
  are taken from the block's tail, so rejected drafts' positions enter the context:
  34 of 66, 37 of 67 and 26 of 38 proposals differ.
  (Telling a feature-fed drafter that every draft was accepted is harmless: feature_queue.py's
  committed_feature_counts caps the count at what was really committed; 0 mismatches.)
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import LLM, SamplingParams
from draftsmith.core.request import Request
from draftsmith.drafters.base import TargetFeatures
from draftsmith.drafters.draft_model import DraftModelDrafter
from draftsmith.drafters.ngram import NgramDrafter
from draftsmith.models.target import load_target
from drafter_wrappers import ForwardingDrafter  # noqa: E402  (tests/unit helper)
from test_trained_drafters import BUILD, CONFIGS, PROMPT, _batch, _sharpen  # noqa: E402  (tests/unit helpers)

MAX_LEN = 96
K = 4
# Ragged prompts (1..31 tokens), more requests than rows: rows are freed and reused mid-run.
PROMPTS = [
    [104],  # "h": one token, no context features at the first round (EAGLE-3 drafts nothing then)
    list(b"hello world, hello world, hello"),
    list(b"abcabcabcabc"),
    list(b"def f(x):\n    return x"),
    PROMPT,
    list(b"zzz zz z"),
]
GREEDY = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 14, 24, 18, 22, 16)]
# Greedy rows mixed with seeded T = 1 rows: every drafter here draws draft k of a seeded request with
# the uniform of its output position (drafters/base.py: row_uniforms; draft_model.py), so its
# proposal is a function of its inputs and a fresh drafter must reproduce it, q included.
MIXED = [SamplingParams(max_tokens=n, temperature=0.0 if i % 2 else 1.0, seed=None if i % 2 else 100 + i,
                        ignore_eos=True) for i, n in enumerate((20, 14, 24, 18, 22, 16))]
ATOL = 1e-4  # q / confidences: the run's features come from verify forwards, a fresh start's from one prefill

TRAINED = ["eagle3", "dflash", "dspark"]
TRAIN_STEPS = 30


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir) -> Path:
    return _sharpen(tiny_model_dir("llama", seed=0))


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir), threads=1)


@pytest.fixture(scope="module")
def draft_model(target_dir, tmp_path_factory):
    """An independent draft model: the target's weights plus noise (accepted often, not always)."""
    out = tmp_path_factory.mktemp("draft")
    shutil.copytree(target_dir, out, dirs_exist_ok=True)
    state = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    state = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return load_target(str(out), threads=1).model


@pytest.fixture(scope="module")
def trained(target):
    """kind -> a tiny drafter trained for a few seconds (trained once per module).

    It only has to be accepted sometimes, not always: trained on the target's own continuations
    of PROMPTS (greedy and T = 1), 30 AdamW steps give every kind ~10-15 partial rejections per
    run; trained on unrelated sequences, a tiny drafter is rejected outright almost every round."""
    models: dict[str, torch.nn.Module] = {}
    batch = {}

    def get(kind: str):
        if kind not in models:
            torch.set_num_threads(1)
            if not batch:
                outs = LLM(target, max_batch=12, max_len=MAX_LEN).generate(PROMPTS * 2, GREEDY + MIXED)
                batch["b"] = _batch(target, [o.prompt_token_ids + o.token_ids for o in outs], prompt_len=2)
            torch.manual_seed(0)
            model = BUILD[kind](target.model, CONFIGS[kind])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(0)
            for _ in range(TRAIN_STEPS):
                loss = model.training_loss(batch["b"], gen).total
                opt.zero_grad()
                loss.backward()
                opt.step()
            models[kind] = model.eval()
        return models[kind]

    return get


# ---------------------------------------------------------------------------- recording


@dataclass
class Call:
    """One row of one propose() call: the committed sequence and what the drafter proposed."""

    prompt: list[int]
    output: list[int]
    params: SamplingParams
    cap: int
    tokens: list[int]
    q: torch.Tensor | None  # [n, V] or None (deterministic: one-hot)
    conf: torch.Tensor | None  # [n] or None
    after_partial: bool  # this request's previous round accepted 0 < a < proposed


class Recorder(ForwardingDrafter):
    """Records every row's committed sequence and proposal, and every round's acceptance."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.calls: list[Call] = []
        self.rounds: list[tuple[int, int]] = []  # (proposed, accepted) per row per round
        self._partial: dict[str, bool] = {}

    def propose(self, seqs, max_lengths):
        p = self.inner.propose(seqs, max_lengths)
        for b, (s, cap) in enumerate(zip(seqs, max_lengths)):
            if cap <= 0:
                continue
            n = int(p.lengths[b]) if p.max_len else 0
            self.calls.append(Call(
                list(s.prompt_ids), list(s.output_ids), s.params, cap, p.tokens[b, :n].tolist(),
                None if p.q is None else p.q[b, :n].detach().float().cpu().clone(),
                None if p.confidences is None else p.confidences[b, :n].detach().float().cpu().clone(),
                self._partial.get(s.request_id, False)))
        return p

    def on_verified(self, seqs, proposal, result, features):
        lengths = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
        for s, n, m in zip(seqs, lengths, result.num_accepted.tolist()):
            self.rounds.append((n, m))
            self._partial[s.request_id] = 0 < m < n
        super().on_verified(seqs, proposal, result, features)

    @property
    def partial_rejections(self) -> int:
        return sum(0 < m < n for n, m in self.rounds)


# ---------------------------------------------------------------------------- the check


@dataclass
class Report:
    compared: int
    after_partial: int  # compared proposals whose previous round was a partial rejection
    mismatches: list[str]


def _one_hot(tokens: list[int], V: int) -> torch.Tensor:
    return torch.zeros(len(tokens), V).scatter_(1, torch.tensor(tokens, dtype=torch.long).view(-1, 1), 1.0)


@torch.inference_mode()
def compare_with_fresh(calls: list[Call], make_fresh, target) -> Report:
    """For each recorded proposal: start a FRESH drafter on that committed prefix (with the
    target's features of every committed position but the pending last one, computed in one
    prefill as the engine's admission does) and compare its proposal with the recorded one."""
    model = target.model
    V = model.config.vocab_size
    cache = model.new_cache(1, MAX_LEN)  # the forward never advances its lengths: reusable
    bad: list[str] = []
    for j, c in enumerate(calls):
        drafter = make_fresh()
        seq = Request(request_id=f"fresh-{j}", prompt_ids=list(c.prompt), params=c.params, generator=None,
                      output_ids=list(c.output))
        seq.row = 0
        prefix = seq.all_ids[:-1]
        needs = drafter.needs
        features = None
        if (needs.layer_ids or needs.final_hidden) and prefix:
            out = model(torch.tensor([prefix]), cache, rows=torch.tensor([0]), layer_ids=tuple(needs.layer_ids),
                        compute_logits=False)
            features = TargetFeatures(hidden=dict(out.hidden),
                                      final_hidden=out.final_hidden if needs.final_hidden else None)
        drafter.start(seq, features)
        p = drafter.propose([seq], [c.cap])
        n = int(p.lengths[0]) if p.max_len else 0
        tokens = p.tokens[0, :n].tolist()
        where = f"call {j} (row at {seq.num_tokens} tokens, cap {c.cap}, after partial={c.after_partial})"
        if tokens != c.tokens:
            bad.append(f"{where}: recorded {c.tokens}, fresh {tokens}")
            continue
        if n:
            q_rec = c.q if c.q is not None else _one_hot(c.tokens, V)
            q_new = p.q[0, :n].float().cpu() if p.q is not None else _one_hot(tokens, V)
            if not torch.allclose(q_rec, q_new, atol=ATOL, rtol=0):
                bad.append(f"{where}: q differs by {float((q_rec - q_new).abs().max()):.3g}")
                continue
            if (c.conf is None) != (p.confidences is None):
                bad.append(f"{where}: confidences present in one proposal only")
            elif c.conf is not None and not torch.allclose(c.conf, p.confidences[0, :n].float(), atol=ATOL, rtol=0):
                bad.append(f"{where}: confidences differ by {float((c.conf - p.confidences[0, :n]).abs().max()):.3g}")
        drafter.release(seq)
    return Report(len(calls), sum(c.after_partial for c in calls), bad)


def assert_rollback_exact(report: Report) -> None:
    assert not report.mismatches, (
        f"{len(report.mismatches)} of {report.compared} proposals differ from a fresh drafter's on the "
        "committed prefix (state of rejected drafts kept?):\n" + "\n".join(report.mismatches[:8]))


def _run(target, drafter, params) -> Recorder:
    rec = Recorder(drafter)
    llm = LLM(target, drafter=rec, policy="fixed", num_speculative_tokens=K, max_batch=3, max_len=MAX_LEN)
    outs = llm.generate(PROMPTS, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    return rec


# ---------------------------------------------------------------------------- drafters


def _factory(kind: str, target, draft_model, trained):
    """A function returning a NEW drafter of `kind` (1 row: a fresh start; 3 rows: the run's)."""
    if kind == "ngram":
        return lambda rows=1: NgramDrafter()
    if kind == "draft-model":
        V = target.model.config.vocab_size
        return lambda rows=1: DraftModelDrafter(draft_model, V, rows, MAX_LEN)
    model = trained(kind)
    return lambda rows=1: model.make_drafter(target.model, rows, MAX_LEN)


KINDS = ["ngram", "draft-model", *TRAINED]


@pytest.mark.parametrize("sampling", ["greedy", "t1-seeded"])
@pytest.mark.parametrize("kind", KINDS)
def test_next_proposal_equals_a_fresh_drafter_on_the_committed_prefix(kind, sampling, target, draft_model, trained):
    make = _factory(kind, target, draft_model, trained)
    params = GREEDY if sampling == "greedy" else MIXED
    if kind == "ngram":  # n-gram matches are rarer: longer outputs for ~10 partial rejections
        params = [dataclasses.replace(p, max_tokens=40) for p in params]
    rec = _run(target, make(3), params)
    # the test is about rounds that rejected part of a block: they must have happened, and
    # the proposals right after them must be among those compared
    assert rec.partial_rejections > 0, rec.rounds
    report = compare_with_fresh(rec.calls, make, target)
    print(f"\n{kind}/{sampling}: compared {report.compared}, rounds {len(rec.rounds)}, partial rejections "
          f"{rec.partial_rejections}, compared after a partial rejection {report.after_partial}")
    assert report.after_partial > 0
    assert_rollback_exact(report)


# ---------------------------------------------------------------------------- negative controls


class _CacheView:
    """A request as seen by a drafter whose cache holds `extra` tokens more than were committed:
    padded in front, so that `all_ids[cache length:]` is what was committed after them."""

    def __init__(self, seq, extra: int) -> None:
        self._seq, self._extra = seq, extra

    def __getattr__(self, name):
        return getattr(self._seq, name)

    @property
    def all_ids(self):
        return [0] * self._extra + self._seq.all_ids

    @property
    def num_tokens(self):
        return self._seq.num_tokens + self._extra


class KeepsRejectedDrafts(DraftModelDrafter):
    """Broken rollback: never truncates its KV cache after verification. The rejected drafts stay
    in the draft model's context, and each round appends only what was committed after them, as
    if they had been accepted. (Merely skipping the trim is not silent in draft_model.py: the next
    catch-up feed is empty and the decoder fails; this is the silent form of the same bug.)"""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.kept: dict[int, int] = {}

    def start(self, seq, features):
        super().start(seq, features)
        self.kept[seq.row] = 0

    def propose(self, seqs, max_lengths):
        return super().propose([_CacheView(s, self.kept[s.row]) for s in seqs], max_lengths)

    def on_verified(self, seqs, proposal, result, features):
        for b, s in enumerate(seqs):
            st = self.states[s]
            if st.k:
                self.kept[s.row] += st.k - 1 - min(int(result.num_accepted[b]), st.k - 1)
                st.k = 0


class RejectedFeatures(ForwardingDrafter):
    """Broken rollback for feature-fed drafters: on a partial rejection, the committed positions'
    features are taken from the block's tail, i.e. the rejected drafts' positions enter the
    drafter's context as if they had been accepted (a right- instead of left-aligned slice)."""

    def on_verified(self, seqs, proposal, result, features):
        lengths = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
        hidden = {i: h.clone() for i, h in features.hidden.items()}
        for b, (n, m) in enumerate(zip(lengths, result.num_accepted.tolist())):
            if m < n:  # committed: positions 0..m; the tail of the block ends at n
                for i, h in features.hidden.items():
                    hidden[i][b, : m + 1] = h[b, n - m : n + 1]
        self.inner.on_verified(seqs, proposal, result, TargetFeatures(hidden, features.final_hidden))


@pytest.mark.parametrize("kind", ["draft-model", *TRAINED])
def test_negative_control_broken_rollback_is_detected(kind, target, draft_model, trained):
    make = _factory(kind, target, draft_model, trained)
    if kind == "draft-model":  # room for the rejected drafts it keeps
        broken = KeepsRejectedDrafts(draft_model, target.model.config.vocab_size, 3, 4 * MAX_LEN)
    else:
        broken = RejectedFeatures(make(3))
    rec = Recorder(broken)
    llm = LLM(target, drafter=rec, policy="fixed", num_speculative_tokens=K, max_batch=3, max_len=MAX_LEN)
    outs = llm.generate(PROMPTS, GREEDY)
    # lossless all the same: only the drafts (and acceptance) suffer
    plain = LLM(target, max_batch=3, max_len=MAX_LEN).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert rec.partial_rejections > 0
    report = compare_with_fresh(rec.calls, make, target)
    print(f"\n{kind} broken by {type(broken).__name__}: {len(report.mismatches)} mismatches of {report.compared} "
          f"compared ({report.after_partial} after a partial rejection)")
    assert len(report.mismatches) > 0
    with pytest.raises(AssertionError):
        assert_rollback_exact(report)


