"""The training loop shared by every trainable drafter kind (`draftsmith train`).

    build(target, config) -> model            (the kind's code, protocol.py)
    for step: batch = data.batch(step)        (train/data.py: deterministic, rank-split)
              loss = model.training_loss(batch, generator(seed, rank, step))
              backward, clip grad norm, AdamW, warmup + cosine
              log (rank 0), checkpoint every N steps and at the end (train/checkpoint.py)

Exact resume: weights, AdamW moments, the scheduler, every rank's RNG states and the step
are saved; the data position and the per-step generator are functions of the step, so a
resumed run continues with bit-identical numbers. `--budget M` sizes the run to M minutes
from a short timing probe (whose effects are undone) and stops at the deadline regardless.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from draftsmith.data.outdir import check_no_other_job, check_out_dir
from draftsmith.drafters.builtin import builtin_specs, resolve as builtin_resolve
from draftsmith.drafters.kind_config import resolve_for_target
from draftsmith.errors import DraftsmithError
from draftsmith.models.target import cpu_has_fast_bf16, load_target
from draftsmith.models.threads import configure_threads
from draftsmith.train import checkpoint as ckpt_io, distributed as dist_util
from draftsmith.train.config import Catalogue, TrainConfig, trained_catalogue
from draftsmith.train.data import TrainData
from draftsmith.train.evaluate import HeldoutEval
from draftsmith.train.memory import check_fits
from draftsmith.train.distributed import DistInfo, init_from_env, shutdown

StepHook = Callable[[int, "Trainer"], None]
HELDOUT_FILE = "heldout.jsonl"  # held-out evaluation rows (train/evaluate.py), one per checkpoint
STATS_FILE = "target_stats.safetensors"  # the training windows' target statistics, for a resume (train/data.py)
# what a run directory holds (the rest of outdir.JOB_FILES is another job's output)
_RUN_FILES = ("checkpoint-*", "train_info.json", "model.safetensors", STATS_FILE, "metrics.jsonl", HELDOUT_FILE)
PROBE_STEPS = 12  # timing probe for --budget: the first two warm up, the mean of the rest counts (a
# budget needs the mean step; EAGLE-3's variable-length windows made a median of 3 read 0.39 s for 0.52-0.6)
REFIT_FRACTION = 0.1  # --budget: at this share of the planned steps the step count is fitted again to the
# cost the steps measured (the probe's ten steps read 1.18 CPU-s for a batch-8 step that averaged 1.01, and the
# run stopped at 16 of its 20 CPU minutes); once per run, kept across resumes
# Train-section fields that may change on resume without breaking exactness.
_RESUME_FREE = {"log_every", "save_every", "keep_checkpoints", "budget_minutes", "budget_clock", "max_steps", "epochs",
                "tensorboard", "progress", "threads", "device"}


def lr_factor(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warmup over the first `warmup_ratio` of steps, then cosine down to `min_ratio`."""
    warm = int(math.ceil(warmup_ratio * total))
    if warm and step < warm:
        return (step + 1) / warm
    span = max(1, total - warm)
    progress = min(1.0, (step - warm) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def resolve_bf16(dtype: str, device: torch.device) -> bool:
    """Whether the drafter computes under bf16 autocast (master weights stay float32).
    "auto": on CUDA, and on CPUs with bf16 hardware (AVX512-BF16 / AMX / Arm BF16), where it
    measured 2.2-2.3x the fp32 steps/s on 2 Zen 4 cores (BENCHMARKS.md); emulated bf16 would be slower."""
    if dtype == "auto":
        return device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16())
    return dtype == "bf16"


def step_seed(seed: int, rank: int, step: int) -> int:
    """Seed of the generator handed to `training_loss` (anchor sampling) at one step."""
    return ((seed * 1_000_003 + rank) * 1_000_033 + step) % (2**63 - 1)


def param_groups(model: nn.Module, params: dict[str, nn.Parameter], weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices, not biases / norms / 1-d parameters."""
    decay = [p for n, p in params.items() if p.ndim >= 2]
    no_decay = [p for n, p in params.items() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


@dataclass
class TrainResult:
    step: int
    total_steps: int
    checkpoint: Path | None
    final_loss: float | None
    history: list[dict] = field(default_factory=list)  # logged rows (rank 0)
    stopped_at_deadline: bool = False


class Trainer:
    """One training run. `fit()` returns a TrainResult; rank 0 writes everything."""

    def __init__(self, cfg: TrainConfig, catalogue: Catalogue | None = None, resume: bool | str | Path = False,
                 overwrite: bool = False, hooks: Sequence[StepHook] = (), info: DistInfo | None = None) -> None:
        self.cfg = cfg
        self.catalogue = catalogue if catalogue is not None else trained_catalogue()
        self.resume = resume
        self.overwrite = overwrite
        self.hooks = tuple(hooks)
        self.info = info
        self.out = Path(cfg.out)
        self.step = 0
        self.total_steps = 0
        self.cpu_before = 0.0  # CPU seconds of the attempts this run resumes (from its checkpoint)
        self.eval_cpu = 0.0  # CPU seconds of held-out evaluation, resumed attempts included
        self.eval_wall = 0.0  # wall seconds of this attempt's held-out evaluation
        self.prep_cpu = 0.0  # CPU seconds of the target statistics (data preparation), resumed attempts included
        self.prep_wall = 0.0  # wall seconds of this attempt's target statistics
        self.refit_step: int | None = None  # the step a --budget run fitted its step count again (_refit_budget)
        self.history: list[dict] = []

    # ---- setup ---------------------------------------------------------------------------

    def _setup(self) -> None:
        t = self.cfg.train
        check_out_dir(self.out, "the run directory (out)")  # before anything loads
        # listed once: nothing in setup adds or removes a checkpoint before _prepare_out_dir (its last step)
        existing = ckpt_io.list_checkpoints(self.out)
        self._check_out_is_no_other_drafter(existing)
        self.t_start = time.perf_counter()
        self.cpu_start = time.process_time()
        if t.threads is not None:
            configure_threads(t.threads)
        self.info = self.info or init_from_env(t.device)
        info = self.info
        self.bf16 = resolve_bf16(t.dtype, info.device)
        if self.resume is True and not existing:
            # a run killed before its first checkpoint: nothing to resume, start it again
            if info.is_main:
                print(f"[draftsmith] --resume: {self.out} has no checkpoint yet; starting from step 0",
                      file=sys.stderr)
                (self.out / "metrics.jsonl").unlink(missing_ok=True)
            self.resume = False
        self._check_out_checkpoints(existing)
        torch.manual_seed(t.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        self.resume_from: Path | None = None
        if self.resume:  # refuse a foreign checkpoint before anything else is loaded
            self.resume_from = (ckpt_io.find_resume_checkpoint(self.out, existing) if self.resume is True
                                else ckpt_io.find_resume_checkpoint(Path(self.resume)))
            saved = ckpt_io.read_checkpoint_config(self.resume_from)
            if saved.get("kind") != self.cfg.kind:
                raise DraftsmithError(f"cannot resume from {self.resume_from}: it is a {saved.get('kind')} run, and "
                                      f"this recipe trains {self.cfg.kind}; resume with the recipe that run used, or "
                                      "give a new out=")
        self.target = load_target(self.cfg.target, device=str(info.device), dtype="float32")
        for p in self.target.model.parameters():
            p.requires_grad_(False)
        if self.resume:
            ckpt_io.check_target(saved, self.target.target_id, self.target.weights_hash, str(self.resume_from),
                                 legacy_hash=self.target.legacy_weights_hash)  # (its kind: checked above)
        entry = self.catalogue[self.cfg.kind]
        check_fits(self.cfg.kind, self.cfg.drafter, self.target.model.config, info.device)  # before it is built
        self.model = entry.build(self.target.model, resolve_for_target(self.cfg.drafter, self.target)).to(info.device)
        self.model.train()
        spec = self.model.feature_spec
        L = self.target.model.config.num_layers
        bad = [i for i in spec.layer_ids if not 0 <= i < L]
        if bad:
            raise DraftsmithError(f"the {self.cfg.kind} drafter reads target layers {bad}, but the target has {L} layers")
        self.layer_ids = tuple(spec.layer_ids)
        shared = {p.data_ptr() for p in self.target.model.parameters()}
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad and p.data_ptr() not in shared}
        if not self.params:
            raise DraftsmithError(f"the {self.cfg.kind} drafter has no trainable parameters")
        self.data = TrainData(self.cfg.data, self.target, self.layer_ids, t.seed, t.batch_size,
                              info.rank, info.world_size, info.device)
        self.heldout = (HeldoutEval(self.cfg.data, self.target, self.layer_ids, self.data.per_rank, info.device)
                        if self.cfg.data.eval_cache is not None and info.is_main else None)
        self.init_from = None if self.resume or t.init_from is None else self._init_from(t.init_from)
        if not self.resume and self.init_from is None and hasattr(self.model, "init_draft_vocab") and getattr(
                getattr(self.model, "config", None), "draft_vocab_size", None):
            # EAGLE-3's reduced vocabulary: the most frequent drafted tokens of the training data
            self.model.init_draft_vocab(self.data.token_counts(self.target.model.config.vocab_size))
        self.wrapped = dist_util.wrap(self.model, info, t.ddp_find_unused)
        # config.json stores the model's resolved config (feature layers, mask token filled in)
        resolved = getattr(self.model, "config", None)
        resolved = resolved if dataclasses.is_dataclass(resolved) else self.cfg.drafter
        self.ckpt_config = ckpt_io.checkpoint_config(self.cfg.kind, resolved, self.target.target_id,
                                                     self.target.weights_hash)
        self._prepare_out_dir(existing)  # --overwrite deletes only once every check above (data, init_from, ...) passed

    # what must agree between a drafter and the checkpoint it starts from, beyond tensor names and shapes
    _STRUCTURAL = ("layer_ids", "block_size", "mask_token_id", "head", "num_layers", "rank", "draft_vocab_size",
                   "qk_norm", "norm_before_residual")

    def _init_from(self, spec: str) -> Path:
        """Load a trained drafter's weights (and vocabulary maps) into the fresh model: fine-tuning.
        Loss weights and other training-only settings may differ; the architecture may not."""
        kind = self.cfg.kind
        arg = spec[len(kind) + 1:] if spec.startswith(f"{kind}:") and not Path(spec).exists() else spec
        d = Path(builtin_resolve(kind, arg))
        if not d.is_dir():
            raise DraftsmithError(f"train.init_from={spec!r}: no such directory and no built-in {kind} drafter of "
                                  f"that name (built-ins: {', '.join(builtin_specs(kind)) or 'none'})")
        ckpts = [] if (d / "config.json").is_file() else ckpt_io.list_checkpoints(d)
        if ckpts:
            d = ckpts[-1][1]  # a run directory that has no inference files yet
        raw = ckpt_io.read_checkpoint_config(d)
        if raw["kind"] != kind:
            raise DraftsmithError(f"train.init_from={spec!r} is a {raw['kind']} drafter; this recipe trains {kind}")
        ckpt_io.check_target(raw, self.target.target_id, self.target.weights_hash, str(d), kind=kind,
                             legacy_hash=self.target.legacy_weights_hash)
        mine = dataclasses.asdict(getattr(self.model, "config", None) or self.cfg.drafter)
        diff = [k for k in self._STRUCTURAL if k in mine and k in raw
                and ckpt_io.jsonable(mine[k]) != ckpt_io.jsonable(raw[k])]
        if diff:
            raise DraftsmithError(f"train.init_from={spec!r}: the drafter differs in {diff} (checkpoint: "
                                  f"{[raw[k] for k in diff]}, recipe: {[mine[k] for k in diff]}); set them as the "
                                  "checkpoint has them")
        ckpt_io.restore_state(self.model, ckpt_io.load_model_state(d), d)
        if self.info.is_main:
            print(f"[draftsmith] starting from the weights of {d}", file=sys.stderr)
        return d

    def _check_out_is_no_other_drafter(self, existing: list[tuple[int, Path]]) -> None:
        """out= must not be a drafter directory that is no run's (an export / import --out, a copy of
        a built-in): the first checkpoint replaced its config.json / model.safetensors and dropped its
        calibration.json. --overwrite replaces it, but not where train.init_from reads from it."""
        if not self.out.is_dir():
            return
        # a feature cache, an eval or bench report, data files: the run would write among them (even
        # with --overwrite, which deletes only a run's files)
        check_no_other_job(self.out, "training", _RUN_FILES, where=f"out={self.out}")
        init = self.cfg.train.init_from
        if self.overwrite and init is not None and not self.resume:
            out = self.out.resolve()
            for cand in {init, init.partition(":")[2]} - {""}:
                p = Path(cand)
                if p.exists() and (p.resolve() == out or out in p.resolve().parents):
                    raise DraftsmithError(f"train.init_from={init!r} is in out={self.out}, which --overwrite empties "
                                          "first: the run would delete the weights it starts from; give a new out=")
        if self.overwrite or existing:
            return  # a run directory (checkpoint-* beside its inference files), or to be replaced
        files = [n for n in ("config.json", "model.safetensors", "calibration.json") if (self.out / n).is_file()]
        if files:
            raise DraftsmithError(f"out={self.out} holds a drafter ({', '.join(files)}) that is no training run's; "
                                  "training there would replace it. Give a new out=, or pass --overwrite to "
                                  "replace it")

    def _check_out_checkpoints(self, existing: list[tuple[int, Path]]) -> None:
        if existing and not self.resume and not self.overwrite:
            raise DraftsmithError(f"{self.out} already holds checkpoints (newest step {existing[-1][0]}); pass "
                                  "--resume to continue that run or --overwrite to start again")

    def _prepare_out_dir(self, existing: list[tuple[int, Path]]) -> None:
        """--overwrite: delete the earlier run's checkpoints (`existing`, out's as setup listed them)
        and files; then out exists. Rank 0's."""
        if not self.info.is_main:
            return
        if self.overwrite and not self.resume and self.out.is_dir():
            for _, d in existing:
                shutil.rmtree(d)
            for name in ("config.json", "model.safetensors", "train_info.json", "metrics.jsonl", HELDOUT_FILE,
                         "calibration.json", "train_config.json"):
                (self.out / name).unlink(missing_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)

    def _make_optimizer(self) -> None:
        t = self.cfg.train
        # fused: one kernel for every tensor's update (CPU and CUDA; ~10% of a CPU step otherwise)
        self.optimizer = torch.optim.AdamW(param_groups(self.model, self.params, t.weight_decay), lr=t.lr,
                                           betas=tuple(t.betas), eps=1e-8, fused=self.info.device.type in ("cpu", "cuda"))
        warm, floor = t.warmup_ratio, t.min_lr_ratio
        # reads total_steps when it runs: a budget's refit (_refit_budget) stretches or shrinks the rest of the schedule
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.total_steps, warm, floor))

    def _planned_steps(self) -> int:
        t = self.cfg.train
        if t.max_steps is not None:
            return t.max_steps
        return max(1, int(math.ceil(t.epochs * self.data.steps_per_epoch)))

    # ---- one step ------------------------------------------------------------------------

    def _share_target_stats(self) -> None:
        """Give the data the model's per-position target statistics (drafters/protocol.py), all
        computed now, in the precision each loss runs in: the training step's autocast, float32
        for the held-out evaluation (run outside autocast)."""
        fn = getattr(self.model, "target_stats", None)
        if fn is None or fn(torch.zeros(0, self.target.model.config.hidden_size, device=self.info.device)) is None:
            return
        t0, c0 = time.perf_counter(), time.process_time()
        say = (lambda m: print(f"[draftsmith] {m}", file=sys.stderr)) if self.info.is_main else None
        try:
            n = self._prepare_target_stats(fn, say)
        finally:  # data preparation, not training: off the budget (_budget_spent), like held-out evaluation
            self.prep_wall += time.perf_counter() - t0
            self.prep_cpu += time.process_time() - c0
        if say and n:
            say(f"target statistics of {n} windows in {time.perf_counter() - t0:.0f} s (the full-vocabulary "
                "lm_head once per window, not at every step)")

    def _prepare_target_stats(self, fn, say) -> int:
        """The statistics of every training (and held-out) window; the number computed, not read."""
        dev, bf16 = self.info.device.type, self.bf16

        def train_stats(h: torch.Tensor):
            with torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=bf16):
                return fn(h)

        # kept beside the run for a resume (rank 0 writes it; every rank reads it)
        n = self.data.prepare_stats(train_stats, every=500, log_fn=say, store=self.out / STATS_FILE,
                                    key=self._stats_key(), save=self.info.is_main)
        if self.heldout is not None:
            n += self.heldout.data.prepare_stats(fn, self.heldout.windows)
        return n

    def _stats_key(self) -> str:
        """What the target statistics depend on besides the windows: the target's weights, the
        draft vocabulary (block drafters) and the precision the training step computes them in."""
        vocab = getattr(getattr(self.model, "backbone", None), "vocab", None)
        ids = "" if vocab is None else hashlib.sha256(vocab.ids.cpu().numpy().tobytes()).hexdigest()
        return f"{self.cfg.kind}|{self.target.weights_hash}|bf16={self.bf16}|vocab={ids}"

    def _forward_backward(self, step: int) -> tuple[float, dict[str, float], int]:
        info, t = self.info, self.cfg.train
        batch = self.data.batch(step)
        gen = torch.Generator()  # on the CPU: anchor sampling draws there (drafters/anchors.py)
        gen.manual_seed(step_seed(t.seed, info.rank, step))
        with torch.autocast(device_type=info.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            total, parts = self.wrapped(batch, gen)
        if not torch.isfinite(total):  # (detached: float() of a tensor that needs grad prints torch's warning)
            raise DraftsmithError(f"loss is {float(total.detach())} at step {step}; lower train.lr or check the data "
                                  "(train.dtype=fp32 if bf16 overflows)")
        total.backward()
        return float(total.detach()), parts, int(batch.loss_mask.sum())

    def _optimizer_step(self) -> tuple[float, float]:
        """Clip, step, advance the schedule. Returns (grad norm before clipping, lr used)."""
        norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.cfg.train.grad_clip)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm), lr

    def cpu_s(self) -> float:
        """CPU seconds this run has spent (this process's threads since setup, plus the attempts
        it resumes), held-out evaluation included."""
        return self.cpu_before + time.process_time() - self.cpu_start

    def train_cpu_s(self) -> float:
        """cpu_s without held-out evaluation and the target statistics: what a `budget_clock: cpu`
        budget counts."""
        return self.cpu_s() - self.eval_cpu - self.prep_cpu

    def _budget_spent(self) -> float:
        """Seconds of the budget used so far, on the budget's clock; held-out evaluation is
        measurement, not training, and does not count (checkpoints every N steps would
        otherwise cost a recipe with cheap steps more of its budget); nor does computing the
        target statistics, data preparation whose cost is the same for every recipe on a cache
        and nearly nothing when a resumed run reads them from its directory."""
        if self.cfg.train.budget_clock == "cpu":
            return self.train_cpu_s()
        return time.perf_counter() - self.t_start - self.eval_wall - self.prep_wall

    def _refit_budget(self, deadline: float, start_step: int, start_spent: float) -> None:
        """Fit the step count to the budget again from the cost the steps of this attempt measured
        (start_step .. now, on the budget's clock, checkpoints included): the probe's few steps
        misjudge a recipe whose step cost varies with its batch, and the run then ends its schedule
        well short of the budget, or is cut off by it mid-schedule. The same 0.95 margin as the
        probe's plan; rank 0 decides."""
        done = self.step - start_step
        spent = self._budget_spent()
        per_step = (spent - start_spent) / max(done, 1)
        total = self.step + max(1, int(0.95 * max(deadline - spent, 0.0) / max(per_step, 1e-9)))
        total = int(dist_util.broadcast_object(total, self.info))
        if self.info.is_main and total != self.total_steps:
            print(f"[draftsmith] budget: {per_step:.2f} s/step over {done} steps -> {total} steps "
                  f"(was {self.total_steps})", file=sys.stderr)
        self.total_steps, self.refit_step = total, self.step
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def _probe_seconds_per_step(self) -> float:
        """Time a few real steps (on the budget's clock), then undo them (weights, RNG); the
        optimizer is rebuilt after."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        rng = ckpt_io.rng_state()
        probe_opt = torch.optim.AdamW(list(self.params.values()), lr=0.0)
        times = []
        clock = time.process_time if self.cfg.train.budget_clock == "cpu" else time.perf_counter
        for s in range(PROBE_STEPS):
            t0 = clock()
            self._forward_backward(s % self.data.steps_per_epoch)
            probe_opt.step()
            probe_opt.zero_grad(set_to_none=True)
            times.append(clock() - t0)
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(saved[n])
        ckpt_io.set_rng_state(rng)
        timed = times[2:] or times
        per_step = sum(timed) / len(timed)
        return float(dist_util.broadcast_object(per_step, self.info))

    # ---- checkpoints -----------------------------------------------------------------------

    def _weights_digest(self) -> str:
        """sha256 of this rank's trainable weights (bytes, in name order)."""
        h = hashlib.sha256()
        for n in sorted(self.params):
            h.update(n.encode())
            h.update(self.params[n].detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def _save(self, last_loss: float | None) -> Path | None:
        rngs = dist_util.gather_objects(ckpt_io.rng_state(), self.info)
        digests = dist_util.gather_objects(self._weights_digest(), self.info)
        if len(set(digests)) > 1:  # DDP keeps replicas identical; anything else is a bug, not noise
            raise DraftsmithError(f"the {len(digests)} processes hold different weights at step {self.step} "
                                  f"(digests {digests}); their gradients were not averaged")
        path = None
        if self.info.is_main:
            pos = self.data.position(self.step)
            state = {"step": self.step, "total_steps": self.total_steps, "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(), "rng": rngs, "world_size": self.info.world_size,
                     "data_position": pos, "cpu_s": round(self.cpu_s(), 3), "eval_cpu_s": round(self.eval_cpu, 3),
                     "prep_cpu_s": round(self.prep_cpu, 3), "refit_step": self.refit_step}
            meta = {"step": self.step, "total_steps": self.total_steps, "epoch": pos["epoch"],
                    "data_position": pos, "loss": last_loss, "world_size": self.info.world_size,
                    "rank_weight_digests": digests,
                    "elapsed_s": round(time.perf_counter() - self.t_start, 3), "cpu_s": round(self.cpu_s(), 3),
                    "train_cpu_s": round(self.train_cpu_s(), 3), "budget_s": round(self._budget_spent(), 3),
                    "run_config": self.cfg.to_dict()}
            # the model's whole state dict: trainable parameters and persistent buffers (e.g. EAGLE-3's
            # vocabulary maps); the target's embedding / lm_head are shared by reference, not in it
            model_state = {n: v.detach().to("cpu").contiguous() for n, v in self.model.state_dict().items()}
            path = ckpt_io.save_checkpoint(self.out, self.step, self.ckpt_config, model_state, state, meta,
                                           keep=self.cfg.train.keep_checkpoints)
        dist_util.barrier(self.info)
        return path

    def _restore(self) -> None:
        ckpt = self.resume_from
        saved_cfg = ckpt_io.read_checkpoint_config(ckpt)
        mine = {k: v for k, v in self.ckpt_config.items() if k != "format_version"}
        theirs = {k: v for k, v in saved_cfg.items() if k != "format_version"}
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if diff:
            raise DraftsmithError(f"cannot resume from {ckpt}: the drafter config differs in {diff} "
                                  f"(checkpoint: {[theirs.get(k) for k in diff]}, recipe: {[mine.get(k) for k in diff]})")
        state = ckpt_io.load_train_state(ckpt)
        model_state = ckpt_io.load_model_state(ckpt)
        ckpt_io.restore_state(self.model, model_state, ckpt)
        if state.get("world_size", 1) != self.info.world_size:
            raise DraftsmithError(f"checkpoint {ckpt} was written by {state.get('world_size')} processes; resume "
                                  f"with the same number (now {self.info.world_size}) for an exact continuation")
        self.step = int(state["step"])
        self.cpu_before = float(state.get("cpu_s", 0.0))
        self.eval_cpu = float(state.get("eval_cpu_s", 0.0))
        self.prep_cpu += float(state.get("prep_cpu_s", 0.0))  # the attempts before, with this one's to come
        if self.cfg.train.budget_minutes is not None:
            self.total_steps = int(state["total_steps"])
        self.refit_step = state.get("refit_step")
        self._make_optimizer()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt_io.set_rng_state(state["rng"][self.info.rank])
        self._warn_config_changes(ckpt)
        self._truncate_metrics(self.step)
        if self.info.is_main:
            print(f"[draftsmith] resuming from {ckpt} at step {self.step}/{self.total_steps}", file=sys.stderr)

    def _warn_config_changes(self, ckpt: Path) -> None:
        meta_f = ckpt / "train_state" / "meta.json"
        if not meta_f.is_file() or not self.info.is_main:
            return
        old = json.loads(meta_f.read_text()).get("run_config", {})
        new = self.cfg.to_dict()
        changed = [f"data.{k}" for k in new["data"] if old.get("data", {}).get(k) != new["data"][k]]
        changed += [f"train.{k}" for k in new["train"]
                    if k not in _RESUME_FREE and old.get("train", {}).get(k) != new["train"][k]]
        if changed:
            print(f"[draftsmith] warning: {', '.join(changed)} changed since {ckpt.name}; the resumed run will "
                  "not match an unbroken one exactly", file=sys.stderr)

    # ---- logging --------------------------------------------------------------------------------

    def _metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    def _evaluate(self) -> None:
        """Score the held-out windows (train/evaluate.py); one row in heldout.jsonl (+ tensorboard)."""
        t0, c0 = time.perf_counter(), time.process_time()
        res = self.heldout(self.model)
        self.eval_wall += time.perf_counter() - t0
        self.eval_cpu += time.process_time() - c0
        row = {"step": self.step, **res, "eval_s": round(time.perf_counter() - t0, 3)}
        with open(self.out / HELDOUT_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in res.items():
                self.tb.add_scalar(f"heldout/{k}", v, self.step)
        shown = ", ".join(f"{k} {res[k]:.3f}" for k in ("accept", "acc@1", "acc", "loss") if k in res)
        msg = f"[draftsmith] step {self.step}: held-out {shown} ({len(self.heldout.windows)} windows)"
        if self.bar is not None and not self.bar.disable:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr)

    def _truncate_metrics(self, step: int) -> None:
        """Drop rows a killed run logged after the checkpoint being resumed."""
        for f in (self._metrics_path(), self.out / HELDOUT_FILE):
            self._truncate_rows(f, step)

    def _truncate_rows(self, f: Path, step: int) -> None:
        if not self.info.is_main or not f.is_file():
            return
        keep = []
        for line in f.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line
            if int(row.get("step", 0)) <= step:
                keep.append(line)
        tmp = f.with_name(f".{f.name}.tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        tmp.replace(f)

    def _open_loggers(self) -> None:
        self.metrics_file = None
        self.tb = None
        self.bar = None
        if not self.info.is_main:
            return
        self.metrics_file = open(self._metrics_path(), "a")
        t = self.cfg.train
        if t.tensorboard != "off":
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package

                self.tb = SummaryWriter(str(self.out / "tensorboard"))
            except ImportError:
                if t.tensorboard == "on":
                    raise DraftsmithError("train.tensorboard=on needs the tensorboard package "
                                          "(pip install tensorboard), or use tensorboard=auto") from None

        show = sys.stderr.isatty() if t.progress == "auto" else t.progress == "on"
        self.bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {self.cfg.kind}", unit="step",
                        file=sys.stderr, dynamic_ncols=True, disable=not show)

    def _log(self, row: dict) -> None:
        self.history.append(row)
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(row) + "\n")
            self.metrics_file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, row["step"])

    def _close_loggers(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()

    # ---- the loop -------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        threads = torch.get_num_threads()
        created = not self.out.exists()
        ok = False
        try:
            result = self._fit()
            ok = True
            return result
        except BaseException:
            # a run that failed before writing anything leaves no empty run directory behind
            if created and self.out.is_dir() and not any(self.out.iterdir()):
                self.out.rmdir()
            raise
        finally:
            torch.set_num_threads(threads)  # train.threads applies to this run only
            if self.info is not None:
                if self.info.enabled:
                    if ok:  # every rank is here: none is left inside a collective when the group goes
                        dist_util.barrier(self.info)
                    # DDP's reducer holds the process group (and gloo work) alive past destroy_process_group;
                    # freed at interpreter exit instead, gloo's threads abort the process (SIGABRT)
                    self.wrapped = None
                    gc.collect()
                shutdown(self.info)

    def _fit(self) -> TrainResult:
        self._setup()
        t = self.cfg.train
        info = self.info
        if not self.resume:  # a resumed run restores its draft vocabulary first (_restore)
            self._share_target_stats()
        deadline = None
        self.total_steps = self._planned_steps()
        if t.budget_minutes is not None:
            deadline = t.budget_minutes * 60.0  # on the budget's clock (_budget_spent)
            if not self.resume:
                per_step = self._probe_seconds_per_step()
                left = deadline - self._budget_spent()
                self.total_steps = max(1, int(0.95 * left / per_step))
                if info.is_main:
                    print(f"[draftsmith] budget {t.budget_minutes:g} {t.budget_clock} min: ~{per_step:.2f} s/step "
                          f"-> {self.total_steps} steps", file=sys.stderr)
        if self.resume:
            self._restore()
            self._share_target_stats()
        else:
            self._make_optimizer()
            torch.manual_seed(step_seed(t.seed, info.rank, -1))  # per-rank stream (dropout)
        if info.is_main:
            (self.out / "train_config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1) + "\n")
            d = self.data.describe()
            print(f"[draftsmith] {self.cfg.kind} on {self.target.target_id}: {len(self.params)} trainable tensors "
                  f"({sum(p.numel() for p in self.params.values()) / 1e6:.2f} M params), {d['windows']} windows "
                  f"from {d['source']} ({d['excluded_heldout']} held-out excluded), {self.total_steps} steps, "
                  f"{info.world_size} process(es)", file=sys.stderr)
        self._open_loggers()
        if self.init_from is not None and self.heldout is not None:
            self._evaluate()  # step 0: what the starting drafter scores, the baseline of a fine-tune
        acc: dict[str, float] = {}
        n_acc = 0
        last_loss: float | None = None
        stopped = False
        saved_at = self.step if self.resume else -1  # a resumed run's start is saved already
        path: Path | None = None
        t_log = time.perf_counter()
        start_step, start_spent = self.step, self._budget_spent()
        refit_at = (None if deadline is None or self.refit_step is not None
                    else max(self.step + PROBE_STEPS, math.ceil(REFIT_FRACTION * self.total_steps)))
        try:
            while self.step < self.total_steps:
                loss, parts, tokens = self._forward_backward(self.step)
                grad_norm, lr = self._optimizer_step()
                self.step += 1
                for k, v in {"loss": loss, **parts, "grad_norm": grad_norm}.items():
                    acc[k] = acc.get(k, 0.0) + float(v)
                acc["loss_tokens"] = acc.get("loss_tokens", 0.0) + tokens
                n_acc += 1
                last = self.step == self.total_steps
                if self.step % t.log_every == 0 or last:
                    means = dist_util.mean_over_ranks({k: v / n_acc for k, v in acc.items()}, info)
                    now = time.perf_counter()
                    row = {"step": self.step, "epoch": round(self.step / self.data.steps_per_epoch, 4),
                           "lr": lr, **means,
                           "loss_tokens": means["loss_tokens"] * n_acc * info.world_size,
                           "steps_per_s": n_acc / max(now - t_log, 1e-9),
                           "elapsed_s": round(now - self.t_start, 3), "cpu_s": round(self.cpu_s(), 3),
                           "train_cpu_s": round(self.train_cpu_s(), 3)}
                    last_loss = means["loss"]
                    self._log(row)
                    acc, n_acc, t_log = {}, 0, now
                if self.bar is not None:
                    self.bar.update(1)
                    if last_loss is not None:
                        self.bar.set_postfix(loss=f"{last_loss:.4f}", refresh=False)
                if refit_at is not None and self.step == refit_at and not last:
                    self._refit_budget(deadline, start_step, start_spent)  # (at least one step more)
                if deadline is not None and not last:  # rank 0 decides, so every rank stops together
                    stopped = bool(dist_util.broadcast_object(self._budget_spent() > deadline, info))
                if self.step % t.save_every == 0 or last or stopped:
                    path = self._save(last_loss)
                    saved_at = self.step
                    if self.heldout is not None:
                        self._evaluate()
                for hook in self.hooks:
                    hook(self.step, self)
                if stopped:
                    if info.is_main:
                        print(f"[draftsmith] budget reached at step {self.step}/{self.total_steps}; saved",
                              file=sys.stderr)
                    break
            if saved_at != self.step and self.step > 0:
                path = self._save(last_loss)
                if self.heldout is not None:
                    self._evaluate()
        finally:
            self._close_loggers()
        if info.is_main and path is not None:
            print(f"[draftsmith] checkpoint: {path} (inference files also in {self.out})", file=sys.stderr)
        return TrainResult(step=self.step, total_steps=self.total_steps, checkpoint=path, final_loss=last_loss,
                           history=self.history, stopped_at_deadline=stopped)


def train(cfg: TrainConfig, catalogue: Catalogue | None = None, resume: bool | str | Path = False,
          overwrite: bool = False, hooks: Sequence[StepHook] = ()) -> TrainResult:
    return Trainer(cfg, catalogue, resume=resume, overwrite=overwrite, hooks=hooks).fit()
