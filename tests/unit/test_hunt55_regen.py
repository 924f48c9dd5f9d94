"""Bad input to `draftsmith regen` found by hunt 55: each case was data loss, a traceback or a
run that did nothing useful with exit 0, and is now refused with one line before --out is touched."""

from __future__ import annotations

import json

import pytest

from draftsmith.data.regen_records import scan_output
from draftsmith.errors import DraftsmithError


def test_resume_never_cuts_a_whole_line_that_is_no_record(tmp_path):
    """`regen --resume --out prompts.jsonl` (a one-line prompt file, no regen record in it): its
    complete last line was dropped as "an incomplete last record from a killed run" and the file
    truncated to nothing. Only a last line cut before its newline is a killed run's write."""
    out = tmp_path / "prompts.jsonl"
    out.write_text('{"prompt": "hi"}\n')
    with pytest.raises(DraftsmithError, match=r"prompts\.jsonl:1 is not a regen record"):
        scan_output(out)
    assert out.read_text() == '{"prompt": "hi"}\n'  # untouched
    good = json.dumps({"id": "x0"}) + "\n"
    out.write_text(good + '{"messages": []}\n')
    with pytest.raises(DraftsmithError, match=r"prompts\.jsonl:2 is not a regen record"):
        scan_output(out)
    assert out.read_text() == good + '{"messages": []}\n'
    out.write_text(good + '{"id": "x1", "v')  # a killed run's cut write: still dropped
    assert scan_output(out) == ({"x0": {"id": "x0"}}, len('{"id": "x1", "v'))
    assert out.read_text() == good


@pytest.mark.parametrize("flags", [{"overwrite": True}, {"resume": True}])
def test_out_that_is_the_prompt_file_is_refused(tmp_path, monkeypatch, flags):
    """`regen --mix prompts.jsonl --out prompts.jsonl --overwrite` deleted the user's prompts (read
    first, then replaced by the answers); with --resume their lines were read as records. Refused
    before the target loads (the target here does not exist), the prompts untouched."""
    from draftsmith.data.regen import RegenConfig, run_regen

    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    text = '{"prompt": "hi"}\n{"prompt": "there"}\n'
    prompts.write_text(text)
    for mix, out in (("prompts.jsonl", prompts), ("code:1,prompts.jsonl:2", tmp_path / "." / "prompts.jsonl")):
        cfg = RegenConfig(target="no-such-target", mix=mix, out=out, max_samples=1, **flags)
        with pytest.raises(DraftsmithError, match=r"is the prompt file --mix reads"):
            run_regen(cfg)
        assert prompts.read_text() == text
