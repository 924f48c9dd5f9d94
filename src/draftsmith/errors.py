"""User-facing errors.

Anything raised as a `DraftsmithError` is a problem with the user's input or environment
(bad flag, missing file, incompatible checkpoint). Front doors (CLI, server) print or return
its message as one line; no traceback. Bugs stay ordinary exceptions. A `DraftsmithWarning`
is advice about a setting that works but may not pay (the CLI prints it as one
`draftsmith: warning:` line; in Python it is a UserWarning that warnings filters can select).
"""


class DraftsmithError(Exception):
    """A clear, actionable error: say what was wrong and what to do."""


class DraftsmithWarning(UserWarning):
    """A setting that works but may not pay on this machine: say why and what to use instead."""
