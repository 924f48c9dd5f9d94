"""SGLang's speculative flags (engine/sglang_args.py): what each becomes as a speculative config
(drafter, K), a one-line error for what cannot run, a warning for what changes nothing, and the
flags reaching the engine through `generate` and `serve` with outputs equal to plain decoding."""

from __future__ import annotations

import json

import pytest
from test_cli import _one_line_error, _run

from draftsmith import DraftsmithError
from draftsmith.engine.sglang_args import FIELDS, IGNORED, sglang_speculative_config, translate
from draftsmith.engine.speculative_config import speculative_setup

BUILTIN_K = 7  # the built-in dspark:smollm2-135m's block size

E3 = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "DIR"}


@pytest.mark.parametrize("settings, config", [
    # EAGLE3 / STANDALONE: K = num_steps; none of the three: SGLang's auto-choice (3, 1, 4)
    (E3, {"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}),
    ({**E3, "speculative_algorithm": "eagle3"}, {"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}),
    ({**E3, "speculative_num_steps": 5, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 6},
     {"method": "eagle3", "model": "DIR", "num_speculative_tokens": 5}),
    ({**E3, "speculative_num_steps": 4}, {"method": "eagle3", "model": "DIR", "num_speculative_tokens": 4}),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "smollm2-135m"},
     {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 3}),
    # DFLASH: the verify window (num_draft_tokens, or its alias the block size) = K + 1
    ({"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "D", "speculative_num_draft_tokens": 16},
     {"method": "dflash", "model": "D", "num_speculative_tokens": 15}),
    ({"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "D", "speculative_dflash_block_size": 8},
     {"method": "dflash", "model": "D", "num_speculative_tokens": 7}),
    ({"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "D"}, {"method": "dflash", "model": "D"}),
    # DSPARK: gamma = K, num_draft_tokens = gamma + 1; neither: the checkpoint's
    ({"speculative_algorithm": "DSPARK", "speculative_draft_model_path": "D", "speculative_dspark_block_size": 4,
      "speculative_num_draft_tokens": 5}, {"method": "dspark", "model": "D", "num_speculative_tokens": 4}),
    ({"speculative_algorithm": "DSPARK", "speculative_draft_model_path": "D", "speculative_num_draft_tokens": 3},
     {"method": "dspark", "model": "D", "num_speculative_tokens": 2}),
    ({"speculative_algorithm": "DSPARK", "speculative_draft_model_path": "D"}, {"method": "dspark", "model": "D"}),
    # NGRAM: K = num_draft_tokens - 1 (default 12); the old match-window flags are the n-gram sizes
    ({"speculative_algorithm": "NGRAM"},
     {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 11}),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5,
      "speculative_ngram_min_match_window_size": 2, "speculative_ngram_max_match_window_size": 4},
     {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, "num_speculative_tokens": 4}),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_max_match_window_size": 4},
     {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4, "num_speculative_tokens": 11}),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 2},  # (old SGLang's max 12)
     {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 12, "num_speculative_tokens": 11}),
    # --speculative-adaptive lets SGLang take eagle_topk / num_draft_tokens without num_steps (it warns here)
    ({**E3, "speculative_eagle_topk": 1, "speculative_adaptive": True},
     {"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}),
    # exact verification asked for in so many words, the default revision, no quantization
    ({**E3, "speculative_accept_threshold_single": 1.0, "speculative_accept_threshold_acc": 1.0,
      "speculative_use_rejection_sampling": True, "speculative_draft_model_revision": "main",
      "speculative_draft_model_quantization": "unquant"},
     {"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}),
])
def test_sglang_flags_become_a_speculative_config(settings, config):
    t = translate(settings)
    assert t.config == config
    assert [w.split()[0] for w in t.warnings if not w.startswith("--speculative-algorithm NGRAM runs as")] == \
        (["--speculative-adaptive"] if "speculative_adaptive" in settings else [])
    assert translate({**settings, "speculative_token_map": None, "enable_multi_layer_eagle": False}) == t  # not given


@pytest.mark.parametrize("settings, needle", [
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "D"}, "--speculative-algorithm EAGLE3"),
    ({"speculative_algorithm": "NEXTN"}, "MTP layers"),
    ({"speculative_algorithm": "FROZEN_KV_MTP"}, "not supported"),
    ({"speculative_algorithm": "EAGEL3"}, "did you mean EAGLE3?"),
    ({"speculative_num_steps": 3}, "without --speculative-algorithm"),
    ({"speculative_algorithm": "EAGLE3"}, "needs --speculative-draft-model-path"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "D"}, "takes no --speculative-draft-model"),
    ({**E3, "speculative_num_draft_tokens": 6}, "without --speculative-num-steps"),
    ({**E3, "speculative_eagle_topk": 1}, "without --speculative-num-steps"),
    ({**E3, "speculative_num_steps": 0}, "integer >= 1"),
    ({**E3, "speculative_num_steps": 65}, "above Draftsmith's 64"),
    ({**E3, "speculative_accept_threshold_single": 0.5}, "Draftsmith always verifies exactly"),
    ({**E3, "speculative_accept_threshold_acc": 0.3}, "sampled outputs stop following the target"),
    ({**E3, "speculative_draft_model_revision": "v2"}, "not Hub revisions"),
    ({**E3, "speculative_draft_model_quantization": "fp8"}, "quantized"),
    ({"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "D", "speculative_num_draft_tokens": 8,
      "speculative_dflash_block_size": 16}, "they are one number"),
    ({"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "D", "speculative_num_draft_tokens": 1},
     "must be >= 2"),
    ({"speculative_algorithm": "DSPARK", "speculative_draft_model_path": "D", "speculative_num_draft_tokens": 4,
      "speculative_dspark_block_size": 4}, "+ 1 = 5"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5,
      "speculative_ngram_max_match_window_size": 3}, "is above"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_stepz": 3}, "did you mean 'speculative_num_steps'"),
])
def test_what_cannot_run_as_written_is_a_one_line_error(settings, needle):
    with pytest.raises(DraftsmithError) as e:
        translate(settings)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_tree_drafting_runs_the_chain_and_ignored_settings_warn():
    t = translate({**E3, "speculative_num_steps": 5, "speculative_eagle_topk": 8, "speculative_num_draft_tokens": 64})
    assert t.config["num_speculative_tokens"] == 5
    assert len(t.warnings) == 1 and "SGLang drafts a tree (8 candidates a step, 64 draft tokens" in t.warnings[0]
    assert "Outputs are the same" in t.warnings[0]
    corrected = translate({**E3, "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                           "speculative_num_draft_tokens": 8})
    assert corrected.config["num_speculative_tokens"] == 3 and "corrected to" in corrected.warnings[0]
    dflash = translate({"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "D",
                        "speculative_num_steps": 4, "speculative_eagle_topk": 1, "speculative_dspark_block_size": 3})
    assert [w.split()[0] for w in dflash.warnings] == ["--speculative-num-steps", "--speculative-dspark-block-size"]
    values = {k: (True if FIELDS[k].type is None else "x") for k in IGNORED}
    t = translate({"speculative_algorithm": "NGRAM", **values})
    flags = [w.split()[0] for w in t.warnings]
    assert flags[:-1] == [FIELDS[k].flag for k in IGNORED] and all("ignored" in w for w in t.warnings[:-1])
    assert "prompt lookup" in t.warnings[-1]
    assert t.config["num_speculative_tokens"] == 11  # (nothing ignored changes the config)
    # every SGLang name the brief and SGLang's server_args list is a flag here
    for name in ("algorithm", "draft_model_path", "draft_model_revision", "num_steps", "eagle_topk",
                 "num_draft_tokens", "token_map", "accept_threshold_single", "accept_threshold_acc",
                 "attention_mode", "draft_attention_backend", "ngram_max_bfs_breadth", "ngram_max_trie_depth",
                 "ngram_min_match_window_size", "dflash_block_size", "dspark_block_size"):
        assert f"speculative_{name}" in FIELDS, name


def test_the_config_is_checked_against_the_drafter(tmp_path):
    seen: list[str] = []
    spec = {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": "smollm2-135m"}
    config = sglang_speculative_config(spec, warn=seen.append)
    assert config == {"method": "dspark", "model": "smollm2-135m"} and not seen  # (K: the checkpoint's)
    setup = speculative_setup(config)  # what LLM reads: the built-in drafter, no warning of its own
    assert (setup.drafter, setup.num_speculative_tokens, setup.warnings) == ("dspark:smollm2-135m", BUILTIN_K, ())
    capped = sglang_speculative_config(spec, speculative_dspark_block_size=12, warn=seen.append)
    assert capped["num_speculative_tokens"] == BUILTIN_K and "above the 7 drafts" in seen[-1]
    ngram = sglang_speculative_config(speculative_algorithm="NGRAM", speculative_num_draft_tokens=20,
                                      warn=seen.append)
    assert ngram["num_speculative_tokens"] == 10 and "above the 10 drafts" in seen[-1]
    assert speculative_setup(ngram).warnings == ()
    n = len(seen)
    assert sglang_speculative_config(speculative_algorithm="NGRAM", warn=seen.append)["num_speculative_tokens"] == 10
    assert len(seen) == n + 1 and "prompt lookup" in seen[-1]  # (SGLang's default 12 lowered without a word)
    with pytest.raises(DraftsmithError, match="holds a dspark drafter; give --speculative-algorithm DSPARK"):
        sglang_speculative_config({**spec, "speculative_algorithm": "DFLASH"})
    ckpt = tmp_path / "my-dspark"  # a drafter directory given as STANDALONE's draft model
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"kind": "dspark", "block_size": 5}))
    with pytest.raises(DraftsmithError, match="my-dspark holds a dspark drafter; give --speculative-algorithm DSPARK"):
        sglang_speculative_config(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(ckpt),
                                  checkpoint_config=lambda path: {"kind": "dspark", "block_size": 5})
    with pytest.raises(DraftsmithError, match=r"^--speculative-algorithm EAGLE3: drafter eagle3:nope"):
        sglang_speculative_config(speculative_algorithm="EAGLE3", speculative_draft_model_path="nope")


def test_generate_with_sglang_flags_equals_plain_and_conflicts_are_one_line(capsys):
    from draftsmith.cli import main

    def run(*flags: str) -> tuple[dict, str]:
        assert main(["generate", "--prompt", "The capital of France is", "--max-tokens", "6", "--json",
                     *flags]) == 0
        out, err = capsys.readouterr()
        (line,) = [ln for ln in out.splitlines() if ln.startswith("{")]
        return json.loads(line), err

    plain, _ = run()
    spec, err = run("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", "smollm2-135m",
               "--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
               "--speculative-attention-mode", "prefill")
    assert spec["drafter"] == "dspark:smollm2-135m" and spec["stats"]["draft_proposed"] > 0
    assert spec["results"][0]["token_ids"] == plain["results"][0]["token_ids"]
    assert "--speculative-attention-mode has no effect" in err
    _one_line_error(_run("generate", "--prompt", "x", "--speculative-algorithm", "NGRAM",
                         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'),
                    "--speculative-config and SGLang's --speculative-algorithm both say how to speculate")
    _one_line_error(_run("generate", "--prompt", "x", "--speculative-algorithm", "EAGLE3",
                         "--speculative-draft-model-path", "D", "--speculative-accept-threshold-acc", "0.5"),
                    "Draftsmith always verifies exactly")


def test_serve_takes_the_flags_and_refuses_a_second_drafter(monkeypatch):
    from draftsmith.cli import main
    from test_speculative_config import StopLoad, spy_llm_init

    seen = spy_llm_init(monkeypatch)
    with pytest.raises(StopLoad):
        main(["serve", "m", "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "5"])
    assert seen == [{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4}]
    for extra in (["--drafter", "ngram"], ["-k", "3"]):
        assert main(["serve", "m", "--speculative-algorithm", "NGRAM", *extra]) == 2
    assert len(seen) == 1


def test_llm_takes_the_helpers_config_and_decodes_as_plain_greedy(tiny_model_dir):
    from draftsmith import LLM, SamplingParams
    from draftsmith.models.target import load_target

    target = load_target(str(tiny_model_dir("llama", seed=0)))
    cfg = sglang_speculative_config(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                                    speculative_ngram_max_match_window_size=2, warn=lambda w: None)
    llm = LLM(target, speculative_config=cfg, policy="fixed", max_len=96)
    assert llm.drafter_spec == "ngram:prompt_lookup_min=1,prompt_lookup_max=2" and llm.policy.k == 3
    p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    assert llm.generate([prompt], p)[0].token_ids == LLM(target, max_len=96).generate([prompt], p)[0].token_ids
    assert llm.last_stats.draft_proposed > 0
