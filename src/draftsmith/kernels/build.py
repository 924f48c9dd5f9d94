"""Build and load Draftsmith's own CPU kernels (kernels/gemv.cpp) once per machine.

The few-row linear kernel is compiled on first use with the machine's C++ compiler
(`$CXX`, else `c++`) and `-march=native` against the installed torch, then cached under
`$DRAFTSMITH_HOME/kernels/<key>/` where the key hashes the source, the compile command, the
torch version and the CPU's instruction-set flags (a home shared by different machines gets
one build per kind of CPU). The build is ~10 s on 2 cores, written to a temporary file and
renamed, so processes that build at once cannot load half a library.

`cpu_kernels()` answers whether the kernels can run here; when they cannot it says why
(not an x86-64 CPU with AVX-512, no compiler, the compile failed), and the linear backend
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
BUILD_TIMEOUT_S = 600
_BUILD_LOCK = threading.Lock()  # one build per process at a time (threads of a server)


@dataclass(frozen=True)
class KernelStatus:
    ok: bool  # float32 kernels loaded (torch.ops.draftsmith.*)
    bf16: bool  # the bfloat16 kernel too (the CPU has AVX512-BF16)
    reason: str  # why not, or where the library is


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _command(compiler: str, out: Path) -> list[str]:
    import torch
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    incs = [f"-isystem{p}" for p in include_paths()]
    return [compiler, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++17",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *incs, str(SOURCE), "-o", str(out),
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
    h.update(SOURCE.read_bytes())
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
    if platform.machine() not in ("x86_64", "AMD64") or "avx512f" not in flags:
        return KernelStatus(False, False, "the CPU has no AVX-512 (x86-64 avx512f)")
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return KernelStatus(False, False, "no C++ compiler (set CXX or install g++)")
    from draftsmith.models.registry import draftsmith_home

    out_dir = draftsmith_home() / "kernels" / _key(compiler, _command(compiler, Path("lib.so")), flags)
    lib = out_dir / "draftsmith_kernels.so"
    if not lib.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".draftsmith_kernels.{os.getpid()}.{uuid.uuid4().hex[:8]}.so"
        print("draftsmith: compiling the CPU decode kernels for this machine (once, ~10 s)...", file=sys.stderr)
        try:
            done = subprocess.run(_command(compiler, tmp), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
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
    return KernelStatus(True, bool(torch.ops.draftsmith.has_bf16()), str(lib))
