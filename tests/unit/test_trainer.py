"""The training loop, checkpoints and exact resume, with a tiny stand-in drafter (standin_drafter.py).

Every run here takes well under a second of compute: a 3-layer hidden-64 target and a
linear head, a few dozen short synthetic conversations.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.errors import DraftsmithError
from draftsmith.train import checkpoint as ckpt_io
from draftsmith.train.config import parse_config
from draftsmith.train.trainer import Trainer, lr_factor

from standin_drafter import CATALOGUE, sequence_records

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    return tiny_model_dir("llama", seed=0)


@pytest.fixture(scope="module")
def regen_file(tmp_path_factory):
    return sequence_records(tmp_path_factory.mktemp("regen") / "regen.jsonl", n=24)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, target_dir, regen_file):
    from draftsmith.data.cache import CacheConfig, run_cache

    out = tmp_path_factory.mktemp("cache")
    run_cache(CacheConfig(target=str(target_dir), data=regen_file, out=out, layers="0,1", dtype="fp32",
                          shard_tokens=300, progress=False))
    return out



def trained_params(trainer: Trainer) -> dict:
    """Current trainable parameters (CPU copies), to compare runs."""
    return {n: p.detach().to("cpu").clone() for n, p in trainer.params.items()}

def make_cfg(target_dir, cache_dir, out, **train):
    raw = {"target": str(target_dir), "out": str(out), "drafter": {"kind": "head", "layer_ids": [0]},
           "data": {"cache": str(cache_dir), "max_len": 32},
           "train": {"batch_size": 4, "max_steps": 6, "save_every": 3, "log_every": 1, "lr": 3e-3,
                     "progress": "off", "tensorboard": "off", "threads": 1, **train}}  # 1 thread: same float
    # reduction order in this process and in the killed subprocess, whatever other tests set
    return parse_config(raw, CATALOGUE, num_layers=3)


def heldout_rows(out) -> list[dict]:
    """The held-out evaluation rows a run wrote (train/evaluate.py), one per scoring."""
    return [json.loads(x) for x in (out / "heldout.jsonl").read_text().splitlines()]


def test_lr_schedule_warmup_then_cosine():
    total = 100
    f = [lr_factor(s, total, 0.04, 0.0) for s in range(total)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]  # 4 warmup steps
    assert f[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))  # cosine decreases
    assert f[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 95 / 96)))
    assert lr_factor(50, 100, 0.0, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)


def test_train_writes_checkpoints_and_log(target_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    res = Trainer(make_cfg(target_dir, cache_dir, out, max_steps=12, lr=1e-2), CATALOGUE).fit()
    assert res.step == 12 and res.total_steps == 12
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["loss"] < rows[0]["loss"] * 0.8  # it learns the deterministic chain
    assert {"lr", "grad_norm", "ce", "acc@1", "epoch", "elapsed_s"} <= set(rows[0])
    # warmup: ceil(0.04 * 12) = 1 step, then cosine
    assert rows[0]["lr"] == pytest.approx(1e-2) and rows[-1]["lr"] < 1e-3
    # keep_checkpoints=2: steps 9 and 12 remain; the top level is the newest one's export
    assert [s for s, _ in ckpt_io.list_checkpoints(out)] == [9, 12]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["kind"] == "head" and cfg["target_id"] == target_dir.name and cfg["format_version"] == 1
    assert cfg["layer_ids"] == [0] and "target_weights_hash" in cfg
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == {"proj.weight", "proj.bias", "norm.weight", "norm.bias"}  # no frozen lm_head
    assert os.path.samefile(out / "model.safetensors", out / "checkpoint-00000012" / "model.safetensors")
    assert json.loads((out / "train_info.json").read_text())["step"] == 12
    meta = json.loads((out / "checkpoint-00000012" / "train_state" / "meta.json").read_text())
    assert meta["data_position"]["epoch"] >= 1 and meta["run_config"]["drafter"]["kind"] == "head"
    # an existing run is not silently overwritten
    with pytest.raises(DraftsmithError, match="--resume"):
        Trainer(make_cfg(target_dir, cache_dir, out), CATALOGUE).fit()


def test_heldout_never_read(target_dir, cache_dir, tmp_path):
    from draftsmith.data.sources.conversation import split_of
    from draftsmith.models.target import load_target
    from draftsmith.train.data import TrainData

    cfg = make_cfg(target_dir, cache_dir, tmp_path / "x")
    data = TrainData(cfg.data, load_target(str(target_dir)), (0,), seed=0, batch_size=4)
    ids = set(data.samples)
    assert ids and not any("heldout" in i for i in ids)
    assert all(split_of(i) == "train" for i in ids)
    assert data.excluded_heldout >= 2
    assert all(w.end - w.start <= 32 for w in data.windows)
    # order: a permutation per epoch, reproducible, different between epochs
    assert data.epoch_order(0) == data.epoch_order(0) and data.epoch_order(0) != data.epoch_order(1)
    assert sorted(map(id, data.epoch_order(1))) == sorted(map(id, data.windows))
    # two ranks split each global batch into disjoint halves
    tgt = load_target(str(target_dir))
    r0 = TrainData(cfg.data, tgt, (0,), 0, 4, rank=0, world_size=2)
    r1 = TrainData(cfg.data, tgt, (0,), 0, 4, rank=1, world_size=2)
    assert r0.rank_windows(3) + r1.rank_windows(3) == data.rank_windows(3)


def _run_until_exception(cfg, at_step):
    class Killed(Exception):
        pass

    def hook(step, trainer):
        if step == at_step:
            raise Killed

    with pytest.raises(Killed):
        Trainer(cfg, CATALOGUE, hooks=[hook]).fit()


def test_resume_after_exception_equals_straight_run(target_dir, cache_dir, tmp_path):
    straight = Trainer(make_cfg(target_dir, cache_dir, tmp_path / "a"), CATALOGUE)
    straight.fit()
    _run_until_exception(make_cfg(target_dir, cache_dir, tmp_path / "b"), at_step=3)
    assert [s for s, _ in ckpt_io.list_checkpoints(tmp_path / "b")] == [3]
    resumed = Trainer(make_cfg(target_dir, cache_dir, tmp_path / "b"), CATALOGUE, resume=True)
    resumed.fit()
    a, b = trained_params(straight), trained_params(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la = [json.loads(x)["loss"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert la == lb  # the log was continued, not duplicated


def test_resume_after_sigkill_equals_straight_run(target_dir, cache_dir, tmp_path):
    """A real SIGKILL (no cleanup runs) right after the step-4 checkpoint, mid-way through a save of 6 is
    simulated by a stray temporary directory; the resume picks checkpoint 4 and ends identical."""
    straight = Trainer(make_cfg(target_dir, cache_dir, tmp_path / "a", max_steps=8, save_every=2), CATALOGUE)
    straight.fit()
    out = tmp_path / "b"
    script = f"""
import json, os, signal, sys
sys.path.insert(0, {str(HERE)!r})
from standin_drafter import CATALOGUE
from draftsmith.train.config import parse_config
from draftsmith.train.trainer import Trainer
raw = json.loads({json.dumps(json.dumps(make_cfg(target_dir, cache_dir, out, max_steps=8, save_every=2).to_dict()))})
def hook(step, trainer):
    if step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
Trainer(parse_config(raw, CATALOGUE, num_layers=3), CATALOGUE, hooks=[hook]).fit()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (out / ".checkpoint-00000006.tmp-99999" / "train_state").mkdir(parents=True)  # a torn save
    assert [s for s, _ in ckpt_io.list_checkpoints(out)] == [2, 4]
    resumed = Trainer(make_cfg(target_dir, cache_dir, out, max_steps=8, save_every=2), CATALOGUE, resume=True)
    resumed.fit()
    assert not list(out.glob(".checkpoint-*"))  # stray temporaries cleaned
    a, b = trained_params(straight), trained_params(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_refuses_checkpoint_of_another_target(target_dir, cache_dir, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    Trainer(make_cfg(target_dir, cache_dir, out, max_steps=3), CATALOGUE).fit()
    other = tiny_model_dir("llama", seed=5)  # same shapes, other weights
    cfg = make_cfg(other, cache_dir, out, max_steps=6)
    with pytest.raises(DraftsmithError, match="trained for target"):
        Trainer(cfg, CATALOGUE, resume=True).fit()
    with pytest.raises(DraftsmithError, match="trained for target"):
        ckpt_io.check_target(ckpt_io.read_checkpoint_config(out), "other-model", "0" * 16, str(out))
    # a changed drafter config is refused too (the weights would not fit)
    raw = make_cfg(target_dir, cache_dir, out, max_steps=6).to_dict()
    raw["drafter"]["layer_ids"] = [1]
    with pytest.raises(DraftsmithError, match="drafter config differs"):
        Trainer(parse_config(raw, CATALOGUE, num_layers=3), CATALOGUE, resume=True).fit()


def test_online_features_equal_the_cache(target_dir, cache_dir, regen_file, tmp_path):
    from draftsmith.models.target import load_target
    from draftsmith.train.data import TrainData

    tgt = load_target(str(target_dir))
    off = make_cfg(target_dir, cache_dir, tmp_path / "x")
    raw = off.to_dict()
    raw["data"] = {"online": True, "regen": str(regen_file), "max_len": 32}
    on = parse_config(raw, CATALOGUE, num_layers=3)
    d_off = TrainData(off.data, tgt, (0,), 0, 4)
    d_on = TrainData(on.data, tgt, (0,), 0, 4)
    assert sorted((d_off.samples[w.sample], w.start, w.end) for w in d_off.windows) == \
        sorted((str(d_on.records[w.sample]["id"]), w.start, w.end) for w in d_on.windows)
    b = d_on.batch(0)
    for r, w in enumerate(d_on.rank_windows(0)):
        ref = d_off.cache.features(str(d_on.records[w.sample]["id"]))
        n = w.end - w.start
        torch.testing.assert_close(b.final_hidden[r, :n], ref.final_hidden[w.start:w.end], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.hidden[0][r, :n], ref.hidden[0][w.start:w.end], atol=1e-5, rtol=1e-5)
    raw["out"], raw["train"]["max_steps"] = str(tmp_path / "online"), 2
    res = Trainer(parse_config(raw, CATALOGUE, num_layers=3), CATALOGUE).fit()
    assert res.step == 2 and res.final_loss is not None
    # online, target statistics come with each window's features on first use (none computed ahead)
    raw["out"], raw["drafter"] = str(tmp_path / "online-stats"), {**raw["drafter"], "stats": True}
    tr = Trainer(parse_config(raw, CATALOGUE, num_layers=3), CATALOGUE)
    tr.fit()
    assert len(tr.model.seen) == 2 and 0 < len(tr.data._stats) <= 2 * 4 < len(tr.data.windows)


def test_resume_without_a_checkpoint(target_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # killed before its first save
    res = Trainer(make_cfg(target_dir, cache_dir, out, max_steps=2), CATALOGUE, resume=True).fit()
    assert res.step == 2 and len((out / "metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(DraftsmithError, match="nothing to resume"):  # an explicit checkpoint path must exist
        Trainer(make_cfg(target_dir, cache_dir, tmp_path / "other"), CATALOGUE, resume=tmp_path / "nope").fit()


def test_setup_lists_the_run_directory_once(target_dir, cache_dir, tmp_path, monkeypatch):
    """Setup listed out's checkpoints up to five times (the other-drafter check, --resume without a
    checkpoint, the 'already holds checkpoints' check, finding the newest to resume, the --overwrite
    deletion); once now, nothing in setup writing there in between. What each flag does is unchanged:
    --overwrite deletes the earlier run's checkpoints, --resume continues from the newest."""
    real_list, real_setup = ckpt_io.list_checkpoints, Trainer._setup
    listed: list[Path] = []

    def counting(run_dir):
        listed.append(Path(run_dir))
        return real_list(run_dir)

    def setup(self):  # count setup's listings only (saving a checkpoint lists the run too)
        monkeypatch.setattr(ckpt_io, "list_checkpoints", counting)
        try:
            real_setup(self)
        finally:
            monkeypatch.setattr(ckpt_io, "list_checkpoints", real_list)

    monkeypatch.setattr(Trainer, "_setup", setup)
    out = tmp_path / "run"

    def fit(**kw):
        listed.clear()
        res = Trainer(make_cfg(target_dir, cache_dir, out, **kw.pop("train")), CATALOGUE, **kw).fit()
        assert listed == [out], listed
        return res

    fit(train={"max_steps": 6})
    assert [s for s, _ in real_list(out)] == [3, 6]
    with pytest.raises(DraftsmithError, match="already holds checkpoints"):
        fit(train={"max_steps": 6})
    fit(train={"max_steps": 2, "save_every": 2}, overwrite=True)
    assert [s for s, _ in real_list(out)] == [2]  # 3 and 6 deleted
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    res = fit(train={"max_steps": 4, "save_every": 2}, resume=True)
    assert res.step == 4 and [s for s, _ in real_list(out)] == [2, 4]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    out = tmp_path / "killed-early"  # --resume of a run with no checkpoint yet starts it again
    res = fit(train={"max_steps": 1}, resume=True)
    assert res.step == 1 and [s for s, _ in real_list(out)] == [1]


def test_budget_sizes_the_run(target_dir, cache_dir, tmp_path):
    cfg = make_cfg(target_dir, cache_dir, tmp_path / "run", max_steps=None, budget_minutes=0.02, save_every=10**6)
    res = Trainer(cfg, CATALOGUE).fit()
    assert res.total_steps >= 1 and res.step >= 1 and res.checkpoint is not None
    assert ckpt_io.list_checkpoints(tmp_path / "run")[-1][0] == res.step


def test_cpu_budget_counts_cpu_seconds_across_resumes(target_dir, cache_dir, tmp_path, monkeypatch):
    """`budget_clock: cpu` sizes and stops the run by this process's CPU time, summed over the
    attempts a run resumes; wall time plays no part. A fake CPU clock spends 1 s per step."""
    from draftsmith.train import trainer as trainer_mod

    cpu = [100.0]
    monkeypatch.setattr(trainer_mod.time, "process_time", lambda: cpu[0])
    real_fb = Trainer._forward_backward

    def costly(self, step):
        cpu[0] += 1.0
        return real_fb(self, step)

    monkeypatch.setattr(Trainer, "_forward_backward", costly)
    out = tmp_path / "run"

    def cfg(minutes):
        return make_cfg(target_dir, cache_dir, out, max_steps=None, epochs=100, budget_minutes=minutes,
                        budget_clock="cpu", save_every=5)

    class Crash(Exception):
        pass

    def crash_at_10(step, _trainer):
        if step == 10:
            raise Crash

    P = trainer_mod.PROBE_STEPS  # the probe spends P s
    planned = int(0.95 * (60 - P) / 1.0)
    with pytest.raises(Crash):  # 60 s: 0.95 * (60 - P) / 1 s steps
        Trainer(cfg(1.0), CATALOGUE, hooks=[crash_at_10]).fit()
    meta = json.loads((out / "checkpoint-00000010" / "train_state" / "meta.json").read_text())
    assert meta["total_steps"] == planned and meta["cpu_s"] == pytest.approx(P + 10.0)  # probe + 10 steps
    # resumed under a budget of P + 14 s: P + 10 were spent before, so it stops 5 steps later
    res = Trainer(cfg((P + 14) / 60), CATALOGUE, resume=True).fit()
    assert res.stopped_at_deadline and res.step == 15 and res.total_steps == planned > 15
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 16))
    assert rows[-1]["cpu_s"] == pytest.approx(P + 15.0) and rows[-1]["train_cpu_s"] == pytest.approx(P + 15.0)


def test_cpu_budget_leaves_out_heldout_evaluation(target_dir, cache_dir, tmp_path, monkeypatch):
    """Held-out scoring at each checkpoint is measurement: its CPU seconds are reported
    (cpu_s) but not charged to the budget (train_cpu_s), so frequent checkpoints do not cut
    a run short of the steps its probe planned."""
    from draftsmith.train import evaluate as evaluate_mod
    from draftsmith.train import trainer as trainer_mod

    cpu = [0.0]
    monkeypatch.setattr(trainer_mod.time, "process_time", lambda: cpu[0])
    real_fb, real_eval = Trainer._forward_backward, evaluate_mod.HeldoutEval.__call__

    def costly(self, step):
        cpu[0] += 1.0
        return real_fb(self, step)

    def costly_eval(self, model):
        cpu[0] += 3.0
        return real_eval(self, model)

    monkeypatch.setattr(Trainer, "_forward_backward", costly)
    monkeypatch.setattr(evaluate_mod.HeldoutEval, "__call__", costly_eval)
    cfg = make_cfg(target_dir, cache_dir, tmp_path / "run", max_steps=None, epochs=100, budget_minutes=0.5,
                   budget_clock="cpu", save_every=5)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_cache=cache_dir, eval_samples=8))
    P = trainer_mod.PROBE_STEPS
    planned = int(0.95 * (30 - P) / 1.0)
    res = Trainer(cfg, CATALOGUE).fit()  # evaluations (3 s each) every 5 steps on top of the plan
    assert not res.stopped_at_deadline and res.step == res.total_steps == planned
    meta = json.loads((tmp_path / "run" / f"checkpoint-{planned:08d}" / "train_state" / "meta.json").read_text())
    evals_before = (planned - 1) // 5  # saved before its own step's evaluation
    assert meta["train_cpu_s"] == pytest.approx(P + planned) and meta["cpu_s"] == pytest.approx(
        P + planned + 3.0 * evals_before)


@pytest.mark.parametrize("clock", ["cpu", "wall"])
def test_budget_leaves_out_the_target_statistics(target_dir, cache_dir, tmp_path, monkeypatch, clock):
    """Computing the target statistics before the first step is data preparation: reported (cpu_s,
    elapsed_s), not charged to the budget on either clock (train_cpu_s, budget_s), in a fresh run
    and in a resumed one that prepares them again, so the steps a budget buys do not depend on
    whether a run directory already held them (a recipe that computed them lost minutes of its
    budget). A fake clock (the budget's) spends 1 s per step and 20 s per preparation."""
    from draftsmith.train import trainer as trainer_mod
    from draftsmith.train.data import TrainData

    now = [0.0]
    monkeypatch.setattr(trainer_mod.time, "process_time" if clock == "cpu" else "perf_counter", lambda: now[0])
    real_fb, real_prep = Trainer._forward_backward, TrainData.prepare_stats

    def costly(self, step):
        now[0] += 1.0
        return real_fb(self, step)

    def costly_prep(self, *a, **k):
        now[0] += 20.0
        return real_prep(self, *a, **k)

    monkeypatch.setattr(Trainer, "_forward_backward", costly)
    monkeypatch.setattr(TrainData, "prepare_stats", costly_prep)
    out = tmp_path / "run"
    cfg = make_cfg(target_dir, cache_dir, out, max_steps=None, epochs=100, budget_minutes=0.5,
                   budget_clock=clock, save_every=5)
    cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, stats=True))
    P = trainer_mod.PROBE_STEPS
    planned = int(0.95 * (30 - P) / 1.0)  # the 20 s of statistics are not taken from the 30 s

    def crash_at_10(step, _trainer):
        if step == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, CATALOGUE, hooks=[crash_at_10]).fit()
    meta = json.loads((out / "checkpoint-00000010" / "train_state" / "meta.json").read_text())
    assert meta["total_steps"] == planned and meta["budget_s"] == pytest.approx(P + 10)
    if clock == "cpu":
        assert meta["train_cpu_s"] == pytest.approx(P + 10) and meta["cpu_s"] == pytest.approx(P + 10 + 20)
    else:
        assert meta["elapsed_s"] == pytest.approx(P + 10 + 20)
    res = Trainer(cfg, CATALOGUE, resume=True).fit()  # prepares them again (20 s): off the budget too
    assert not res.stopped_at_deadline and res.step == res.total_steps == planned
    meta = json.loads((out / f"checkpoint-{planned:08d}" / "train_state" / "meta.json").read_text())
    if clock == "cpu":  # summed over the two attempts
        assert meta["train_cpu_s"] == pytest.approx(P + planned) and meta["cpu_s"] == pytest.approx(P + planned + 40)
    else:  # the wall clock counts this attempt (as before): its steps after 10, and its own 20 s left out
        assert meta["budget_s"] == pytest.approx(planned - 10) and meta["elapsed_s"] == pytest.approx(planned - 10 + 20)


@pytest.mark.parametrize("probe_cost, fitted", [(2.0, "longer"), (0.5, "shorter")])
def test_budget_fits_the_step_count_again_to_the_measured_step_cost(target_dir, cache_dir, tmp_path, monkeypatch,
                                                                     probe_cost, fitted):
    """The probe's few steps can misjudge a step: here they cost `probe_cost` s on the budget's clock
    and every real step 1 s. At REFIT_FRACTION of the plan the run fits its step count again to the
    cost it measured, so it ends its learning-rate schedule at the budget (0.95 of what is left)
    instead of far short of it (a probe too dear) or cut off mid-schedule (a probe too cheap); the
    schedule's last step reaches the floor; a resume keeps the fitted count and does not fit again."""
    from draftsmith.train import trainer as trainer_mod

    cpu = [0.0]
    probing = [False]
    monkeypatch.setattr(trainer_mod.time, "process_time", lambda: cpu[0])
    real_fb, real_probe = Trainer._forward_backward, Trainer._probe_seconds_per_step

    def costly(self, step):
        cpu[0] += probe_cost if probing[0] else 1.0
        return real_fb(self, step)

    def probe(self):
        probing[0] = True
        try:
            return real_probe(self)
        finally:
            probing[0] = False

    monkeypatch.setattr(Trainer, "_forward_backward", costly)
    monkeypatch.setattr(Trainer, "_probe_seconds_per_step", probe)
    out = tmp_path / "run"
    budget = 400.0
    P = trainer_mod.PROBE_STEPS
    planned = int(0.95 * (budget - P * probe_cost) / probe_cost)
    refit_at = max(P, math.ceil(trainer_mod.REFIT_FRACTION * planned))
    fitted_total = refit_at + int(0.95 * (budget - P * probe_cost - refit_at) / 1.0)
    cfg = make_cfg(target_dir, cache_dir, out, max_steps=None, epochs=1000, budget_minutes=budget / 60,
                   budget_clock="cpu", save_every=refit_at + 3, min_lr_ratio=0.0)

    def crash_after_refit(step, _trainer):  # (hooks run after the step's checkpoint)
        if step == refit_at + 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, CATALOGUE, hooks=[crash_after_refit]).fit()
    res = Trainer(cfg, CATALOGUE, resume=True).fit()
    assert (fitted_total > planned) == (fitted == "longer")
    assert not res.stopped_at_deadline and res.step == res.total_steps == fitted_total
    meta = json.loads((out / f"checkpoint-{fitted_total:08d}" / "train_state" / "meta.json").read_text())
    assert meta["total_steps"] == fitted_total and meta["train_cpu_s"] <= budget
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, fitted_total + 1))
    assert rows[-1]["lr"] == pytest.approx(cfg.train.lr * lr_factor(fitted_total - 1, fitted_total,
                                                                       cfg.train.warmup_ratio, 0.0))
    state = ckpt_io.load_train_state(out / f"checkpoint-{fitted_total:08d}")
    assert state["refit_step"] == refit_at


def test_checkpoint_files_load_without_pickle(target_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    Trainer(make_cfg(target_dir, cache_dir, out, max_steps=3), CATALOGUE).fit()
    state = ckpt_io.load_train_state(out / "checkpoint-00000003")  # weights_only=True inside
    assert state["step"] == 3 and len(state["rng"]) == 1
    assert {"torch", "python", "numpy"} <= set(state["rng"][0])
    assert state["optimizer"]["state"]  # AdamW moments are there


def test_incomplete_or_empty_cache_is_refused(target_dir, cache_dir, tmp_path):
    """A cache whose `draftsmith cache` run stopped early is not trained on (it used to warn and
    train on the part that was written); nor is one without samples. Nothing is written."""
    import shutil

    from draftsmith.data.cache import rebuild_command

    broken = tmp_path / "cache"
    shutil.copytree(cache_dir, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    (broken / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(DraftsmithError, match=r"incomplete .*--resume") as e:
        Trainer(make_cfg(target_dir, broken, tmp_path / "run"), CATALOGUE).fit()
    # the full command that finishes it (it named only --data / --out: --target / --layers missing)
    assert f"`{rebuild_command(broken, {**manifest, 'complete': False}, str(target_dir))}`" in str(e.value)
    assert f"--target {target_dir} --data " in str(e.value) and "--layers 0,1" in str(e.value)
    empty = {**manifest, "shards": [], "num_samples": 0, "num_tokens": 0, "complete": True}
    (broken / "manifest.json").write_text(json.dumps(empty))
    with pytest.raises(DraftsmithError, match="no samples"):
        Trainer(make_cfg(target_dir, broken, tmp_path / "run2"), CATALOGUE).fit()
    assert not (tmp_path / "run" / "config.json").exists() and not (tmp_path / "run2" / "config.json").exists()


def test_a_run_that_fails_before_writing_leaves_no_empty_run_directory(target_dir, tmp_path):
    """Issue 15 item 6: a failed train must not leave an empty run directory behind."""
    out = tmp_path / "run"
    with pytest.raises(DraftsmithError, match="not a feature cache"):
        Trainer(make_cfg(target_dir, tmp_path / "no-cache", out), CATALOGUE).fit()
    assert not out.exists()


def test_heldout_evaluation_at_every_checkpoint(target_dir, cache_dir, tmp_path):
    """data.eval_cache: the held-out samples (never trained on) are scored at each checkpoint,
    with fixed anchors, into heldout.jsonl; the same weights score the same; a resumed run
    drops rows past its checkpoint like metrics.jsonl."""
    out = tmp_path / "run"
    cfg = make_cfg(target_dir, cache_dir, out, max_steps=6, save_every=3, lr=1e-2)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_cache=cache_dir, eval_samples=8))
    tr = Trainer(cfg, CATALOGUE)
    res = tr.fit()
    rows = heldout_rows(out)
    assert [r["step"] for r in rows] == [3, 6]
    assert {"loss", "ce", "acc@1"} <= set(rows[0])
    assert rows[1]["loss"] < rows[0]["loss"]  # the chain is learnt on train samples, and holds out
    # the held-out windows are exactly the cache's held-out samples
    ids = {tr.heldout.data.samples[w.sample] for w in tr.heldout.windows}
    assert ids and all("heldout" in i for i in ids)
    assert not set(tr.data.samples) & ids
    again = tr.heldout(tr.model)
    assert again == {k: v for k, v in rows[1].items() if k not in ("step", "eval_s")}
    assert res.step == 6
    # a cache with no held-out samples: a clear error, not an empty evaluation
    from draftsmith.data.cache import CacheConfig, run_cache

    only_train = tmp_path / "only-train"
    run_cache(CacheConfig(target=str(target_dir), data=sequence_records(tmp_path / "r.jsonl", n=6, heldout=0),
                          out=only_train, layers="0,1", dtype="fp32", progress=False))
    cfg = dataclasses.replace(cfg, out=tmp_path / "run2", data=dataclasses.replace(cfg.data, eval_cache=only_train))
    with pytest.raises(DraftsmithError, match="no held-out data"):
        Trainer(cfg, CATALOGUE).fit()


def test_diverged_replicas_are_refused_at_the_checkpoint(target_dir, cache_dir, tmp_path, monkeypatch):
    """Each checkpoint gathers every rank's weight digest; replicas that differ (gradients never
    averaged) stop the run with a clear error instead of saving one rank's weights."""
    from draftsmith.train import distributed as dist_util

    real = dist_util.gather_objects
    monkeypatch.setattr(dist_util, "gather_objects",
                        lambda obj, info: real(obj, info) + (["0" * 16] if isinstance(obj, str) else [obj]))
    with pytest.raises(DraftsmithError, match="different weights at step 3"):
        Trainer(make_cfg(target_dir, cache_dir, tmp_path / "run", max_steps=6), CATALOGUE).fit()
    monkeypatch.setattr(dist_util, "gather_objects", real)
    Trainer(make_cfg(target_dir, cache_dir, tmp_path / "ok", max_steps=3), CATALOGUE).fit()
    meta = json.loads((tmp_path / "ok" / "checkpoint-00000003" / "train_state" / "meta.json").read_text())
    assert len(meta["rank_weight_digests"]) == 1


def test_init_from_a_trained_drafter_starts_from_its_weights(target_dir, cache_dir, tmp_path):
    """train.init_from: fine-tuning starts from another run's weights (fresh optimizer and
    schedule); a fresh run is the control; a different architecture or a missing path is refused."""
    first = Trainer(make_cfg(target_dir, cache_dir, tmp_path / "a", max_steps=6, lr=1e-2), CATALOGUE)
    first.fit()
    start = trained_params(first)
    tiny_lr = {"max_steps": 1, "lr": 1e-9, "warmup_ratio": 0.0}  # one step that moves nothing measurable
    for source in (tmp_path / "a", ckpt_io.list_checkpoints(tmp_path / "a")[-1][1]):  # run dir or checkpoint
        tuned = Trainer(make_cfg(target_dir, cache_dir, tmp_path / f"b-{source.name}", init_from=str(source),
                                 **tiny_lr), CATALOGUE)
        tuned.fit()
        for n, w in trained_params(tuned).items():
            torch.testing.assert_close(w, start[n], atol=1e-6, rtol=0)
        assert json.loads((tmp_path / f"b-{source.name}" / "train_config.json").read_text())["train"]["init_from"] \
            == str(source)
    # with held-out data, a fine-tune scores its starting weights at step 0 (the baseline it improves on)
    held = make_cfg(target_dir, cache_dir, tmp_path / "h", init_from=str(tmp_path / "a"), **tiny_lr)
    held = dataclasses.replace(held, data=dataclasses.replace(held.data, eval_cache=cache_dir, eval_samples=8))
    ft = Trainer(held, CATALOGUE)
    ft.fit()
    rows = heldout_rows(tmp_path / "h")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-4)  # lr 1e-9: the same weights score the same
    control = dataclasses.replace(held, out=tmp_path / "h0", train=dataclasses.replace(held.train, init_from=None))
    Trainer(control, CATALOGUE).fit()
    rows0 = heldout_rows(tmp_path / "h0")
    assert [r["step"] for r in rows0] == [1]  # a fresh run has no baseline to score
    assert rows0[0]["loss"] > rows[0]["loss"]  # and scores worse than the trained start
    fresh = Trainer(make_cfg(target_dir, cache_dir, tmp_path / "c", **tiny_lr), CATALOGUE)
    fresh.fit()
    assert any((w - start[n]).abs().max() > 1e-3 for n, w in trained_params(fresh).items())
    cfg = make_cfg(target_dir, cache_dir, tmp_path / "d", init_from=str(tmp_path / "a"), **tiny_lr)
    other = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, layer_ids=(1,)))
    with pytest.raises(DraftsmithError, match="differs in \\['layer_ids'\\]"):
        Trainer(other, CATALOGUE).fit()
    with pytest.raises(DraftsmithError, match="no such directory"):
        Trainer(make_cfg(target_dir, cache_dir, tmp_path / "e", init_from=str(tmp_path / "nope"), **tiny_lr),
                CATALOGUE).fit()


def test_target_statistics_are_computed_once_per_window_and_reach_every_batch(target_dir, cache_dir, tmp_path,
                                                                              monkeypatch):
    """A model with target_stats gets them in every batch: the trainer has the data compute them
    for every window before the first step (each window once), each row padded with zeros, and
    keeps them in the run directory; a resumed run reads them from there (computing two windows
    again to check the file) and equals a straight one; a file that does not match is computed
    again; a model without them (stats off) gets batches without them."""
    from standin_drafter import HeadModel
    from draftsmith.train.trainer import STATS_FILE

    calls = []
    inner = HeadModel.target_stats
    monkeypatch.setattr(HeadModel, "target_stats", lambda self, h: calls.append(1) or inner(self, h))
    cfg = make_cfg(target_dir, cache_dir, tmp_path / "a")
    on = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, stats=True))
    tr = Trainer(on, CATALOGUE)
    tr.fit()
    assert len(tr.data._stats) == len(tr.data.windows) and len(tr.model.seen) == on.train.max_steps
    assert (tmp_path / "a" / STATS_FILE).is_file()
    lm_head = tr.model.lm_head.float()
    for batch in tr.model.seen[:3]:
        for r, n in enumerate(batch.lengths.tolist()):
            logits = torch.nn.functional.linear(batch.final_hidden[r, :n], lm_head)
            torch.testing.assert_close(batch.target_rest_lse[r, :n], torch.logsumexp(logits, -1))
            assert torch.equal(batch.target_top1[r, :n], logits.argmax(-1))
            assert not batch.target_rest_lse[r, n:].any() and not batch.target_top1[r, n:].any()
    straight = trained_params(tr)
    _run_until_exception(dataclasses.replace(on, out=str(tmp_path / "b")), at_step=4)
    calls.clear()
    resumed = Trainer(dataclasses.replace(on, out=str(tmp_path / "b")), CATALOGUE, resume=True)
    resumed.fit()
    assert resumed.model.seen and len(resumed.data._stats) == len(resumed.data.windows)
    # the trainer's probe (does the model have statistics?) and the two windows checked: the rest came from the file
    assert resumed.heldout is None and len(calls) == 3
    for n, w in trained_params(resumed).items():
        assert torch.equal(w, straight[n]), n
    # a file that does not hold these statistics is not used: a run computes them again
    _run_until_exception(dataclasses.replace(on, out=str(tmp_path / "b2")), at_step=4)
    stored = load_file(str(tmp_path / "b2" / STATS_FILE))
    from draftsmith.tensorfile import load_tensors, save_tensors
    with safe_open(str(tmp_path / "b2" / STATS_FILE), "pt") as f:
        meta = f.metadata()
    save_tensors(tmp_path / "b2" / STATS_FILE, {**stored, "rest_lse": stored["rest_lse"] + 1.0}, meta)
    calls.clear()
    again = Trainer(dataclasses.replace(on, out=str(tmp_path / "b2")), CATALOGUE, resume=True)
    again.fit()
    assert len(calls) >= len(again.data.windows)
    for n, w in trained_params(again).items():
        assert torch.equal(w, straight[n]), n
    assert torch.equal(load_tensors(tmp_path / "b2" / STATS_FILE)["rest_lse"], stored["rest_lse"])  # rewritten
    off = Trainer(make_cfg(target_dir, cache_dir, tmp_path / "c"), CATALOGUE)
    off.fit()
    assert not off.model.seen and not off.data._stats


def test_a_damaged_cache_shard_is_one_error_that_says_how_to_remake_it(target_dir, cache_dir, tmp_path):
    """A truncated shard (a full disk, a half copy) was a SafetensorError traceback: it is a
    DraftsmithError naming the shard and the `draftsmith cache --resume` that re-makes it; no
    run directory is written."""
    import shutil

    broken = tmp_path / "cache"
    shutil.copytree(cache_dir, broken)
    shard = sorted(broken.glob("shard-*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(1000)
    out = tmp_path / "run"
    with pytest.raises(DraftsmithError) as e:
        Trainer(make_cfg(target_dir, broken, out), CATALOGUE).fit()
    msg = str(e.value)
    assert f"shard {shard.name} has 1000 bytes" in msg and "\n" not in msg
    assert f"draftsmith cache --target {target_dir} --data " in msg and "--layers 0,1" in msg and "--dtype fp32" in msg
    assert f"--out {broken} --resume" in msg
    assert not out.exists()


def test_train_threads_past_the_cpus_train_on_the_cpus(target_dir, cache_dir, tmp_path, monkeypatch):
    """train.threads past the machine's CPUs (100000 crashed torch's thread pool) trains on its
    CPUs, with a warning; torch's own count comes back after the run."""
    from draftsmith.errors import DraftsmithWarning

    calls, real = [], torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n) or real(n))
    before = torch.get_num_threads()
    with pytest.warns(DraftsmithWarning, match="100000 threads asked for"):
        Trainer(make_cfg(target_dir, cache_dir, tmp_path / "run", max_steps=1, threads=100000), CATALOGUE).fit()
    assert calls[0] == len(os.sched_getaffinity(0)) and calls[-1] == before == torch.get_num_threads()
