"""User-facing errors.

Anything raised as a `DraftsmithError` is a problem with the user's input or environment
(bad flag, missing file, incompatible checkpoint). Front doors (CLI, server) print or return
its message as one line; no traceback. Bugs stay ordinary exceptions.
"""


class DraftsmithError(Exception):
    """A clear, actionable error: say what was wrong and what to do."""
