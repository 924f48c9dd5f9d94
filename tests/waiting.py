"""`wait_until`: the one way tests wait for something to happen (issue 16).

A test never sleeps a fixed time and hopes that a thread, process or server got somewhere by
then: it polls the condition it needs, with a deadline and a message that says what did not
happen. Importable from every test module (tests/ is on sys.path through tests/conftest.py).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.02,
               message: str | Callable[[], str] = "condition not met") -> T:
    """Call `predicate()` every `interval` seconds until it returns something truthy, and return
    that. After `timeout` seconds (the predicate is checked once more at the deadline) fail with
    an AssertionError carrying `message` (a string, or a callable giving one at that moment, to
    show the state that was observed). Exceptions from `predicate` propagate at once."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"{text} (waited {timeout:g}s)")
        time.sleep(interval)
