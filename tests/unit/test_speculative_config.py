"""vLLM's speculative config (engine/speculative_config.py): what each vLLM form becomes here
(drafter spec, K, policy), vLLM's batch-size schedule read as vLLM's lookup reads it, a clear
error for every setting that cannot run as written, and the config reaching the engine through
`LLM(speculative_config=...)`, `generate` and `serve`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from draftsmith import LLM, DraftsmithError, SamplingParams
from draftsmith.drafters import dspark, registry
from draftsmith.drafters.checkpoint import save_trained_drafter
from draftsmith.drafters.ngram import NgramConfig, NgramDrafter
from draftsmith.engine.speculative_config import batch_schedule, speculative_setup, with_speculative_config
from draftsmith.models.target import load_target
from draftsmith.policy.batch_schedule import BatchSizeSchedule

BUILTIN_K = 7  # the built-in dspark:smollm2-135m's block size (its config.json)


@pytest.mark.parametrize("config, drafter, k", [
    ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
     "ngram:prompt_lookup_min=2,prompt_lookup_max=4", 5),
    # one of the two given: the other equals it (vLLM's rule); neither: Draftsmith's 1..3
    ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}, "ngram:prompt_lookup_max=4", 5),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}, "ngram:prompt_lookup_min=2", 3),
    ({"method": "ngram", "num_speculative_tokens": 3}, "ngram", 3),
    ({"method": "ngram_gpu", "num_speculative_tokens": 3}, "ngram", 3),
    ({"model": "[ngram]", "num_speculative_tokens": 2}, "ngram", 2),
    ({"method": "[ngram]", "num_speculative_tokens": 2}, "ngram", 2),
    # a built-in drafter's name; K from its checkpoint where the config gives none
    ({"method": "dspark", "model": "smollm2-135m"}, "dspark:smollm2-135m", BUILTIN_K),
    ({"method": "dspark", "model": "smollm2-135m", "num_speculative_tokens": 4}, "dspark:smollm2-135m", 4),
    ({"model": "smollm2-135m"}, "dspark:smollm2-135m", BUILTIN_K),  # the kind read from the directory
    ({"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 3},
     "draft-model:smollm2-135m", 3),
    ({"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3}, "draft-model:qwen2.5-coder-0.5b", 3),
])
def test_vllm_configs_become_a_drafter_spec_and_k(config, drafter, k):
    setup = speculative_setup(config)
    assert (setup.drafter, setup.num_speculative_tokens, setup.policy) == (drafter, k, None)
    # (ngram with neither size warns that Draftsmith's 1..3 is not vLLM's 5..5; nothing else warns)
    assert [w.split(": ")[1][:5] for w in setup.warnings] == (["ngram"] if drafter == "ngram" else [])
    assert speculative_setup(json.dumps(config)) == setup  # JSON text reads the same
    registry.parse_spec(setup.drafter)  # a spec the registry takes


class StopLoad(Exception):
    """Raised where a CLI job would load its model (spy_llm_init)."""


def spy_llm_init(monkeypatch) -> list:
    """LLM.__init__ replaced for the test: each call records the speculative_config it was given
    (in the returned list) and raises StopLoad instead of loading anything."""
    from draftsmith import api

    seen: list = []

    def spy(self, *a, **kw):
        seen.append(kw.get("speculative_config"))
        raise StopLoad

    monkeypatch.setattr(api.LLM, "__init__", spy)
    return seen


def test_a_trained_directory_names_its_kind_and_k(tmp_path, tiny_model_dir):
    target = load_target(str(tiny_model_dir("llama", seed=0)))
    torch.manual_seed(0)
    model = dspark.build(target.model, dspark.DSparkConfig(block_size=3, num_layers=1, rank=8, max_anchors=4))
    ckpt = tmp_path / "my-dspark"
    save_trained_drafter(model, ckpt, target.target_id, target.weights_hash)
    assert speculative_setup({"model": str(ckpt)}).drafter == f"dspark:{ckpt}"
    assert speculative_setup({"model": str(ckpt)}).num_speculative_tokens == 3
    with pytest.raises(DraftsmithError, match=r"method eagle3, but .* holds a dspark drafter; give method dspark"):
        speculative_setup({"method": "eagle3", "model": str(ckpt), "num_speculative_tokens": 3})
    # an HF model directory is not a drafter checkpoint: a draft model, as in vLLM
    plain_dir = str(tiny_model_dir("llama", seed=1))
    assert speculative_setup({"model": plain_dir, "num_speculative_tokens": 2}).drafter == f"draft-model:{plain_dir}"
    # K above the block size drafts no more than the block: lowered, with a word
    big = speculative_setup({"model": str(ckpt), "num_speculative_tokens": 5})
    assert big.num_speculative_tokens == 3 and "above the 3 drafts" in big.warnings[0]
    # a drafter checkpoint that fails its own checks is that error, not a draft model
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "format_version": 999}))
    with pytest.raises(DraftsmithError, match="format_version 999"):
        speculative_setup({"model": str(ckpt), "num_speculative_tokens": 3})


def _vllm_lookup(entries: list[list[int]], cap: int, bs: int) -> int:
    """vLLM's dense lookup written out from its rules: a batch size inside a range takes the
    range's K, one in a gap or past the last range the K of the range before it; capped."""
    best = None
    for lo, hi, k in sorted(entries):
        if lo <= bs:
            best = k
    return min(cap, best)


@pytest.mark.parametrize("entries, cap", [
    ([[1, 1, 5], [2, 6, 3]], 5),
    ([[1, 2, 7], [5, 8, 2], [12, 12, 0], [20, 30, 4]], 5),  # gaps, a K above the cap, K 0
    ([[3, 4, 1], [1, 2, 4]], 4),  # given out of order
    ([[1, 64, 3]], 8),
    ([[1, 2, 1], [3, 8, 9]], 4),  # the last range's K above the cap
])
def test_batch_schedule_is_vllms_lookup(entries, cap):
    schedule = batch_schedule(entries, cap)
    assert isinstance(schedule, BatchSizeSchedule)
    for bs in range(1, 80):
        assert schedule.k_for(bs) == _vllm_lookup(entries, cap, bs), bs
    setup = speculative_setup({"method": "ngram", "num_speculative_tokens": cap,
                               "num_speculative_tokens_per_batch_size": entries})
    assert setup.policy == schedule


@pytest.mark.parametrize("config, needle", [
    ({"methd": "ngram"}, "unknown setting 'methd' (did you mean 'method'?)"),
    ({"method": "ngrm", "num_speculative_tokens": 3}, "unknown method 'ngrm' (did you mean 'ngram'?)"),
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 3}, "EAGLE-3 is (method eagle3)"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "MTP layers"),
    ({"method": "suffix"}, "suffix decoding is not supported"),
    ({}, "needs a method or a model"),
    ({"method": "ngram"}, "method ngram needs num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "method draft_model needs a model"),
    ({"method": "dspark", "num_speculative_tokens": 3}, "method dspark needs a model"),
    ({"method": "ngram", "model": "smollm2-135m", "num_speculative_tokens": 3}, "method ngram takes no model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in 1..64"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer in 1..64"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer in 1..64"),
    ({"method": "ngram", "num_speculative_tokens": 65}, "num_speculative_tokens must be an integer in 1..64"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": True}, "prompt_lookup_max must be"),
    ({"method": "ngram", "num_speculative_tokens": 3, "tensor_parallel_size": 1}, "not a speculative setting"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": True}, "one device"),
    ({"method": "ngram", "num_speculative_tokens": 3, "enable_adaptive_verification": True}, "needs method dspark"),
    ({"model": "mypkg.MyProposer", "num_speculative_tokens": 3}, "proposer class"),
    ({"model": "no/such/dir"}, "is no directory, built-in drafter or built-in target"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 1}, "MTP layers"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min 4 must be <= prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max must be an integer"),
    ({"method": "dspark", "model": "smollm2-135m", "prompt_lookup_max": 3}, "settings of method ngram"),
    ({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}, "exact rejection"),
    ({"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.0}, "lossy"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}, "one device"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 3, "quantization": "fp8"}, "quantization"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 3, "revision": "main"}, "Hub revisions"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 3, "use_heterogeneous_vocab": True},
     "share the target's tokenizer"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_sample_method": "beam"}, "greedy or probabilistic"),
    ({"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[2, 4, 1]]},
     "must start at batch size 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, 1], [3, 6, 2]]},
     "ranges overlap at batch size 3"),
    ({"method": "ngram", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 4, 1, 8, 2]]},
     "by context length"),
    ({"method": "dspark", "model": "smollm2-135m", "num_speculative_tokens_per_batch_size": [[1, 4, 1]],
      "enable_adaptive_verification": True}, "give one"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": 7}, "model must be a non-empty string"),
    ("[1, 2]", "must be a JSON object, got list"),
    ("{'method': 'ngram'}", "not valid JSON"),
])
def test_what_cannot_run_as_written_is_an_error_that_names_it(config, needle):
    with pytest.raises(DraftsmithError) as e:
        speculative_setup(config)
    assert needle in str(e.value), str(e.value)
    assert str(e.value).startswith("speculative config")  # (the CLI flag and the Python argument alike)


def test_settings_of_vllms_gpu_runtime_warn_and_change_nothing():
    base = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    setup = speculative_setup({**base, "enforce_eager": True, "attention_backend": "FLASH_ATTN",
                               "disable_padded_drafter_batch": False, "draft_tensor_parallel_size": 1})
    assert (setup.drafter, setup.num_speculative_tokens) == ("ngram:prompt_lookup_max=3", 4)
    assert [w.split(":")[1].split()[0] for w in setup.warnings] == ["enforce_eager", "attention_backend"]
    assert speculative_setup({**base, "draft_sample_method": "greedy"}).warnings  # drafts are sampled here
    assert not speculative_setup({**base, "draft_sample_method": "probabilistic"}).warnings
    dspark = {"method": "dspark", "model": "smollm2-135m", "enable_adaptive_verification": True}
    assert speculative_setup(dspark).policy == "prefix-scheduler"
    capped = speculative_setup({"method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_max": 3})
    assert capped.num_speculative_tokens == 10 and "above the 10 drafts" in capped.warnings[0]
    assert speculative_setup({"method": "ngram_gpu", "model": "ngram_gpu", "num_speculative_tokens": 3}).drafter == \
        "ngram"


def test_given_twice_is_an_error_and_a_policy_with_settings_stays():
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    assert with_speculative_config(None, "none", None, "auto") == ("none", 5, "auto", ())
    with pytest.raises(DraftsmithError, match=r"must be in 0\.\.64, got 1000000000"):
        with_speculative_config(None, "ngram", 10**9, "auto")  # (it would profile verify forwards that long)
    assert with_speculative_config(None, "ngram", 3, "fixed") == ("ngram", 3, "fixed", ())
    # no K given: a trained drafter's block size (inside lookup: too), as with a speculative config and in bench
    assert with_speculative_config(None, "dspark:smollm2-135m", None, "auto")[1] == 7
    assert with_speculative_config(None, "lookup:dspark:smollm2-135m", None, "auto")[1] == 7
    assert with_speculative_config(None, "ngram", None, "auto")[1] == 5
    ngram = "ngram:prompt_lookup_max=3"
    assert with_speculative_config(cfg, "none", None, "fixed") == (ngram, 4, "fixed", ())
    assert with_speculative_config(cfg, "none", 4, "auto")[:2] == (ngram, 4)  # the same K twice is fine
    with pytest.raises(DraftsmithError, match="a drafter is given twice"):
        with_speculative_config(cfg, "ngram", None, "auto")
    with pytest.raises(DraftsmithError, match="K is given twice: num_speculative_tokens 3"):
        with_speculative_config(cfg, "none", 3, "auto")
    adaptive = {"method": "dspark", "model": "smollm2-135m", "num_speculative_tokens": 4,
                "enable_adaptive_verification": True}
    assert with_speculative_config(adaptive, "none", None, "auto")[2] == "prefix-scheduler"
    assert with_speculative_config(adaptive, "none", None, "prefix-scheduler:min_gain=0.1")[2] == \
        "prefix-scheduler:min_gain=0.1"
    with pytest.raises(DraftsmithError, match="two draft-length policies: 'fixed'"):
        with_speculative_config(adaptive, "none", None, "fixed")
    sched = {**cfg, "num_speculative_tokens_per_batch_size": [[1, 2, 4]]}
    assert isinstance(with_speculative_config(sched, "none", None, "batch-schedule")[2], BatchSizeSchedule)


def test_ngram_spec_takes_vllms_settings_and_other_kinds_refuse_an_argument():
    assert registry.ngram_config("") == NgramConfig()
    assert registry.ngram_config("prompt_lookup_min=2,prompt_lookup_max=4") == NgramConfig(max_ngram=4, min_ngram=2)
    # one alone sets both, as vLLM reads its JSON (so both forms run the same)
    assert registry.ngram_config("prompt_lookup_max=4") == NgramConfig(max_ngram=4, min_ngram=4)
    assert registry.ngram_config("prompt_lookup_min=5") == NgramConfig(max_ngram=5, min_ngram=5)
    for bad, needle in (("ngram:foo", "expected ngram:KEY=N"), ("ngram:prompt_lookup_max=x", "integer >= 1"),
                        ("ngram:prompt_lookup_max=²", "integer >= 1"),
                        ("ngram:prompt_lookup_min=3,prompt_lookup_max=2", "above prompt_lookup_max"),
                        ("ngram:prompt_lookup_min=1,prompt_lookup_min=2", "twice"),
                        ("none:x", "drafter none takes no argument")):
        with pytest.raises(DraftsmithError, match=needle):
            registry.parse_spec(bad)


def test_llm_takes_the_config_and_decodes_as_plain_greedy(tiny_model_dir):
    target = load_target(str(tiny_model_dir("llama", seed=0)))
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    llm = LLM(target, speculative_config=cfg, policy="fixed", max_len=96)
    assert isinstance(llm.drafter, NgramDrafter)
    assert llm.drafter.config == NgramConfig(max_ngram=2, min_ngram=2)
    assert llm.policy.k == 3 and llm.drafter_spec == "ngram:prompt_lookup_max=2"
    plain = LLM(target, max_len=96)
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    assert llm.generate([prompt], p)[0].token_ids == plain.generate([prompt], p)[0].token_ids
    assert llm.last_stats.draft_proposed > 0
    with pytest.raises(DraftsmithError, match="a drafter is given twice"):
        LLM(target, drafter="ngram", speculative_config=cfg)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftsmith.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_and_serve_take_the_flag(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from draftsmith.cli import main

    target = str(tiny_model_dir("llama", seed=0))
    f = tmp_path / "spec.json"
    f.write_text(json.dumps({"method": "ngram", "num_speculative_tokens": 2}))
    assert main(["generate", "--target", target, "--prompt", "ab ab ab", "--max-tokens", "6", "--json",
                 "--speculative-config", str(f)]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert json.loads(line)["drafter"] == "ngram"
    seen = spy_llm_init(monkeypatch)
    text = '{"method": "ngram", "num_speculative_tokens": 4}'
    with pytest.raises(StopLoad):
        main(["serve", "m", "--speculative-config", text])
    assert seen == [text]
    proc = _run("generate", "--target", target, "--prompt", "x", "--speculative-config", '{"method": "eagle"}')
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    assert proc.returncode == 2 and len(lines) == 1 and "EAGLE-3 is (method eagle3)" in lines[0], proc.stderr[-2000:]


def test_get_metrics_reads_as_vllms_offline_metrics(tiny_model_dir):
    """LLM.get_metrics() (draftsmith/metrics.py) as vLLM's speculative-decoding example reads it:
    Counter values by name, the per-position Vector (K entries); cumulative over calls; a prompt
    of n samples counted n times (vLLM's child requests); no spec_decode metrics without a drafter."""
    from draftsmith.metrics import Counter, Gauge, Vector

    target = load_target(str(tiny_model_dir("llama", seed=0)))
    llm = LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, policy="fixed", max_len=96)
    p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    a, b = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9]

    def read():
        out: dict = {}
        for m in llm.get_metrics():
            assert m.labels["model_name"] == target.target_id and m.labels["engine"] == "0"
            if isinstance(m, Vector):
                out[m.name] = m.values
            elif isinstance(m, Counter):
                out[(m.name, m.labels.get("finished_reason"))] = m.value
            else:
                assert isinstance(m, Gauge) and m.value == 0  # nothing runs between calls
        return out

    llm.generate([a], p)
    first, m = llm.last_stats, read()
    accepted = m[("vllm:spec_decode_num_accepted_tokens", None)]
    # every round commits its accepted drafts + 1: the counters agree with the engine's own rounds
    assert m[("vllm:generation_tokens", None)] == 30 == first.rounds + accepted
    assert m[("vllm:spec_decode_num_draft_tokens", None)] == first.draft_proposed > 0
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3  # K entries, as vLLM's Vector
    assert sum(per_pos) == accepted > 0 and per_pos == sorted(per_pos, reverse=True)
    assert per_pos[0] <= m[("vllm:spec_decode_num_drafts", None)] <= first.rounds
    assert m[("vllm:prompt_tokens", None)] == len(a) and m[("vllm:request_success", "length")] == 1
    llm.generate([a, b], SamplingParams(max_tokens=30, temperature=0.8, seed=3, n=2, ignore_eos=True))
    m2 = read()
    assert m2[("vllm:prompt_tokens", None)] == len(a) + 2 * (len(a) + len(b))  # (n = 2: each sample's, as vLLM's)
    assert m2[("vllm:generation_tokens", None)] == 30 * 5 and m2[("vllm:request_success", "length")] == 5
    assert m2[("vllm:spec_decode_num_draft_tokens", None)] == first.draft_proposed + llm.last_stats.draft_proposed
    plain = LLM(target, max_len=96)
    plain.generate([a], p)
    assert not [x for x in plain.get_metrics() if x.name.startswith("vllm:spec_decode")]


def test_a_json_error_names_its_line_and_column():
    """A --speculative-config file spans lines: 'at column 28' (no line) pointed into line 1."""
    text = '{\n  "method": "ngram",\n  "num_speculative_tokens" 5\n}\n'
    with pytest.raises(DraftsmithError, match=r"not valid JSON \(Expecting ':' delimiter at line 3, column 28\)"):
        speculative_setup(text)
