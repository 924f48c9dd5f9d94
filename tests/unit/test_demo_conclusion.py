"""The demo's closing paragraph is computed from the bench reports, not written in advance."""

from __future__ import annotations

import json

from draftsmith.demo import conclusion


def _report(path, rows):
    path.write_text(json.dumps({"tiers": [
        {"concurrency": 4, "results": [{"label": "ngram", "kind": "engine", "speedup": 9.0}]},
        {"concurrency": 1, "results": rows},
    ]}))
    return path


def test_conclusion_reads_concurrency_one_and_says_when_outputs_differed(tmp_path):
    rows = [{"label": "none", "kind": "engine", "speedup": 1.0},
            {"label": "ngram", "kind": "engine", "speedup": 1.3, "acceptance_rate": 0.4, "void": False},
            {"label": "dspark:runs/x", "kind": "engine", "speedup": 0.8, "acceptance_rate": 0.05, "void": False},
            {"label": "dspark:smollm2-135m", "kind": "engine", "speedup": 1.4, "acceptance_rate": 0.5, "void": False},
            {"label": "lookup:dspark:smollm2-135m", "kind": "engine", "speedup": 1.7, "acceptance_rate": 0.3,
             "void": False},
            {"label": "hf:generate", "kind": "peer", "speedup": 0.5}]
    text = conclusion({"humaneval": _report(tmp_path / "a.json", rows)})
    assert ("humaneval prompts, one request at a time: ngram 1.30× plain (acceptance 0.40); dspark trained here "
            "0.80× plain (acceptance 0.05); built-in dspark 1.40× plain (acceptance 0.50); lookup + built-in dspark "
            "1.70× plain (acceptance 0.30)") in text
    assert "9.00" not in text and "hf" not in text.split("one request at a time")[1].split("\n")[0]
    assert "identical to plain decoding" in text
    rows[2]["void"] = True
    assert "SOME OUTPUTS DIFFERED" in conclusion({"humaneval": _report(tmp_path / "b.json", rows)})


def test_demo_redoes_a_bench_cut_short_and_resumes_the_long_stages(tmp_path, monkeypatch):
    """A bench stage started but not finished is measured again (--overwrite): resuming it could
    only refuse results measured under another setup (an upgrade's new default policy), a dead
    end `make demo` cannot get out of. Regeneration, caching and training resume."""
    from draftsmith import demo

    monkeypatch.setattr(demo, "ROOT", tmp_path)
    calls = []
    monkeypatch.setattr(demo.subprocess, "call", lambda argv: calls.append(argv) or 0)
    by_name = {s.name: s for s in demo.stages()}
    for name in ("bench", "bench-chat", "eval", "regen-train", "train"):
        (tmp_path / f".{name}.started").touch()
        demo.run_stage(by_name[name])
    # (eval too: it refuses a directory that holds an earlier run's reports unless --overwrite)
    assert [c[-1] for c in calls] == ["--overwrite", "--overwrite", "--overwrite", "--resume", "--resume"]
    assert all((tmp_path / f".{n}.done").exists() for n in ("bench", "bench-chat", "eval", "regen-train", "train"))
