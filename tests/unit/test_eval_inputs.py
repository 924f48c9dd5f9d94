"""Bad input to `draftsmith calibrate` / `eval`: one clear error, before the target loads."""

from __future__ import annotations

import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.eval import jobs
from draftsmith.eval.runner import heldout_from_regen


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
