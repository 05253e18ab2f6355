"""The plugin's own files, and what happens when one cannot be written.

The memory report, the stats file, the dot files and the KV-reserve record are side channels:
a write that fails (a full disk, a directory that went away, a FIFO or a device where a file
was meant) is counted and logged once per setting, never raised into capture or serving.
Only regular files are written: a FIFO would block the worker in ``open()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections import Counter
from typing import Protocol

logger = logging.getLogger("fd_cudagraph_plugin")


class Ranks(Protocol):
    """Where a process sits in the deployment (``Settings`` is one)."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int


def log_dir() -> str:
    """FastDeploy's log directory (``FD_LOG_DIR``, FastDeploy's default ``log``): where the
    graph-memory record and the dot files go."""
    return os.environ.get("FD_LOG_DIR") or "log"


def output_path(template: str, ranks: Ranks | None) -> str:
    """The file this process writes for FD_CUDAGRAPH_MEMORY_REPORT or FD_CUDAGRAPH_STATS_FILE.

    ``{rank}`` becomes the tensor-parallel rank and ``{dp_rank}`` the data-parallel rank. So that
    no two workers of a deployment write one file, a placeholder the deployment needs (``{rank}``
    when TP > 1, ``{dp_rank}`` when DP > 1) but the template lacks is added before the extension:
    ``graphs.json`` becomes ``graphs.dp1.tp0.json``. A single-GPU deployment keeps the path as
    given; so does a process with no backend yet (``ranks`` None).
    """
    if ranks is None:
        return template.replace("{rank}", "0").replace("{dp_rank}", "0")
    suffix = ""
    if ranks.dp_size > 1 and "{dp_rank}" not in template:
        suffix += f".dp{ranks.dp_rank}"
    if ranks.tp_size > 1 and "{rank}" not in template:
        suffix += f".tp{ranks.tp_rank}"
    path = template.replace("{rank}", str(ranks.tp_rank)).replace("{dp_rank}", str(ranks.dp_rank))
    if suffix:
        head, name = os.path.split(path)
        stem, extension = os.path.splitext(name)
        path = os.path.join(head, f"{stem}{suffix}{extension}")
    return path


def write_file(path: str, text: str, *, append: bool = False) -> None:
    """Write ``text`` to the regular file ``path`` (created with its directory). Raises OSError,
    which the caller counts (``OutputFailures.failed``)."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    _refuse_special(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_APPEND if append else os.O_TRUNC
    descriptor = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # swapped in after the check
            raise OSError(f"{path} is not a regular file")
        with open(descriptor, "w", encoding="utf-8", closefd=False) as handle:
            handle.write(text)
    finally:
        os.close(descriptor)


def replace_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` at once: a unique temporary file beside it (created
    exclusively, so it never follows a link planted there), then a rename over ``path``."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    _refuse_special(path)
    descriptor, temporary = tempfile.mkstemp(
        dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
    )
    try:
        with open(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def read_file(path: str, limit: int, *, tail: bool = False) -> str:
    """At most ``limit`` bytes of the regular file ``path``; OSError when it is longer (with
    ``tail``: its last ``limit`` bytes, from the first whole line), not a regular file, or
    unreadable. Opened without blocking: a FIFO put there never holds the caller."""
    _refuse_special(path)
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(f"{path} is not a regular file")
        cut = tail and status.st_size > limit
        if cut:
            os.lseek(descriptor, status.st_size - limit, os.SEEK_SET)
        data = os.read(descriptor, limit + 1)
    finally:
        os.close(descriptor)
    if cut:
        data = data[:limit].partition(b"\n")[2]
    elif len(data) > limit:
        raise OSError(f"{path} is longer than {limit} bytes")
    return data.decode("utf-8", "replace" if tail else "strict")


def _refuse_special(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OSError(f"{path} is not a regular file (a FIFO, device or directory)")


class OutputFailures:
    """Writes of the plugin's own outputs that failed, by setting: logged once each, counted
    always (``stats()``, the metric ``fd_cudagraph_output_failures``), never raised."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def failed(self, setting: str, path: str, error: BaseException) -> None:
        self.counts[setting] += 1
        if self.counts[setting] == 1:
            logger.warning(
                "%s: cannot write %s (%s: %s); serving goes on without it. Further failures are "
                "counted (metric fd_cudagraph_output_failures_total) without another warning.",
                setting,
                path,
                type(error).__name__,
                error,
            )

    def failed_here(self, key: str, what: str) -> None:
        """In an ``except`` block: log the traceback the first time ``key`` fails, count every
        time."""
        if not self.counts[key]:
            logger.exception("fd-cudagraph %s failed; serving goes on", what)
        self.counts[key] += 1
