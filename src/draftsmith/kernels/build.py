"""Build and load Draftsmith's own CPU kernels (kernels/gemv.cpp) once per machine.

The few-row linear kernel is compiled on first use with the machine's C++ compiler
(`$CXX`, else `c++`) and `-march=native` against the installed torch, then cached under
`$DRAFTSMITH_HOME/kernels/<key>/` where the key hashes the source, the compile command (with its
per-CPU tuning defines), the torch version and the CPU's instruction-set flags (a home shared by different machines gets
one build per kind of CPU). The build is ~10 s on 2 cores, written to a temporary file and
renamed, so processes that build at once cannot load half a library.

They run on x86-64 CPUs with AVX-512 (one zmm register per 16 floats) or with AVX2 + FMA (two ymm
registers: AMD Zen 1-3, Intel client CPUs without AVX-512); `-march=native` picks which (simd.h).
`cpu_kernels()` answers whether the kernels can run here; when they cannot it says why
(not an x86-64 CPU with AVX2 + FMA, no compiler, the compile failed), and the linear backend
"auto" falls back to oneDNN (models/linear.py). Nothing here runs at import.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("gemv.cpp")
HEADERS = (Path(__file__).with_name("simd.h"),)
BUILD_TIMEOUT_S = 600
_BUILD_LOCK = threading.Lock()  # one build per process at a time (threads of a server)


@dataclass(frozen=True)
class KernelStatus:
    ok: bool  # float32 kernels loaded (torch.ops.draftsmith.*)
    bf16: bool  # the bfloat16 linear kernel too (AVX512-BF16 dot products, or widening to float32 without it)
    reason: str  # why not, or where the library is
    isa: str = ""  # "avx512-bf16", "avx512" or "avx2" when ok
    build: str = ""  # the build's key (source, flags, compiler, torch, CPU flags) when ok: a new key, new speeds


def cpu_fields(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's "key: value" lines of /proc/cpuinfo (keys and values stripped); empty
    where it cannot be read. The one parser of it for cpu_flags and cpu_family."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the end of the first processor's block
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's instruction-set flags: the first "flags" line of /proc/cpuinfo on x86, its "Features"
    line on Arm; empty where neither is there. The one reader of them: the kernels' build key and
    tuning defines here, the bf16 / fp16 hardware checks in models/target.py."""
    fields = cpu_fields(cpuinfo)
    return frozenset(fields.get("flags", fields.get("Features", "")).split())


def cpu_family(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, int | None]:
    """The CPU's vendor and family as /proc/cpuinfo names them (("AuthenticAMD", 25) for a Zen 3 or
    Zen 4, ("GenuineIntel", 6)); ("", None) for what it does not say. With cpu_flags, what
    tuning_defines picks per-CPU compile choices from (_command)."""
    fields = cpu_fields(cpuinfo)
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else None


def tuning_defines(vendor: str, family: int | None, flags: frozenset[str]) -> list[str]:
    """Compile-time choices measured per kind of CPU. A Zen 4 (AMD family 25 with AVX-512): the
    linears' software prefetches of a call with 4 or more rows fill L2, not L1 (`DS_PREFETCH_L2`,
    gemv.cpp's `prefetch_for`). Elsewhere they fill L1: as tuned on Intel and on a Zen 5, and on a
    Zen 3 (family 25, AVX2) L1 beat L2 (BENCHMARKS.md, stop 26)."""
    return ["-DDS_PREFETCH_L2"] if vendor == "AuthenticAMD" and family == 25 and "avx512f" in flags else []


def _command(compiler: str, out: Path, family: tuple[str, int | None] | None = None,
             flags: frozenset[str] | None = None) -> list[str]:
    import torch
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    incs = [f"-isystem{p}" for p in include_paths()]
    defines = tuning_defines(*(cpu_family() if family is None else family), cpu_flags() if flags is None else flags)
    return [compiler, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++17",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *defines, *incs, str(SOURCE), "-o", str(out),
            f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]


def _key(compiler: str, cmd: list[str], flags: frozenset[str]) -> str:
    """Source, every compile flag (not the paths), the compiler's version, torch's version and the
    CPU's instruction-set flags."""
    import torch

    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    h = hashlib.sha256()
    for f in (SOURCE, *HEADERS):
        h.update(f.read_bytes())
    h.update(" ".join(c for c in cmd if c.startswith("-") and not c.startswith(("-isystem", "-L", "-Wl,-rpath"))).encode())
    h.update(version.encode())
    h.update(torch.__version__.encode())
    h.update(" ".join(sorted(f for f in flags if f.startswith(("avx", "fma", "amx", "f16c")))).encode())
    return h.hexdigest()[:16]


@functools.cache
def cpu_kernels() -> KernelStatus:
    """Build (once per machine) and load the kernels; never raises: a failure is a status."""
    with _BUILD_LOCK:
        try:
            return _build_and_load()
        except Exception as e:  # noqa: BLE001 (a read-only home, a full disk...: fall back, say why)
            return KernelStatus(False, False, f"building or loading {SOURCE.name} failed: {type(e).__name__}: {e}")


def _build_and_load() -> KernelStatus:
    import torch

    flags = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not ("avx512f" in flags or {"avx2", "fma"} <= flags):
        return KernelStatus(False, False, "the CPU has neither AVX-512 nor AVX2 + FMA (x86-64 avx512f, or avx2 and fma)")
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return KernelStatus(False, False, "no C++ compiler (set CXX or install g++)")
    from draftsmith.models.registry import draftsmith_home

    family = cpu_family()
    key = _key(compiler, _command(compiler, Path("lib.so"), family, flags), flags)
    out_dir = draftsmith_home() / "kernels" / key
    lib = out_dir / "draftsmith_kernels.so"
    if not lib.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".draftsmith_kernels.{os.getpid()}.{uuid.uuid4().hex[:8]}.so"
        print("draftsmith: compiling the CPU decode kernels for this machine (once, ~10 s)...", file=sys.stderr)
        try:
            done = subprocess.run(_command(compiler, tmp, family, flags), capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
                return KernelStatus(False, False, f"compiling {SOURCE.name} failed:\n{tail}")
            os.replace(tmp, lib)
        except (OSError, subprocess.TimeoutExpired) as e:
            return KernelStatus(False, False, f"compiling {SOURCE.name} failed: {e}")
        finally:
            tmp.unlink(missing_ok=True)
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        return KernelStatus(False, False, f"loading {lib} failed: {e}")
    ops = torch.ops.draftsmith
    return KernelStatus(True, bool(ops.has_bf16()), str(lib), str(ops.isa()), key)
