"""The GPU machine's check script, dry-run on the CPU: every step it takes on a GPU runs here
too (small), so a lent GPU never meets a script that was never run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_device_check_dry_run(tmp_path, default_target_dir):
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert prof["device"] == "cpu" and prof["tokens"][0] == 1 and prof["tokens"][-1] == 64
    assert len(prof["step_ms"]) == len(prof["tokens"]) and all(t > 0 for t in prof["step_ms"])
    assert prof["floor_ms"] == pytest.approx(1e3 * prof["weight_bytes"] / (prof["bandwidth_gbs"] * 1e9))
    assert 4e8 < prof["weight_bytes"] < 7e8  # smollm2-135m in float32: ~0.54 GB read per step
    assert prof["sps"]["tokens"][-1] == 64
    from draftsmith.kernels.build import cpu_kernels

    st = cpu_kernels()  # the CPU profile says which linears ran and whether our kernels could
    assert prof["linear_backend"] == ("kernels" if st.ok else "onednn")
    assert prof["cpu_kernels"].startswith("loaded" if st.ok else "not available") and st.reason in prof["cpu_kernels"]
    quick = json.loads((tmp_path / "quick_bench.json").read_text())
    assert quick["all_identical"] and len(quick["rows"]) == 2
    structured = json.loads((tmp_path / "structured.json").read_text())
    assert structured["all_identical"] and len(structured["rows"]) == 2 and len(structured["configs"]) == 4
    assert "skipped" in (tmp_path / "gpu_tests.txt").read_text() or "passed" in (tmp_path / "gpu_tests.txt").read_text()
