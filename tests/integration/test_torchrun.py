"""`torchrun --nproc_per_node 2 -m draftsmith train` on CPU (gloo) vs one process, same recipe.

The recipe's batch size is global (split over processes), so both runs take the same steps
over the same samples and their loss curves should have the same shape: both fall, and end
close together (anchor sampling differs per rank, so not bit-identical).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from standin_drafter import sequence_records  # noqa: E402

STEPS = 12


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from draftsmith.data.cache import CacheConfig, run_cache

    target = tiny_model_dir("llama", seed=0)
    root = tmp_path_factory.mktemp("ddp")
    regen = sequence_records(root / "regen.jsonl", n=40)
    run_cache(CacheConfig(target=str(target), data=regen, out=root / "cache", layers="1", dtype="fp32",
                          progress=False))
    recipe = root / "recipe.yaml"
    recipe.write_text(f"""target: {target}
out: {root / "unused"}
drafter: {{kind: dflash, num_layers: 1, block_size: 3, layer_ids: [1], max_anchors: 6}}
data: {{cache: {root / "cache"}, max_len: 32}}
train: {{batch_size: 4, max_steps: {STEPS}, save_every: 8, log_every: 1, lr: 5.0e-3, progress: "off"}}
""")
    return root, recipe


def losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_gloo_processes_train_like_one(setup):
    from draftsmith.train.config import load_train_config
    from draftsmith.train.trainer import Trainer

    root, recipe = setup
    one = Trainer(load_train_config(recipe, [f"out={root / 'one'}"])).fit()
    assert one.step == STEPS
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "draftsmith", "train", "--config", str(recipe), f"out={root / 'two'}", "--json"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # rank 0 prints once
    assert result["step"] == STEPS and result["total_steps"] == STEPS
    a, b = losses(root / "one"), losses(root / "two")
    assert len(a) == len(b) == STEPS
    head, tail = slice(0, 3), slice(-3, None)
    for curve in (a, b):  # both fall ...
        assert sum(curve[tail]) < 0.8 * sum(curve[head]), curve
    assert abs(sum(a[tail]) - sum(b[tail])) < 0.25 * sum(a[tail]), (a, b)  # ... to about the same place
    assert abs(a[0] - b[0]) < 0.1 * a[0]  # same initial weights, same first global batch
    # rank 0 alone wrote the checkpoint, with both ranks' RNG states
    from draftsmith.train.checkpoint import list_checkpoints, load_train_state

    (step, ckpt), = list_checkpoints(root / "two")[-1:]
    state = load_train_state(ckpt)
    assert step == STEPS and state["world_size"] == 2 and len(state["rng"]) == 2
    meta = json.loads((ckpt / "train_state" / "meta.json").read_text())
    assert meta["world_size"] == 2
    # both ranks ended with bit-identical weights (each checkpoint gathers a digest per rank and
    # refuses to save diverged replicas), and the saved weights are those
    digests = meta["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
