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
