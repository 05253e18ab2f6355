"""Importing Paddle from a tool, directly or through FastDeploy: once, quietly, interruptibly.

``demo`` imports Paddle, ``doctor`` checks it, and ``plan`` and ``tune`` import an installed
FastDeploy, which imports it. Paddle's import takes most of a second and misbehaves around it:

- its bare ``except:`` clauses (``paddle/base/core.py``) swallow a Ctrl-C, and the import then
  fails with "Error: Can not import paddle core while this file exists", written to stderr, once
  per attempt: an interrupt must not read as a broken install, nor print that;
- it installs a C++ SIGTERM handler that prints a C++ traceback to standard output;
- it warns that ccache is missing, three lines that say nothing about serving.

``watching()`` (the command line wraps every command in it) notes each SIGINT and SIGTERM even where
a library swallowed the exception; ``load()`` imports a module with Paddle's output kept, not
shown, then raises ``PaddleInterrupted`` if a signal came meanwhile, shows what Paddle wrote only
when the import really failed, and never retries a failed import in the same process.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import signal
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import ClassVar


class Terminated(BaseException):
    """SIGTERM arrived: unwind (temporary files are removed on the way) and exit 143."""


class PaddleInterrupted(KeyboardInterrupt):
    """Ctrl-C while Paddle (or FastDeploy, which imports it) was loading."""


class _Watch:
    _RAISES: ClassVar[dict[int, type[BaseException]]] = {
        signal.SIGINT: KeyboardInterrupt,
        signal.SIGTERM: Terminated,
    }

    def __init__(self) -> None:
        self.seen: int | None = None

    def handler(self, signum: int, frame: object) -> None:
        self.seen = signum
        raise self._RAISES[signum]

    def raise_seen(self, loading: bool) -> None:
        if self.seen == signal.SIGINT and loading:
            raise PaddleInterrupted
        if self.seen is not None:
            raise self._RAISES[self.seen]


_WATCH = _Watch()
#: Imports that failed in this process, by module name: the error, raised again without
#: re-running Paddle's import (which would print its error a second time).
_FAILED: dict[str, ImportError] = {}


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Note SIGINT and SIGTERM for this command; outside the main thread, leave signals alone."""
    _WATCH.seen = None
    try:
        previous = {signum: signal.signal(signum, _WATCH.handler) for signum in _WATCH._RAISES}
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def check() -> None:
    """Raise again what a signal raised, so no output claims what did not happen."""
    _WATCH.raise_seen(loading=False)


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """Paddle's and FastDeploy's warnings, log records and prints kept in a buffer: standard
    output (``--json``) holds only the tool's own, standard error only the tool's messages."""
    kept = io.StringIO()
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(kept),
            contextlib.redirect_stderr(kept),
        ):
            warnings.simplefilter("ignore")
            yield kept
    finally:
        logging.disable(previous)


def load(name: str = "paddle") -> ModuleType:
    """``import name`` as above; raises ``ImportError`` (what Paddle wrote said once, on stderr)
    or ``PaddleInterrupted``."""
    if name in _FAILED:
        raise _FAILED[name]
    failure: ImportError | None = None
    with quiet() as kept:
        try:
            module = importlib.import_module(name)
        except KeyboardInterrupt:
            raise PaddleInterrupted from None
        except Exception as error:  # whatever a broken Paddle or FastDeploy raises on import
            failure = error if isinstance(error, ImportError) else ImportError(f"{error}")
            failure.__cause__ = None
    _WATCH.raise_seen(loading=True)
    _take_back_sigterm()
    if failure is not None:
        _FAILED[name] = failure
        said = [line for line in kept.getvalue().splitlines() if line.startswith("Error:")]
        for line in said:
            print(line, file=sys.stderr)
        raise failure
    return module


def _take_back_sigterm() -> None:
    """Paddle's import replaces the SIGTERM handler below Python; put this one back."""
    if signal.getsignal(signal.SIGTERM) == _WATCH.handler:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, _WATCH.handler)
