"""The explicit catalogue of drafter kinds (no import-time discovery).

A drafter spec is `KIND` or `KIND:ARG`: `none`, `ngram`, `draft-model:PATH_OR_ALIAS`, or a
trained kind with its checkpoint directory: `eagle3:CKPT`, `dflash:CKPT`, `dspark:CKPT`.
"""

from __future__ import annotations

from draftsmith.drafters.base import Drafter, NoDrafter
from draftsmith.errors import DraftsmithError
from draftsmith.models.loading import LoadedTarget

TRAINED_KINDS = ("eagle3", "dflash", "dspark")  # drafters/trained.py CATALOGUE
KINDS = ("none", "ngram", "draft-model", *TRAINED_KINDS)


def build_drafter(spec: str, target: LoadedTarget, max_rows: int, max_len: int) -> Drafter:
    kind, _, arg = spec.partition(":")
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        from draftsmith.drafters.ngram import NgramConfig, NgramDrafter

        return NgramDrafter(NgramConfig())
    if kind == "draft-model":
        if not arg:
            raise DraftsmithError("draft-model needs a path or alias: --drafter draft-model:PATH")
        from draftsmith.drafters.draft_model import DraftModelDrafter
        from draftsmith.models.target import load_target

        draft = load_target(arg, device=str(target.model.device), dtype=str(target.model.dtype).removeprefix("torch."))
        return DraftModelDrafter(draft.model, target.model.config.vocab_size, max_rows, max_len)
    if kind in TRAINED_KINDS:
        if not arg:
            raise DraftsmithError(f"{kind} needs a checkpoint directory: --drafter {kind}:CKPT_DIR")
        from pathlib import Path

        from draftsmith.drafters.trained import load_trained_drafter

        if not (Path(arg) / "config.json").is_file():
            raise DraftsmithError(f"{arg} is not a drafter checkpoint (no config.json); train one with `draftsmith train`")
        import json

        saved_kind = json.loads((Path(arg) / "config.json").read_text()).get("kind")
        if saved_kind != kind:
            raise DraftsmithError(f"checkpoint {arg} is a {saved_kind!r} drafter, not {kind!r}; use --drafter {saved_kind}:{arg}")
        return load_trained_drafter(arg, target, max_rows, max_len)
    raise DraftsmithError(f"unknown drafter {spec!r}; known kinds: {', '.join(KINDS)} (e.g. ngram, draft-model:PATH)")
