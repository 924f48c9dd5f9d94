"""The explicit catalogue of drafter kinds (no import-time discovery).

A drafter spec is `KIND` or `KIND:ARG`: `none`, `ngram`, `draft-model:PATH_OR_ALIAS`.
"""

from __future__ import annotations

from draftsmith.drafters.base import Drafter, NoDrafter
from draftsmith.errors import DraftsmithError
from draftsmith.models.loading import LoadedTarget

KINDS = ("none", "ngram", "draft-model")


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
    raise DraftsmithError(f"unknown drafter {spec!r}; known kinds: {', '.join(KINDS)} (e.g. ngram, draft-model:PATH)")
