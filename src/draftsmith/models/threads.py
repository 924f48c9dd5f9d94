"""How many CPU threads torch's kernels use (`--threads N`, `LLM(..., threads=N)`).

Default: the physical cores this process may run on. Decode is memory-bound; SMT siblings
share a core's load ports, so a thread per logical CPU only adds contention. Tests may pin 1.

Spin-waiting: OpenMP threads that finish a parallel region spin before they sleep; a decode
step runs ~150 regions (the linears, attention). libgomp's default spin (300k iterations) is
fastest on an idle machine, but two such processes on the same cores hold each other's cores:
~18 ms/token alone became 0.65-1.2 s/token each (measured, BENCHMARKS.md Runtime). Sleeping at
once (OMP_WAIT_POLICY=PASSIVE) costs ~40% alone (a wake-up per region). The package sets
`GOMP_SPINCOUNT=3000` at import (draftsmith/__init__.py, before torch loads OpenMP) unless the
environment sets OMP_WAIT_POLICY or GOMP_SPINCOUNT: alone as fast as the default (within
noise), ~47 ms/token each for two processes instead of a collapse. It only takes effect when
draftsmith is imported before torch (the CLI always is).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError


def physical_cores() -> int:
    """Physical cores among the CPUs this process may use (Linux sysfs; os.cpu_count elsewhere)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    cores: set[tuple[str, str]] = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def configure_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to `threads`. None keeps the current setting (so a caller's
    own `torch.set_num_threads` stands) but never more than the physical cores: torch's
    default on an SMT machine is one thread per logical CPU. Returns the count in force."""
    if threads is None:
        threads = min(torch.get_num_threads(), physical_cores())
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise DraftsmithError(f"threads must be a positive integer, got {threads!r}")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
