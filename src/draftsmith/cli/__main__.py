"""`python -m draftsmith.cli ...`, the same as `draftsmith ...`."""

import sys

from draftsmith.cli import main

sys.exit(main())
