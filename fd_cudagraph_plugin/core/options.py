"""Plugin options, read from ``FD_CUDAGRAPH_*`` environment variables.

They are environment variables because FastDeploy keeps only the
``--graph-optimization-config`` keys its own ``GraphOptimizationConfig`` already has; anything else
is dropped without a word. Workers are spawned with the API server's environment, so a variable set
at launch reaches every rank.

Each option is declared once in ``OPTIONS``; the parser and ``fd-cudagraph doctor`` read that
declaration, and tests/test_docs.py checks the README's table against it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.fit import Budget


@dataclass(frozen=True)
class Option:
    env: str
    default: str
    #: Allowed values of an enumerated option; empty for a free-form one (``parse`` checks it).
    choices: tuple[str, ...]
    help: str
    #: For free-form options: turns the text into a value or raises ``ValueError`` with a reason.
    parse: Callable[[str], object] | None = None


#: Longest stats interval: a day. Longer waits overflow the reporter thread's timer.
MAX_INTERVAL_SECONDS = 86400.0
#: Sparsest address-check sampling; anything sparser checks nothing in practice.
MAX_SAMPLING_PERIOD = 1_000_000


#: Shortest stats interval: a faster reporter would take time from serving (at 1e-9 s it did:
#: served steps fell 40%).
MIN_INTERVAL_SECONDS = 1.0


_DECIMAL = re.compile(r"[0-9]{1,9}(\.[0-9]{1,9})?")


def _decimal(text: str, fallback: float) -> float:
    """A number as an operator writes one: ASCII digits, a decimal point. ``float()`` also reads
    Arabic-Indic digits, ``1_000``, ``1e3`` and ``inf``, which nobody means here."""
    return float(text) if _DECIMAL.fullmatch(text) else fallback


def _seconds(text: str) -> float:
    value = _decimal(text, -1.0)
    if not (value == 0 or MIN_INTERVAL_SECONDS <= value <= MAX_INTERVAL_SECONDS):
        raise ValueError(
            f"must be 0 (off) or a number of seconds from {MIN_INTERVAL_SECONDS:.0f} to "
            f"{MAX_INTERVAL_SECONDS:.0f} (a day)"
        )
    return value


def _timeout(text: str) -> float:
    value = _decimal(text, 0.0)
    if not 1 <= value <= MAX_INTERVAL_SECONDS:
        raise ValueError(
            f"must be a number of seconds from 1 to {MAX_INTERVAL_SECONDS:.0f} (a day)"
        )
    return value


_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
#: Largest reserve that can be asked for: 1 TiB, more than any GPU has.
MAX_RESERVE_BYTES = 1 << 40
#: Smallest: less than a KV-cache block reserves nothing (a typo such as 1e-9GiB, one byte).
MIN_RESERVE_BYTES = 1 << 20
_SIZE_FORMS = "off, auto, or a size with its unit such as 2GiB, 512MiB, 1.5GB or 1TiB"


def _reserve(text: str) -> object:
    """``off``, ``auto``, or a size with its unit (``2GiB``, ``512MiB``, ``1.5GB``; bytes only as
    ``B``) -> int. A bare number is refused: ``2`` meant 2 bytes, which nobody means."""
    lowered = text.strip().lower().replace(" ", "")
    if lowered in ("off", "auto"):
        return lowered
    found = re.fullmatch(r"([0-9]{1,15}(?:\.[0-9]{1,9})?)([a-z]*)", lowered)
    if found is None:
        raise ValueError(
            f"must be {_SIZE_FORMS}, its number in ASCII digits with at most one point (no "
            "exponent, sign or underscore, as every number option of the plugin)"
        )
    number, unit = found.groups()
    if not unit:
        raise ValueError(f"a size needs its unit (2GiB, 512MiB; bytes as 2B): {_SIZE_FORMS}")
    if unit not in _UNITS:
        raise ValueError(f"{unit!r} is no unit of {', '.join(_UNITS)}; must be {_SIZE_FORMS}")
    value = float(number) * _UNITS[unit]
    if value > MAX_RESERVE_BYTES:
        raise ValueError(f"must be {_SIZE_FORMS}, at most 1 TiB")
    if value < MIN_RESERVE_BYTES:
        raise ValueError(
            f"{text} is below 1 MiB, less than one KV-cache block: write off for no reserve, or "
            "a size such as 512MiB"
        )
    return int(value)


def describe(env: str, value: object) -> str:
    """How a parsed value reads back, for ``fd-cudagraph doctor``: what the plugin will use."""
    if value is None:
        return "off"
    if env == "FD_CUDAGRAPH_KV_RESERVE" and isinstance(value, int):
        units = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
        unit, scale = next(((u, s) for u, s in units if value >= s), ("B", 1))
        exact = f"{value} byte{'' if value == 1 else 's'}"
        return f"{value / scale:.2f} {unit}, {exact}" if scale > 1 else exact
    if env == "FD_CUDAGRAPH_CHECK_ADDRESSES" and isinstance(value, int):
        return {0: "off", 1: "every replay"}.get(value, f"one replay in {value}")
    if isinstance(value, float):
        return "off" if value == 0 and env == "FD_CUDAGRAPH_STATS_INTERVAL" else f"{value:g} s"
    return str(value)


#: Placeholders of output paths, expanded per process by ``outputs.output_path``.
PATH_PLACEHOLDERS = ("{rank}", "{dp_rank}")


def _path(text: str) -> str:
    """An output file the plugin can create or append to, checked now rather than after capture.

    Checked as rank 0's path: the directory may be missing (it is created at the first write) as
    long as its nearest existing ancestor is a directory ``os.access`` lets us create files in.
    No file is created to find out; ``fd-cudagraph doctor`` creates one where asked.
    Braces are for the placeholders only: ``{foo}`` or a lone ``{rank`` would be written
    literally, never what was meant (a misspelt placeholder), so any other brace is refused.
    """
    rest = text
    for placeholder in PATH_PLACEHOLDERS:
        rest = rest.replace(placeholder, "")
    braces = [i for i, char in enumerate(rest) if char in "{}"]
    if braces:
        # Quote the stray piece: from the brace to the next closing brace or path separator.
        start = braces[0]
        ends = [i for i in (rest.find("}", start), rest.find(os.sep, start)) if i >= start]
        stray = rest[start : min(ends) + 1 if ends else len(rest)].rstrip(os.sep)
        raise ValueError(
            f"{stray!r} is no placeholder: only {' and '.join(PATH_PLACEHOLDERS)} are, and no "
            "other brace may appear in the path"
        )
    path = os.path.expanduser(text)
    probe = rank_zero_path(text)
    if probe.endswith(os.sep):
        raise ValueError(f"{probe} ends with {os.sep}, so it names a directory; name a file")
    probe = os.path.abspath(probe)
    if os.path.isdir(probe):
        raise ValueError(f"{probe} is a directory; name a file in it, e.g. {probe}/out-{{rank}}")
    real = os.path.realpath(probe)
    kernel = [r for r in _KERNEL_FILESYSTEMS if real == r or real.startswith(r + os.sep)]
    if kernel:
        raise ValueError(
            f"{probe} is under {kernel[0]}, the kernel's own files, not a place for a report; "
            "choose a path on a disk"
        )
    if os.path.exists(probe):
        # Never opened here (a FIFO would block). A FIFO or device is refused at each write,
        # counted and logged once (outputs.py): the worker starts and serves.
        mode = os.stat(probe).st_mode
        if not os.access(probe, os.W_OK) or not mode & 0o222:  # root may write read-only files
            raise ValueError(f"{probe} exists and is not writable; choose a writable path")
        return path
    ancestor = os.path.dirname(probe)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{ancestor} is a file, so no directory can be made below it")
    check_lengths(probe, ancestor)
    # No file is created to find out (options are read at every start, by every rank): where
    # os.access is wrong (root on a read-only mount), the first write fails, is counted and
    # logged once, and serving goes on.
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create files in {ancestor}; choose a writable directory")
    return path


class NameTooLong(ValueError):
    """A name, or a whole path, longer than the file system takes: every write would fail."""


def check_lengths(target: str, ancestor: str) -> None:
    """Refuse a name ``target`` still has to make below ``ancestor``, or the whole ``target``,
    longer than the file system of ``ancestor`` takes (Linux's NAME_MAX, PATH_MAX where unsaid)."""
    limits = {"PC_NAME_MAX": 255, "PC_PATH_MAX": 4096}
    for key in limits:
        with contextlib.suppress(OSError, ValueError):
            limits[key] = os.pathconf(ancestor, key)
    name_max, path_max = limits.values()
    names = os.path.relpath(target, ancestor).split(os.sep)
    size, name = max((len(os.fsencode(name)), name) for name in names)
    whole = len(os.fsencode(target))
    if size > name_max or whole >= path_max:
        what, limit, of = (
            (f"the name {name[:16] + '...'!r} is {size}", name_max, "one name (NAME_MAX)")
            if size > name_max
            else (f"the path is {whole}", path_max - 1, "a whole path (PATH_MAX)")
        )
        raise NameTooLong(
            f"{what} bytes, longer than the {limit} bytes this file system takes for {of}; "
            "choose a shorter name"
        )


#: Where the kernel's own files live: writing a report there is never meant (as root it can write
#: a sysctl).
_KERNEL_FILESYSTEMS = ("/proc", "/sys", "/dev")


def rank_zero_path(template: str) -> str:
    """An output path as rank 0 of replica 0 writes it: the placeholders as 0, ``~`` expanded."""
    path = os.path.expanduser(template)
    for placeholder in PATH_PLACEHOLDERS:
        path = path.replace(placeholder, "0")
    return path


#: Options whose value is a path the plugin writes.
PATH_OPTIONS = ("FD_CUDAGRAPH_MEMORY_REPORT", "FD_CUDAGRAPH_STATS_FILE")


def _sampling(text: str) -> int:
    """``off`` -> 0, ``always`` -> 1, ``sampled:N`` -> N (check one replay in N)."""
    text = text.lower()
    if text == "off":
        return 0
    if text == "always":
        return 1
    prefix, _, count = text.partition(":")
    number = _DECIMAL.fullmatch(count) and "." not in count
    if prefix != "sampled" or not number or not 1 <= int(count) <= MAX_SAMPLING_PERIOD:
        raise ValueError(f"must be off, always, or sampled:N with 1 <= N <= {MAX_SAMPLING_PERIOD}")
    return int(count)


OPTIONS: tuple[Option, ...] = (
    Option(
        "FD_CUDAGRAPH_BACKEND",
        "plugin",
        ("plugin", "native"),
        "`native` keeps FastDeploy's own backend without uninstalling the plugin.",
    ),
    Option(
        "FD_CUDAGRAPH_RUNTIME",
        "cuda",
        ("cuda", "simulated"),
        "`simulated` runs graphs on the CPU runtime with CUDA-graph semantics (tests, demo). "
        "Never chosen silently.",
    ),
    Option(
        "FD_CUDAGRAPH_POOL",
        "instance",
        ("instance", "graph"),
        "Graph memory pools: one per backend (FastDeploy's `use_unique_memory_pool=true`), or "
        "Paddle's private pool per graph.",
    ),
    Option(
        "FD_CUDAGRAPH_RANK_TIMEOUT",
        "300",
        (),
        "Seconds a tensor-parallel rank waits at a capture agreement point for the others before "
        "it stops with an error naming the ranks that never came.",
        _timeout,
    ),
    Option(
        "FD_CUDAGRAPH_KV_RESERVE",
        "off",
        (),
        "`off`, `auto` or a size (`2GiB`): take graph memory out of FastDeploy's KV-cache budget "
        "before the cache is sized. `auto` reserves what this plan's graphs took on this rank "
        "last time, or measures a probe capture when there is no record yet.",
        _reserve,
    ),
    Option(
        "FD_CUDAGRAPH_FIT",
        "off",
        (),
        "`off`, `graphs:N` or `padding:P`: at each recapture after a lifecycle call, capture the "
        "subset of FastDeploy's sizes that pads the decode steps served since the last capture "
        "least, with at most N graphs, or with the fewest graphs within P percent more padded "
        "tokens than FastDeploy's list; its largest size always kept. At a start, the same from "
        "what FD_CUDAGRAPH_STATS_FILE recorded of the same plan. Rank 0's traffic decides.",
        Budget.parse,
    ),
    Option(
        "FD_CUDAGRAPH_CHECK_ADDRESSES",
        "off",
        (),
        "`off`, `sampled:N` or `always`: compare graph input addresses on replay.",
        _sampling,
    ),
    Option(
        "FD_CUDAGRAPH_SELF_CHECK",
        "off",
        ("off", "warn", "error"),
        "After each capture, compare a replay with eager; on mismatch serve that size eagerly "
        "(`warn`) or raise (`error`).",
    ),
    Option(
        "FD_CUDAGRAPH_MEMORY_REPORT",
        "",
        (),
        "Path: write the per-size graph-memory table as JSON after each capture session.",
        _path,
    ),
    Option(
        "FD_CUDAGRAPH_STATS_FILE",
        "",
        (),
        "Path: append observed decode token counts (for `fd-cudagraph tune`).",
        _path,
    ),
    Option(
        "FD_CUDAGRAPH_STATS_INTERVAL",
        "0",
        (),
        "Seconds between periodic stats log lines (and stats-file flushes): 0 (off) or 1 to 86400.",
        _seconds,
    ),
    Option(
        "FD_CUDAGRAPH_METRICS",
        "0",
        ("0", "1"),
        "`1` exports Prometheus metrics when `prometheus_client` is importable.",
    ),
    Option(
        "FD_CUDAGRAPH_DUMP_DOT",
        "0",
        ("0", "1"),
        "`1` writes Paddle's dot file of each captured graph under `FD_LOG_DIR`.",
    ),
)

OPTION_PREFIX = "FD_CUDAGRAPH_"
BY_ENV = {option.env: option for option in OPTIONS}

#: Options and values that earlier versions had, with why they went. Setting one is an error, so a
#: deployment that relied on one learns it at start-up instead of silently getting other behaviour.
REMOVED: dict[str, tuple[str, str]] = {
    "FD_CUDAGRAPH_AR_REGISTRATION": (
        "0.2",
        "custom all-reduce buffers are now always registered after each graph, as FastDeploy "
        "does: inside FastDeploy's capture context every eager step all-reduces into empty "
        "buffers, so registering once per session computed garbage and could replay a graph "
        "before its buffers were registered",
    ),
    "FD_CUDAGRAPH_LATE_CAPTURE": (
        "0.2",
        "a size first seen after capture_model() now always runs eagerly: a capture on one "
        "tensor-parallel rank alone hangs the others",
    ),
    "FD_CUDAGRAPH_WARMUP": (
        "0.3",
        "every size now gets FastDeploy's cudagraph_num_of_warmups eager runs right before its "
        "capture. warm_all_first ran all of capture_model() twice; largest_only captured sizes "
        "never run before, and with Paddle's autotune (FLAGS_use_autotune), cuBLASLt global "
        "search or cuDNN exhaustive search a first-seen shape is timed with stream syncs, which "
        "invalidates a capture, and a failed capture is fatal to a Paddle process",
    ),
}

#: Options that earlier versions had and that now do nothing, with why. Setting one is logged at
#: start-up and reported by ``doctor``, never refused: a deployment that set it keeps starting.
_STORE = "the ranks agree through Paddle's job store, which every worker reaches; the plugin"
UNUSED: dict[str, tuple[str, str]] = {
    "FD_CUDAGRAPH_AGREEMENT_INTERFACE": ("0.7", f"{_STORE} listens on no address of its own"),
    "FD_CUDAGRAPH_AGREEMENT_PORTS": ("0.7", f"{_STORE} opens no port of its own"),
}


def unused_options(environ: Mapping[str, str]) -> list[str]:
    """What to say of each option set in ``environ`` that no longer does anything."""
    return [
        f"{env} is no longer used since fd-cudagraph-plugin {version}: {why}. Unset it."
        for env, (version, why) in UNUSED.items()
        if environ.get(env, "").strip()
    ]


#: Values of options that remain, removed with why.
REMOVED_VALUES: dict[tuple[str, str], str] = {
    ("FD_CUDAGRAPH_POOL", "device"): (
        "one pool shared by every backend of the process equals instance wherever it was allowed "
        "(a FastDeploy model has one decorated backbone) and was refused with a draft model, "
        "where a draft replay could overwrite target outputs still in use"
    ),
}


def unknown_options(environ: Mapping[str, str]) -> list[str]:
    """Set ``FD_CUDAGRAPH_*`` variables that are no option, each with the closest known name."""
    import difflib

    known = [option.env for option in OPTIONS]
    # A removed option is no typo: removed_option_error() names it.
    unknown = sorted(
        k
        for k in environ
        if k.startswith(OPTION_PREFIX) and k not in known and k not in REMOVED and k not in UNUSED
    )
    hints = []
    for env in unknown:
        # Compared without the prefix every name shares, which would make any name look close.
        suffixes = [name[len(OPTION_PREFIX) :] for name in known]
        close = difflib.get_close_matches(env[len(OPTION_PREFIX) :], suffixes, n=1, cutoff=0.6)
        hint = f"did you mean {OPTION_PREFIX}{close[0]}?" if close else "no option is close to it"
        hints.append(f"{env} ({hint})")
    return hints


def removed_option_error(environ: Mapping[str, str]) -> ConfigError | None:
    """The error for the first removed option set in ``environ``, or None."""
    for env, (version, why) in REMOVED.items():
        raw = environ.get(env)
        if raw is not None and raw.strip():
            return ConfigError(
                f"{env} was removed in fd-cudagraph-plugin {version}: {why}. Unset {env}."
            )
    for (env, value), why in REMOVED_VALUES.items():
        raw = environ.get(env)
        if raw is not None and raw.strip().lower() == value:
            return ConfigError(
                f"{env}={value} was removed in fd-cudagraph-plugin 0.3: {why}. Unset {env} (the "
                f"default, {BY_ENV[env].default}, is what it gave)."
            )
    return None


def read_option(env: str, environ: Mapping[str, str] | None = None) -> object:
    """Return the validated value of one option; a bad value is a ``ConfigError``."""
    option = BY_ENV[env]
    source = os.environ if environ is None else environ
    raw = source.get(env)
    text = option.default if raw is None or raw.strip() == "" else raw.strip()
    if option.choices:
        value = text.lower()
        if value not in option.choices:
            raise ConfigError(
                f"{env}={raw!r} is not a known value; allowed values are "
                f"{', '.join(option.choices)} (default {option.default}). Fix or unset {env}."
            )
        return value
    if option.parse is None or text == "":
        return text
    try:
        return option.parse(text)
    except ValueError as error:
        raise ConfigError(f"{env}={raw!r}: {error}. Fix or unset {env}.") from None


@dataclass(frozen=True)
class PluginOptions:
    backend: str
    runtime: str
    pool: str
    pool_set: bool
    rank_timeout: float
    kv_reserve: object
    fit: Budget | None
    check_addresses: int
    self_check: str
    memory_report: str
    stats_file: str
    stats_interval: float
    metrics: bool
    dump_dot: bool

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginOptions:
        source = os.environ if environ is None else environ
        removed = removed_option_error(source)
        if removed is not None:
            raise removed

        def get(name: str) -> object:
            return read_option(f"FD_CUDAGRAPH_{name}", source)

        return cls(
            backend=get("BACKEND"),
            runtime=get("RUNTIME"),
            pool=get("POOL"),
            pool_set=bool(source.get("FD_CUDAGRAPH_POOL", "").strip()),
            rank_timeout=get("RANK_TIMEOUT"),
            kv_reserve=get("KV_RESERVE"),
            fit=get("FIT"),
            check_addresses=get("CHECK_ADDRESSES"),
            self_check=get("SELF_CHECK"),
            memory_report=get("MEMORY_REPORT"),
            stats_file=get("STATS_FILE"),
            stats_interval=get("STATS_INTERVAL"),
            metrics=get("METRICS") == "1",
            dump_dot=get("DUMP_DOT") == "1",
        )
