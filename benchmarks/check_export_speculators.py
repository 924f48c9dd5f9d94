"""Load `draftsmith export --format speculators` directories with the real speculators package.

    .venv/bin/python -m pytest -q tests/integration/test_speculators_load.py

`make test` installs speculators without its dependencies (requirements-interop.txt) and runs
this script through that test, which stands in empty modules for `datasets` / `hs_connectors`
(named by speculators' import chain, unused for loading).

Builds tiny Qwen3-style and Llama-style targets (tests/conftest.py), an EAGLE-3 drafter (full
and reduced vocabulary) for both and DFlash / DSpark drafters for the Qwen3 one, exports each,
then `SpeculatorModelConfig.from_pretrained` (pydantic validation) and
`SpeculatorModel.from_pretrained` (against the exported verifier path) load it. Prints, per
drafter, the tensors speculators fills from the verifier, any unexpected tensor, and whether
every exported tensor loaded bit-equal. A format check, not a benchmark: no timing.
"""

import sys
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]
import torch
from conftest import make_tiny_model
from safetensors.torch import load_file
from draftsmith.models.target import load_target
from draftsmith.drafters import eagle3, dflash, dspark
from draftsmith.drafters.checkpoint import save_trained_drafter
from draftsmith.export.formats import export_drafter
from speculators import SpeculatorModel, SpeculatorModelConfig
root = Path(tempfile.mkdtemp())
for mt in ("qwen3", "llama"):
    tdir = make_tiny_model(root / f"t-{mt}", mt, 0)
    tgt = load_target(str(tdir))
    V = tgt.model.config.vocab_size
    models = {"eagle3-full": eagle3.build(tgt.model, eagle3.Eagle3Config(ttt_steps=3)),
              "eagle3-small": eagle3.build(tgt.model, eagle3.Eagle3Config(ttt_steps=3, draft_vocab_size=100))}
    if mt == "qwen3":
        models["dflash"] = dflash.build(tgt.model, dflash.DFlashConfig(block_size=4, num_layers=1))
        m = dspark.build(tgt.model, dspark.DSparkConfig(block_size=4, num_layers=1, rank=8, draft_vocab_size=100))
        m.init_draft_vocab(torch.arange(V, 0, -1) % 37)
        models["dspark-small"] = m
    for name, m in models.items():
        ck = root / f"{mt}-{name}-ckpt"; save_trained_drafter(m, ck, tgt.target_id, tgt.weights_hash)
        out = export_drafter(ck, tgt, "speculators", root / f"{mt}-{name}-spec")
        try:
            cfg = SpeculatorModelConfig.from_pretrained(str(out))
            sm = SpeculatorModel.from_pretrained(str(out))
            theirs = sm.state_dict(); mine = load_file(str(out / "model.safetensors"))
            missing = sorted(set(theirs) - set(mine)); unexpected = sorted(set(mine) - set(theirs))
            same = all(torch.equal(theirs[k].cpu().to(mine[k].dtype), mine[k]) for k in mine if k in theirs)
            print(f"{mt:6s} {name:13s} config {type(cfg).__name__}: loaded; not in file (filled by speculators): {missing[:4]}{'...' if len(missing)>4 else ''}; unexpected: {unexpected}; tensors equal: {same}")
        except Exception as e:
            print(f"{mt:6s} {name:13s} FAILED: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
