"""Bad input to `draftsmith profile` found by hunt 55."""

from __future__ import annotations


def test_a_context_past_the_targets_is_one_line_before_loading(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """profile --context-len 100000 on smollm2-135m (an 8192-token context) timed forwards at
    positions the target never saw, for minutes (killed at 60 s here); the KV error for a larger
    one named --max-len, which profile does not have. Now one line with the largest that fits."""
    from draftsmith.cli import main

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))  # (a profile that ran would be stored there)
    tiny = tiny_model_dir("llama", seed=0)  # max_position_embeddings 256
    capsys.readouterr()  # (the tiny model's writing)
    argv = ["profile", "--target", str(tiny), "--max-batch", "1", "-k", "1", "--repeats", "1", "--threads", "1"]
    assert main([*argv, "--context-len", "200"]) == 2
    assert capsys.readouterr().err == ("draftsmith: error: --context-len 200 leaves no room in the target's 256-token "
                                       "context for the timed forwards (up to 64 tokens after it); give at most 191\n")
    import draftsmith.models.target as target_mod
    from draftsmith.errors import DraftsmithError

    def loading(*a, **k):
        raise DraftsmithError("the target would load now")

    monkeypatch.setattr(target_mod, "load_target", loading)
    assert main([*argv, "--context-len", "191"]) == 2  # the largest that fits passes the check
    assert capsys.readouterr().err == "draftsmith: error: the target would load now\n"
