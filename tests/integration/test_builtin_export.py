"""The built-in drafter leaves for vLLM and comes back unchanged (issue 13's goal): `export
--format speculators` of `dspark:smollm2-135m`, then `import`, gives the same config and weights, and the
re-imported drafter proposes exactly what the built-in does on the real default target."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith import LLM, SamplingParams
from draftsmith.cli import main
from draftsmith.drafters import builtin
from draftsmith.drafters.registry import load_checkpoint_model
from draftsmith.models.target import load_target

pytestmark = pytest.mark.slow
PROMPTS = ["def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "Name three uses of a hash map."]


def test_builtin_exports_to_speculators_and_imports_back(default_target_dir, tmp_path):
    out, back = tmp_path / "spec", tmp_path / "imported"
    assert main(["export", "--drafter", "dspark:smollm2-135m", "--target", str(default_target_dir),
                 "--format", "speculators", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["draft_vocab_size"] == 8192
    assert cfg["sample_from_anchor"] is not None  # written explicitly (vLLM reads a missing value two ways)
    assert main(["import", str(out), "--target", str(default_target_dir), "--out", str(back)]) == 0
    target = load_target(str(default_target_dir))
    shipped = load_checkpoint_model(builtin.builtin_dir("dspark", "smollm2-135m"), target)
    again = load_checkpoint_model(back, target)
    # the speculators config carries what inference needs; the training-only settings (loss
    # weights, anchors per sample, init) travel in the "draftsmith" block: the whole config returns
    assert again.config == shipped.config
    assert cfg["draftsmith"]["train"]["max_anchors"] == shipped.config.max_anchors
    for k, v in shipped.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    p = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    runs = []
    for spec in ("dspark:smollm2-135m", f"dspark:{back}"):  # on the target loaded above, not loaded again
        llm = LLM(target, policy="fixed", drafter=spec, num_speculative_tokens=7)
        runs.append(([o.token_ids for o in llm.generate(PROMPTS, p)], llm.last_stats.draft_accepted))
    assert runs[0] == runs[1] and runs[0][1] > 0
