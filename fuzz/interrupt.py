"""Ctrl-C that a long campaign cannot lose.

CPython runs a Python-level signal handler in whatever frame is current
when the signal is checked. When that frame is a garbage-collector
callback or a ``__del__`` method, the ``KeyboardInterrupt`` the default
handler raises there is printed as "Exception ignored in ..." and dropped,
and the program carries on. Hypothesis installs such a callback (it times
collections: ``hypothesis.internal.conjecture.junkdrawer.gc_cumulative_time``),
and a campaign collects garbage often, so a Ctrl-C during a ``kvspec
fuzz`` run was sometimes lost: the run went on to the end of its budget.

:func:`install` replaces the default SIGINT handler with one that also
records the request; :func:`check`, called once per lockstep step and
between campaign batches, raises ``KeyboardInterrupt`` again while a
request is recorded, wherever the first one went. :func:`clear` forgets
the request once a command has handled it.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

_requested = False
_installed = False


def _handler(signum: int, frame: Any) -> None:
    global _requested
    _requested = True
    raise KeyboardInterrupt


def install() -> bool:
    """Record every SIGINT as well as raising ``KeyboardInterrupt`` (only in
    the main thread, and only over Python's default handler: a handler the
    host program set, pytest's or a user's, is left alone). True when this
    module's handler is in place."""
    global _installed
    if _installed:
        return signal.getsignal(signal.SIGINT) is _handler
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, _handler)
    _installed = True
    return True


def requested() -> bool:
    """True once a SIGINT has arrived and no command has :func:`clear`-ed it."""
    return _requested


def check() -> None:
    """Raise ``KeyboardInterrupt`` when a SIGINT arrived (even one whose own
    ``KeyboardInterrupt`` was swallowed by a finalizer or a gc callback)."""
    if _requested:
        raise KeyboardInterrupt


def clear() -> None:
    """Forget a handled SIGINT (a command printed its partial results)."""
    global _requested
    _requested = False


__all__ = ["check", "clear", "install", "requested"]
