"""Facts about the machine and the software a bench ran on, for setup.json and each tier's line:
CPU model and cores, memory, GPU, load average, library versions, process memory.

The CPU model comes from `policy/profile.py`, whose SPS cache key is built from the same facts.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform

import torch
import transformers

import draftsmith
from draftsmith.policy.profile import cpu_model


def proc_bytes(field: str, path: str = "/proc/self/status") -> int | None:
    """A `kB` field of a /proc status file (VmRSS, VmHWM, MemTotal, MemAvailable…) in bytes; None if absent."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def loadavg() -> list[float] | None:
    """The 1 / 5 / 15-minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict:
    info = {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "mem_total_bytes": proc_bytes("MemTotal", "/proc/meminfo"),
            "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_mem_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def versions() -> dict:
    return {"draftsmith": draftsmith.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
