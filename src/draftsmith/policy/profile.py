"""SPS(B): target forward steps per second when one step processes B tokens.

DSpark's hardware-aware scheduler (policy/prefix_scheduler.py) weighs the tokens a longer
verify block is expected to commit against what the bigger forward costs on *this* machine.
That cost curve is measured once per machine + model and cached as JSON:

    $DRAFTSMITH_HOME/profiles/<target>-<key hash>.json

The key is hostname-independent: CPU model / count and torch threads (or the GPU name),
torch version, target weights hash, dtype, device type and the grid that was timed. Two
machines with the same hardware share a key; a different model, dtype or torch does not.

Measuring B tokens: the engine's forward is [rows, width] (every running row pads to the longest
verify block), so B is timed as the shape it occurs in: `rows = the most rows (<= max_batch)
with rows * width = B and width <= max_k + 1`. Rows hold `context_len` cached tokens; a step is
the target forward plus the argmax of every position (what the engine reads of an all-greedy
round; a sampled round's warp the cost model learns online, policy/cost.py). Every grid point
gets `warmup` untimed steps, then the points are timed in turn, `repeats` passes over the whole
grid, and each keeps its median: a burst of load on a shared machine then slows one step of many
points, not every step of one or two (timed point by point, a burst over the first points once
made 1 token cost what 8 did, and the cached table told the scheduler that verification was
free). A point can still come out faster than a smaller one; step times are therefore made
non-decreasing in B (a bigger forward never costs less) before they are stored.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.kernels.build import cpu_kernels
from draftsmith.models.registry import draftsmith_home
from draftsmith.policy.roofline import step_runner

FORMAT_VERSION = 4  # 2: the key names the linear backend (models/linear.py); 3: grid points timed in turn;
# 4: a step reads the argmax of its logits, as the engine's greedy round (it built one-hot probabilities)


@dataclass(frozen=True)
class SPSTable:
    """Measured steps/s at grid points of B (tokens per target forward), interpolated.

    Interpolation is linear in step *time* (time per forward is close to affine in B),
    clamped to the first point below the grid and extrapolated along the last segment
    (never with a negative slope) above it; a one-point table is flat.
    """

    tokens: tuple[int, ...]  # B grid, strictly increasing, >= 1
    steps_per_s: tuple[float, ...]  # SPS at each grid point, > 0

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.steps_per_s):
            raise DraftsmithError("SPS table needs as many steps/s values as grid points, at least one")
        if any(b < 1 for b in self.tokens) or any(a >= b for a, b in zip(self.tokens, self.tokens[1:])):
            raise DraftsmithError(f"SPS grid must be strictly increasing and >= 1, got {self.tokens}")
        if not all(s > 0 and s != float("inf") for s in self.steps_per_s):
            raise DraftsmithError(f"SPS values must be positive and finite, got {self.steps_per_s}")

    def step_time(self, b: float) -> float:
        """Seconds per forward at b tokens."""
        xs, ts = self.tokens, [1.0 / s for s in self.steps_per_s]
        if b <= xs[0] or len(xs) == 1:
            return ts[0]
        i = bisect_left(xs, b)
        if i == len(xs):  # above the grid: continue the last segment
            slope = max((ts[-1] - ts[-2]) / (xs[-1] - xs[-2]), 0.0)
            return ts[-1] + slope * (b - xs[-1])
        x0, x1, t0, t1 = xs[i - 1], xs[i], ts[i - 1], ts[i]
        return t0 + (t1 - t0) * (b - x0) / (x1 - x0)

    def __call__(self, b: float) -> float:
        """SPS(b): forward steps per second at b tokens per step."""
        return 1.0 / self.step_time(b)

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    def to_dict(self) -> dict:
        return {"tokens": list(self.tokens), "steps_per_s": list(self.steps_per_s)}

    @staticmethod
    def from_dict(d: dict) -> "SPSTable":
        return SPSTable(tuple(int(b) for b in d["tokens"]), tuple(float(s) for s in d["steps_per_s"]))

    @staticmethod
    def from_step_times(tokens: tuple[int, ...], seconds: tuple[float, ...]) -> "SPSTable":
        return SPSTable(tuple(tokens), tuple(1.0 / t for t in seconds))


@dataclass(frozen=True)
class ProfileConfig:
    """What to time. The grid covers 1..max_batch * (max_k + 1) tokens."""

    max_batch: int = 8  # engine rows (requests running at once)
    max_k: int = 5  # longest verify block in drafts (width = max_k + 1)
    context_len: int = 256  # cached tokens per row while timing (attention cost)
    warmup: int = 2  # untimed steps per grid point
    repeats: int = 5  # timed steps per grid point; the median is kept
    max_points: int = 16  # grid size cap (points spread geometrically)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_k < 0 or self.context_len < 0:
            raise DraftsmithError(f"bad profile config {self}: need max_batch >= 1, max_k >= 0, context_len >= 0")
        if self.repeats < 1 or self.warmup < 0 or self.max_points < 2:
            raise DraftsmithError(f"bad profile config {self}: need repeats >= 1, warmup >= 0, max_points >= 2")

    def grid(self) -> tuple[tuple[int, int, int], ...]:
        """(B, rows, width) points: every B that a [rows, width] forward can take, thinned
        geometrically to at most max_points, always keeping 1..4 and the largest."""
        W = self.max_k + 1
        shape: dict[int, tuple[int, int]] = {}
        for r in range(1, self.max_batch + 1):
            for w in range(1, W + 1):
                b = r * w
                if b not in shape or r > shape[b][0]:  # prefer more rows: the decode shape
                    shape[b] = (r, w)
        bs = sorted(shape)
        keep = {b for b in bs if b <= 4} | {bs[-1]}
        ratio = (bs[-1] / 4) ** (1 / max(self.max_points - len(keep), 1)) if bs[-1] > 4 else 2.0
        x = 4.0
        while x < bs[-1]:
            x *= ratio
            keep.add(min(bs, key=lambda b: (abs(b - x), b)))
        return tuple((b, *shape[b]) for b in sorted(keep))


# ----------------------------------------------------------------------------- measuring


def profile_sps(model, config: ProfileConfig = ProfileConfig(),
                clock: Callable[[], float] = time.perf_counter) -> tuple[SPSTable, dict]:
    """Time the target's forward at every grid point. Returns (table, raw measurements)."""
    grid = config.grid()
    times = interleaved_step_times(model, [(rows, width) for _, rows, width in grid], config.context_len,
                                   config.repeats, config.warmup, clock)
    monotone = [max(times[: i + 1]) for i in range(len(times))]
    table = SPSTable.from_step_times(tuple(b for b, _, _ in grid), tuple(monotone))
    raw = {"grid": [list(g) for g in grid], "median_s": times, "monotone_s": monotone}
    return table, raw


def interleaved_step_times(model, shapes: list[tuple[int, int]], context_len: int, repeats: int, warmup: int,
                           clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median seconds of a target forward of each [rows, width] shape, the shapes timed in
    turn (`repeats` passes over all of them, after `warmup` untimed steps each)."""
    cache = model.new_cache(max(r for r, _ in shapes), context_len + max(w for _, w in shapes) + 1)  # shared
    steps = [step_runner(model, rows, width, context_len, cache) for rows, width in shapes]
    for step in steps:
        for _ in range(warmup):
            step(clock)
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for t, step in zip(times, steps):
            t.append(step(clock))
    return [statistics.median(t) for t in times]


# ----------------------------------------------------------------------------- caching


def machine_fingerprint(device: torch.device) -> dict:
    """Hardware + software that decide forward speed; no hostname, no paths."""
    if device.type == "cuda":
        hw = {"gpu": torch.cuda.get_device_name(device), "gpus": torch.cuda.device_count()}
    else:
        hw = {"cpu": cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    return {**hw, "machine": platform.machine(), "torch": torch.__version__}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows. Also bench's machine facts."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_fingerprint(model) -> str:
    """Weights hash for a model loaded without one: names, shapes, dtype and a sample of values."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(p.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def profile_key(model, weights_hash: str, config: ProfileConfig) -> dict:
    backend = getattr(model, "linear_backend", None)
    return {
        "format_version": FORMAT_VERSION,
        "machine": machine_fingerprint(model.device),
        "weights_hash": weights_hash,
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": model.device.type,
        "linear_backend": backend,
        # Draftsmith's CPU kernels: their build (a changed kernel is a new speed: profile again)
        "kernels": cpu_kernels().build if backend == "kernels" else None,
        "grid": [list(g) for g in config.grid()],
        "context_len": config.context_len,
    }


def load_or_profile(
    model,
    *,
    weights_hash: str | None = None,
    name: str = "target",
    config: ProfileConfig = ProfileConfig(),
    home: Path | None = None,
    refresh: bool = False,
    log: Callable[[str], None] | None = None,
) -> SPSTable:
    """The cached SPS table for this machine + model, profiling (and caching) it if absent.

    model:        a Decoder (models/decoder.py); weights_hash: LoadedTarget.weights_hash
                  (computed from the parameters when None); name: file-name prefix only.
    refresh:      profile again even when a cached table exists.
    A cache file that cannot be read is replaced (it only holds measurements).
    """

    key = profile_key(model, weights_hash or model_fingerprint(model), config)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    path = (home or draftsmith_home()) / "profiles" / f"{safe}-{digest}.json"
    if path.is_file() and not refresh:
        try:
            doc = json.loads(path.read_text())
            if doc.get("key") == key:
                return SPSTable.from_dict(doc["table"])
        except (OSError, ValueError, KeyError, TypeError, DraftsmithError):
            pass  # unreadable or stale: measure again below
        if log:
            log(f"profile cache {path} is unreadable or stale; profiling again")
    if log:
        log(f"profiling SPS(B) for {name} on this machine ({len(config.grid())} points) -> {path}")
    table, raw = profile_sps(model, config)
    doc = {"key": key, "config": asdict(config), "table": table.to_dict(), "raw": raw,
           "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return table
