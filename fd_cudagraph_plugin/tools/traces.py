"""Reading decode workloads for ``fd-cudagraph tune``: plain traces and the plugin's stats files.

A plain trace has one count per line (blank lines and ``#`` comments allowed; ``-`` is standard
input). A stats file (``fd-cudagraph-stats/1``) has one JSON object per line whose counts are
increments since that backend's previous line, so the histogram is the sum over every line,
ranks and backends mixed. Work is bounded whatever the input: counts above what FastDeploy could
ever graph are only tallied, and a line is read at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from fd_cudagraph_plugin.core.errors import CudaGraphPluginError
from fd_cudagraph_plugin.core.observability import STATS_FORMAT
from fd_cudagraph_plugin.tools.capture_rules import DECODE_CAP, MAX_SPECULATIVE_TOKENS, bad_k
from fd_cudagraph_plugin.tools.wording import LIMIT, shown

_HEX_ID = re.compile(r"(0x)?[0-9a-fA-F]+")
_DIGITS = re.compile(r"[0-9]+")
#: FastDeploy keeps sequence lengths in int32 tensors, so no step holds more tokens than this.
TOKEN_LIMIT = 2**31 - 1
#: No graph FastDeploy builds is larger (decode cap 512 requests times k + 1 <= 6 tokens each);
#: counts above it are tallied as eager steps, never kept one by one.
GRAPHED_LIMIT = DECODE_CAP * (MAX_SPECULATIVE_TOKENS + 1)
#: Most steps one stats entry may count: the largest integer every JSON reader keeps exact. A
#: worker serving a million steps a second would take 285 years to count that far.
MAX_STEPS = 2**53 - 1
#: A stats line holds at most a few thousand counts; a longer line is not one of ours.
_MAX_LINE = 1 << 20
#: How much of a file that opens with a multi-line JSON document is read to say what it is.
_MAX_DOCUMENT = 16 << 20
_BOM = b"\xef\xbb\xbf"
#: The plugin's other JSON files, which are no trace but easily passed by mistake.
OTHER_FORMATS = {
    "fd-cudagraph-memory/1": (
        "a graph-memory report (what FD_CUDAGRAPH_MEMORY_REPORT writes after each capture session)"
    ),
}
WANTED = (
    f"tune reads decode traces: one decode token count per line, or the {STATS_FORMAT} JSON "
    "lines FD_CUDAGRAPH_STATS_FILE writes"
)


class TraceError(CudaGraphPluginError, ValueError):
    """A trace or stats file given to ``fd-cudagraph tune`` is unreadable; names file and line."""


class Histogram(Counter):
    """``{count: steps}``: decode tokens, or running requests when ``num_speculative_tokens``.

    Counts above any graph FastDeploy builds are tallied in ``beyond`` (steps) only.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.speculative_methods: set[str] = set()
        self.num_speculative_tokens: int | None = None
        self.beyond = 0
        #: ``"plain"``, ``"decode"`` (stats by tokens) or ``"running"`` lines seen, for mixing.
        self.kinds: set[str] = set()
        #: What the stats lines record of the deployment, and where each was first read
        #: (``file:line``): its decode list as FastDeploy derived it (tokens, descending) and its
        #: ``max_num_seqs``. None where no line records it.
        self.capture_sizes: tuple[int, ...] | None = None
        self.capture_sizes_from = ""
        self.max_num_seqs: int | None = None
        self.max_num_seqs_from = ""
        #: A line recorded ``eager_above_largest``: the steps above the deployed largest size,
        #: which FastDeploy's GraphOptBackend ran eagerly before the plugin's backend saw them
        #: (by count: added to the histogram; as a bare total: ``eager_unknown``).
        self.eager_recorded = False
        self.eager_unknown = 0

    def add(self, count: int, steps: int) -> None:
        if count > GRAPHED_LIMIT:
            self.beyond += steps
        else:
            self[count] += steps


def read_histogram(paths: Iterable[str | Path], stdin: BinaryIO | None = None) -> Histogram:
    """Sum the step counts of every trace or stats file (``-`` is standard input)."""
    histogram = Histogram()
    seen: dict[tuple[int, int], str] = {}
    for path in paths:
        if str(path) == "-":
            if "-" in seen.values():
                raise TraceError("standard input (-) can be given once among the trace files.")
            seen[(-1, -1)] = "-"
            _read_stdin(stdin, histogram)
            continue
        try:
            with open(path, "rb") as handle:
                # The same file twice (by another name, a link) would count its steps twice.
                status = os.fstat(handle.fileno())
                identity = (status.st_dev, status.st_ino)
                if identity in seen:
                    raise TraceError(
                        f"{path} is the same file as {seen[identity]}; give each trace once (its "
                        "steps would be counted twice)."
                    )
                seen[identity] = str(path)
                _read(handle, str(path), histogram)
        except OSError as error:
            raise TraceError(f"cannot read trace file {path}: {error.strerror or error}.") from None
    if "running" in histogram.kinds and histogram.kinds - {"running"}:
        raise TraceError(
            "the traces mix speculative stats (running_request_counts) with decode token counts; "
            "tune one kind at a time (pass only the files of one deployment)."
        )
    return histogram


def _read_stdin(stdin: BinaryIO | None, histogram: Histogram) -> None:
    """``-``: standard input, which may be closed (``<&-``: Python then has no sys.stdin)."""
    if stdin is None:
        if sys.stdin is None:
            raise TraceError(
                "standard input is closed, so - has nothing to read; pass a trace file, or pipe "
                "a trace into fd-cudagraph tune -."
            )
        stdin = sys.stdin.buffer
    try:
        _read(stdin, "<stdin>", histogram)
    except OSError as error:
        raise TraceError(f"cannot read standard input: {error.strerror or error}.") from None


def _lines(handle: BinaryIO) -> Iterator[bytes]:
    while True:
        raw = handle.readline(_MAX_LINE)
        if not raw:
            return
        yield raw


def _read(handle: BinaryIO, name: str, histogram: Histogram) -> None:
    for lineno, raw in enumerate(_lines(handle), 1):
        where = f"{name}:{lineno}"
        if lineno == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        if len(raw) == _MAX_LINE and not raw.endswith(b"\n"):
            raise TraceError(f"{where}: line longer than {_MAX_LINE} bytes; not a trace line.")
        stripped = raw.strip()
        if lineno == 1 and stripped.startswith(b"{"):
            _refuse_document(stripped, handle, name)
        # The common line, a bare count, skips decoding and the regular expressions.
        if stripped.isdigit():
            histogram.kinds.add("plain")
            histogram.add(_parse_count(stripped, where), 1)
            continue
        try:
            text = stripped.decode("utf-8")
        except UnicodeDecodeError as error:
            raise TraceError(
                f"{where}: not UTF-8 text ({error.reason} at byte {error.start + 1} of the "
                "line); a trace is one decode token count per line or fd-cudagraph-stats/1 "
                "JSON lines."
            ) from None
        _add_line(histogram, text, where)


def _parse_count(digits: bytes | str, where: str) -> int:
    """A count of at most ``TOKEN_LIMIT``; longer digit strings never reach ``int()``."""
    significant = digits.lstrip(b"0" if isinstance(digits, bytes) else "0")
    value = int(significant) if significant and len(significant) <= 10 else 0
    if value > TOKEN_LIMIT or len(significant) > 10:
        shown = significant[:24].decode() if isinstance(significant, bytes) else significant[:24]
        raise TraceError(
            f"{where}: {shown}{'...' if len(significant) > 24 else ''} is above {TOKEN_LIMIT}, "
            "the most tokens a FastDeploy step can hold (int32 sequence lengths); not a decode "
            "token count."
        )
    return value


def _add_line(histogram: Histogram, text: str, where: str) -> None:
    if not text or text.startswith("#"):
        return
    if text.startswith("{"):
        _add_stats(text, where, histogram)
        return
    value = text.split("#", 1)[0].strip()
    if not _DIGITS.fullmatch(value):
        raise TraceError(
            f"{where}: expected a decode token count (an integer >= 0) or an {STATS_FORMAT} JSON "
            f"line; got {text[:80]!r}."
        )
    histogram.kinds.add("plain")
    histogram.add(_parse_count(value, where), 1)


def _refuse_document(first: bytes, handle: BinaryIO, name: str) -> None:
    """A file whose first line opens a JSON object that does not close there is one JSON
    document over several lines (a memory report, ``plan --json``), not stats lines: say what it
    is rather than that its first line is not valid JSON."""
    try:
        json.loads(first)
        return  # one complete object on the line: a stats line, checked as such
    except (ValueError, RecursionError):
        pass
    text = first + handle.read(_MAX_DOCUMENT)
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        return  # not one document either: the line's own error says what is wrong
    what = "one JSON document over several lines"
    if isinstance(document, dict):
        fmt = document.get("format")
        what = OTHER_FORMATS.get(fmt, f"{what} ({_format_text(fmt)})")
    raise TraceError(f"{name} is {what}, not a trace; {WANTED}.")


def _format_text(fmt: object) -> str:
    return 'no "format" key' if fmt is None else f'"format" is {str(fmt)[:40]!r}'


def _add_stats(text: str, where: str, histogram: Histogram) -> None:
    """Validate one stats line and add its increments."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        # json's messages end in "starting at" or "delimiter" before the position it appends.
        message = error.msg.removesuffix(" at")
        raise TraceError(
            f"{where}: not valid JSON ({message} at column {error.colno}); each stats line is "
            f"one {STATS_FORMAT} object."
        ) from None
    except (ValueError, RecursionError) as error:  # a 5000-digit number, nesting too deep
        raise TraceError(f"{where}: not a {STATS_FORMAT} line ({error}).") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object; got {type(record).__name__}.")
    fmt = record.get("format")
    if fmt in OTHER_FORMATS:
        raise TraceError(f"{where}: this is {OTHER_FORMATS[fmt]}, not a trace; {WANTED}.")
    if fmt != STATS_FORMAT:
        raise TraceError(f'{where}: {_format_text(fmt)}; this tool reads "{STATS_FORMAT}" lines.')
    running = "running_request_counts" in record
    key = "running_request_counts" if running else "decode_token_counts"
    missing = [k for k in ("time", "rank", "backend", key) if k not in record]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(map(repr, missing))} in the stats line.")
    time, rank, backend = record["time"], record["rank"], record["backend"]
    if isinstance(time, bool) or not isinstance(time, (int, float)) or not math.isfinite(time):
        raise TraceError(f'{where}: "time" must be a unix time in seconds; got {shown(time)}.')
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise TraceError(f'{where}: "rank" must be an integer >= 0; got {shown(rank)}.')
    if not isinstance(backend, str) or not _HEX_ID.fullmatch(backend):
        raise TraceError(
            f'{where}: "backend" must be a hex id such as "7f3a2c"; got {shown(backend)}.'
        )
    if running:
        k = record.get("num_speculative_tokens")
        if bad_k(k):
            raise TraceError(
                f'{where}: "num_speculative_tokens" must be an integer in '
                f"1..{MAX_SPECULATIVE_TOKENS} (FastDeploy's range) next to running_request_counts; "
                f"got {shown(k)}."
            )
        if histogram.num_speculative_tokens not in (None, k):
            raise TraceError(
                f'{where}: "num_speculative_tokens" is {k}, earlier lines say '
                f"{histogram.num_speculative_tokens}; tune the stats of one deployment at a time."
            )
        histogram.num_speculative_tokens = k
    counts = record[key]
    if not isinstance(counts, dict):
        raise TraceError(f'{where}: "{key}" must be an object; got {str(counts)[:80]}.')
    parsed: list[tuple[int, int]] = []
    for count, steps in counts.items():
        if not _DIGITS.fullmatch(count):
            what = "request" if running else "token"
            raise TraceError(f'{where}: "{key}" key {count[:40]!r} is not a {what} count.')
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_STEPS:
            entry = repr(count) if len(count) <= LIMIT else shown(count)
            raise TraceError(
                f'{where}: "{key}"[{entry}] must be a step count in 0..{MAX_STEPS}; got '
                f"{shown(steps)}."
            )
        parsed.append((_parse_count(count, where), steps))
    eager, unknown = _eager_above_largest(record, where, running)
    _add_deployment(record, where, histogram)
    histogram.kinds.add("running" if running else "decode")
    for count, steps in [*parsed, *eager]:
        histogram.add(count, steps)
    if "eager_above_largest" in record:
        histogram.eager_recorded = True
        histogram.eager_unknown += unknown
    method = record.get("speculative_method")
    if method:
        histogram.speculative_methods.add(str(method)[:40])


def _eager_above_largest(
    record: dict, where: str, running: bool
) -> tuple[list[tuple[int, int]], int]:
    """``eager_above_largest`` (written from 0.6.0): the steps above the largest captured size
    since the line before, by count in the line's unit (``{"300": 2}``), or as a bare total
    when the counts were not kept. Absent in older stats: ``([], 0)``."""
    if "eager_above_largest" not in record:
        return [], 0
    value = record["eager_above_largest"]
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEPS:
        return [], value
    if not isinstance(value, dict):
        raise TraceError(
            f'{where}: "eager_above_largest" must be a step count or an object of counts to '
            f"steps; got {shown(value)}."
        )
    what = "request" if running else "token"
    parsed = []
    for count, steps in value.items():
        if not _DIGITS.fullmatch(count):
            raise TraceError(
                f'{where}: "eager_above_largest" key {count[:40]!r} is not a {what} count.'
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_STEPS:
            raise TraceError(
                f'{where}: "eager_above_largest"[{count!r}] must be a step count in '
                f"0..{MAX_STEPS}; got {shown(steps)}."
            )
        parsed.append((_parse_count(count, where), steps))
    return parsed, 0


def _add_deployment(record: dict, where: str, histogram: Histogram) -> None:
    """``capture_sizes`` and ``max_num_seqs`` of a stats line, where it records them: checked,
    and the same on every line (else the files are of several deployments)."""
    if "capture_sizes" in record:
        sizes = record["capture_sizes"]
        if (
            not isinstance(sizes, list)
            or not 0 < len(sizes) <= 4 * DECODE_CAP
            or any(isinstance(n, bool) or not isinstance(n, int) for n in sizes)
            or any(not 0 < n <= TOKEN_LIMIT for n in sizes)
        ):
            raise TraceError(
                f'{where}: "capture_sizes" must be a list of decode sizes in 1..{TOKEN_LIMIT}; got '
                f"{shown(sizes)}."
            )
        sizes = tuple(sorted(set(sizes), reverse=True))
        if histogram.capture_sizes not in (None, sizes):
            raise TraceError(
                f'{where}: "capture_sizes" differs from {histogram.capture_sizes_from}\'s; '
                "tune the stats of one deployment at a time."
            )
        if histogram.capture_sizes is None:
            histogram.capture_sizes, histogram.capture_sizes_from = sizes, where
    if "max_num_seqs" in record:
        seqs = record["max_num_seqs"]
        if isinstance(seqs, bool) or not isinstance(seqs, int) or not 0 < seqs <= TOKEN_LIMIT:
            raise TraceError(f'{where}: "max_num_seqs" must be an integer >= 1; got {shown(seqs)}.')
        if histogram.max_num_seqs not in (None, seqs):
            raise TraceError(
                f'{where}: "max_num_seqs" is {seqs}, {histogram.max_num_seqs_from} says '
                f"{histogram.max_num_seqs}; tune the stats of one deployment at a time."
            )
        if histogram.max_num_seqs is None:
            histogram.max_num_seqs, histogram.max_num_seqs_from = seqs, where
