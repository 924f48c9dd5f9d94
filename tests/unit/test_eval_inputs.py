"""Bad input to `draftsmith calibrate` / `eval`: one clear error, before the target loads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.eval import jobs
from draftsmith.eval.runner import heldout_conversations, heldout_from_regen


@pytest.mark.parametrize("messages", ["hello", [{"role": "user"}], [{"role": "user", "content": [{"text": "hi"}]}],
                                      [{"role": "system", "content": None}, {"role": "user", "content": "hi"}], [3]])
def test_a_heldout_record_with_malformed_messages_is_one_error(tmp_path, messages):
    """A regen record whose messages are not {role, content: text} objects was a KeyError /
    AttributeError traceback (or a TypeError deep in the chat template) in calibrate --data."""
    good = {"id": "a", "split": "heldout", "messages": [{"role": "user", "content": "Say hi."}]}
    data = tmp_path / "held.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps({"id": "b", "split": "heldout", "messages": messages}) + "\n")
    with pytest.raises(DraftsmithError, match=r"held\.jsonl: record 'b': messages must be a list of"):
        heldout_from_regen(data)
    assert [c.user_turns for c in heldout_from_regen(data, max_prompts=1)] == [("Say hi.",)]


def test_calibrate_and_eval_read_their_prompts_before_loading_the_target(tmp_path, monkeypatch):
    """A wrong --data / --tasks was reported only after the target (and the drafter) loaded."""
    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the prompts were read")

    monkeypatch.setattr(jobs, "load_target", no_load)
    with pytest.raises(DraftsmithError, match="does not exist"):
        jobs.run_calibrate(jobs.CalibrateOptions(target="t", drafter=f"dspark:{tmp_path}", data=tmp_path / "no.jsonl"))
    with pytest.raises(DraftsmithError, match="no checkpoint directory"):
        jobs.run_calibrate(jobs.CalibrateOptions(target="t", drafter="dspark:nowhere", data=tmp_path / "no.jsonl"))
    with pytest.raises(DraftsmithError, match="no-such-task"):
        jobs.run_eval(jobs.EvalOptions(target="t", drafters=("ngram",), tasks=("no-such-task",), out=None))


def test_eval_refuses_an_out_that_holds_reports_unless_overwrite(tmp_path, monkeypatch, capsys):
    """eval wrote report.json / report.md over whatever --out held: an earlier eval's, or a bench
    report (eval --out runs/bench replaced bench's report.json), without --overwrite."""
    from draftsmith.cli import main

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(jobs, "load_target", no_load)
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "report.json").write_text("bench's report")
    opt = jobs.EvalOptions(target="t", drafters=("ngram",), tasks=("humaneval",), out=bench)
    with pytest.raises(DraftsmithError, match=r"bench already holds report\.json; give a new --out, or pass --over"):
        jobs.run_eval(opt)
    assert main(["eval", "--drafter", "ngram", "--out", str(bench)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert (bench / "report.json").read_text() == "bench's report"
    with pytest.raises(AssertionError, match="the target was loaded"):  # --overwrite: on to the run
        jobs.run_eval(replace(opt, overwrite=True))  # (an earlier eval's reports are replaced)
    # another job's directory is refused, --overwrite or not: --overwrite deleted a bench's
    # report.json / report.md; a training run or a feature cache was taken as --out
    for name, other, what in (("bench2", ("setup.json", "results.jsonl"), "a bench report"),
                              ("run", ("train_info.json", "model.safetensors"), "a training run"),
                              ("cache", ("manifest.json",), "a feature cache")):
        d = tmp_path / name
        d.mkdir()
        for f in (*other, "report.json", "report.md"):
            (d / f).write_text("theirs")
        for overwrite in (False, True):
            with pytest.raises(DraftsmithError, match=rf"holds {what} \(.*\), another job's output; eval would"):
                jobs.run_eval(replace(opt, out=d, overwrite=overwrite))
        assert main(["eval", "--drafter", "ngram", "--out", str(d), "--overwrite"]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
        assert all((d / f).read_text() == "theirs" for f in (*other, "report.json", "report.md"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")  # files eval does not write are no obstacle
    with pytest.raises(AssertionError, match="the target was loaded"):
        jobs.run_eval(replace(opt, out=tmp_path / "other"))


def test_two_drafters_of_one_name_keep_their_own_rounds(tmp_path, monkeypatch):
    """dspark:runs/a/final and dspark:runs/b/final were both labelled 'dspark:final': the second's
    rounds were written over the first's rounds file, and the report named two drafters alike."""
    from draftsmith.eval.metrics import RoundRecord
    from draftsmith.eval.runner import EvalConversation, LoadedDrafter, RunOutput

    target = SimpleNamespace(target_id="t", weights_hash="h",
                             model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64)))
    monkeypatch.setattr(jobs, "load_target", lambda *a, **k: target)
    monkeypatch.setattr(jobs, "heldout_conversations", lambda *a: [EvalConversation("t", "c", ("hi",))])
    monkeypatch.setattr(jobs, "load_drafter", lambda spec, *a: LoadedDrafter(None, spec, "dspark",
                                                                             Path(spec.split(":")[1]), None))
    monkeypatch.setattr(jobs, "run_rounds", lambda target, loaded, *a, **k: RunOutput(
        [RoundRecord("t", loaded.spec, 2, 2, 1, 2, None)], 1, 2, 0.0))
    specs = ("dspark:runs/a/final", "dspark:runs/b/final")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "rounds-old.jsonl").write_text("an earlier eval's drafter\n")
    report = jobs.run_eval(jobs.EvalOptions(target="t", drafters=specs, tasks=("t",), block_size=2,
                                            out=tmp_path / "eval", overwrite=True))
    assert not (tmp_path / "eval" / "rounds-old.jsonl").exists()  # --overwrite: not left beside this report
    labels = [d["label"] for d in report["drafters"]]
    assert labels == ["dspark:final", "dspark:final (2)"], labels
    for name, spec in (("dspark_final", specs[0]), ("dspark_final_2", specs[1])):
        lines = (tmp_path / "eval" / f"rounds-{name}.jsonl").read_text().splitlines()
        assert [json.loads(line)["request"] for line in lines] == [spec]


def test_calibrate_with_no_round_says_why_not_that_the_head_is_missing(tmp_path, monkeypatch):
    """Every held-out turn skipped (--max-tokens past the context): calibrate said the drafter
    'reports no confidences (no confidence head)', of a DSpark drafter that has one."""
    from draftsmith.eval.runner import LoadedDrafter, RunOutput

    target = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64)))
    monkeypatch.setattr(jobs, "load_target", lambda *a, **k: target)
    monkeypatch.setattr(jobs, "load_drafter", lambda spec, *a: LoadedDrafter(None, spec, "dspark", tmp_path, None))
    skipped = [{"id": "a", "turn": 0, "reason": "prompt of 9 tokens + 5000 new exceeds the context of 2048"}]
    monkeypatch.setattr(jobs, "run_rounds", lambda *a, **k: RunOutput([], 0, 0, 0.0, skipped))
    data = tmp_path / "held.jsonl"
    data.write_text(json.dumps({"id": "a", "split": "heldout", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DraftsmithError, match=r"no verification round ran: 1 held-out turns were skipped \(prompt"):
        jobs.run_calibrate(jobs.CalibrateOptions(target="t", drafter=f"dspark:{tmp_path}", data=data, block_size=2))


def test_calibration_is_written_beside_a_damaged_train_info(tmp_path):
    """A truncated train_info.json (a copied run) was a JSONDecodeError traceback at the very end
    of calibrate, after every round had run, and nothing was stored."""
    from draftsmith.eval import sts

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train_info.json").write_text('{"step": 4')
    path = sts.write_calibration(tmp_path, [1.5], [0.2], [0.1], {"source": "x"}, 10)
    data = json.loads(path.read_text())
    assert data["temperatures"] == [1.5] and "step" not in data["checkpoint"]
    (tmp_path / "train_info.json").write_text('{"step": 40}')
    path = sts.write_calibration(tmp_path, [1.5], [0.2], [0.1], {}, 10)
    assert json.loads(path.read_text())["checkpoint"]["step"] == 40


@pytest.mark.parametrize("tasks", [("humaneval", "humaneval"), ("code", "humaneval"), ("mtbench", "chat")])
def test_tasks_that_name_a_prompt_twice_are_refused(tasks):
    """--tasks humaneval,humaneval (or code,humaneval: code holds humaneval) ran each prompt twice
    under one request id, and the recorder took one copy's committed tokens off the other's: the
    rounds' committed counts and τ came out wrong, without a word."""
    with pytest.raises(DraftsmithError, match=f"--tasks: {tasks[1]} repeats the prompt .* name each source once"):
        heldout_conversations(tasks, 2)
    assert len(heldout_conversations(("humaneval", "mtbench"), 2)) == 4


def test_eval_uses_a_calibration_only_in_the_regime_it_was_fitted_in(monkeypatch):
    """eval's "after STS" applies calibration.json's temperatures where the drafter applied them:
    rounds of the fit's regime. At a temperature of the other regime the drafter served raw
    confidences, so the report cross-fits on the eval rounds and says why (and how to fit them)."""
    from draftsmith.drafters.calibration import STSFit
    from draftsmith.eval.metrics import RoundRecord
    from draftsmith.eval.runner import LoadedDrafter, RunOutput

    recs = [RoundRecord("t", f"r{i}", 2, 2, i % 3 and 1, 1 + (i % 3 and 1), (0.2 + 0.03 * i, 0.5)) for i in range(20)]
    seen = []

    def rounds(target, loaded, convs, gamma, temperature=1.0, **k):
        seen.append(loaded.applied_at(temperature))
        return RunOutput(recs, 20, 40, 1.0)

    monkeypatch.setattr(jobs, "run_rounds", rounds)
    loaded = LoadedDrafter(None, "dspark:x", "dspark", Path("x"), STSFit((2.0, 2.0), greedy=False))
    opt = jobs.EvalOptions(target="t", drafters=("dspark:x",), block_size=2)
    res, _ = jobs.evaluate_drafter(None, loaded, [], opt)
    assert res["calibration"]["source"] == "calibration.json" and res["calibration"]["temperatures"] == [2.0, 2.0]
    res, _ = jobs.evaluate_drafter(None, loaded, [], replace(opt, temperature=0.0))
    src = res["calibration"]["source"]
    assert src.startswith("cross-fitted") and "fit for sampled rounds" in src and "--temperature 0 " in src
    assert seen == [(2.0, 2.0), None]  # what the recording policy unscales with
    unknown = replace(loaded, sts=STSFit((2.0, 2.0)))  # a file without a regime: every row, as before
    res, _ = jobs.evaluate_drafter(None, unknown, [], replace(opt, temperature=0.0))
    assert res["calibration"]["source"] == "calibration.json"
