"""Our speculators exports load in the real `speculators` package (what vLLM reads): pydantic
validation of config.json and `SpeculatorModel.from_pretrained` against the exported verifier,
every exported tensor loaded bit-equal and none left over, for EAGLE-3 (full and reduced
vocabulary, Llama and Qwen3 targets), DFlash and DSpark (benchmarks/check_export_speculators.py).

speculators is installed by `make test` without its dependencies (requirements-interop.txt);
its import chain names `datasets` and `hs_connectors`, which loading never uses: the check runs
in a child process where those two are empty stand-ins, so nothing here touches this process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

# installed, not imported here: its import chain needs the stand-ins the child process sets up
pytestmark = pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                                reason="speculators is not installed (make test installs it: requirements-interop.txt)")

ROOT = Path(__file__).resolve().parents[2]
CASES = [("qwen3", "eagle3-full"), ("qwen3", "eagle3-small"), ("qwen3", "dflash"), ("qwen3", "dspark-small"),
         ("llama", "eagle3-full"), ("llama", "eagle3-small")]
STUBBED = """
import importlib.abc, importlib.machinery, runpy, sys, types
from unittest import mock

class Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("datasets", "hs_connectors"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        module = Stub(spec.name)
        module.__path__ = []
        return module
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, Finder())
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def test_speculators_loads_every_export():
    out = subprocess.run([sys.executable, "-c", STUBBED, str(ROOT / "benchmarks" / "check_export_speculators.py")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {tuple(ln.split()[:2]): ln for ln in out.stdout.splitlines() if ln.split()[:1] in (["qwen3"], ["llama"])}
    assert set(lines) == set(CASES), out.stdout
    for case, line in lines.items():
        assert "FAILED" not in line, line
        assert "unexpected: []" in line and line.endswith("tensors equal: True"), line
