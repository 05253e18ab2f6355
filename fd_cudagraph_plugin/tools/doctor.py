"""``fd-cudagraph doctor``: will FastDeploy serve with this plugin here? One line per check.

Each check is a small function of the environment and of the checks before it that returns a
``CheckResult``; ``CHECKS`` lists them in the order a start-up goes through them. FAIL means
FastDeploy will not serve with the plugin (the command exits 1); WARN means it will, with a caveat
worth knowing; SKIP means the check could not run because of a line above, which says the one
cause once (a CPU build of Paddle is one FAIL, not three).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from fd_cudagraph_plugin import __version__
from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.options import (
    OPTION_PREFIX,
    OPTIONS,
    PATH_OPTIONS,
    UNUSED,
    NameTooLong,
    check_lengths,
    describe,
    rank_zero_path,
    read_option,
    removed_option_error,
    unknown_options,
    unused_options,
)
from fd_cudagraph_plugin.core.seam import BACKEND_MODULE as _BACKEND_MODULE
from fd_cudagraph_plugin.core.seam import BACKEND_NAME as _NAME
from fd_cudagraph_plugin.core.seam import constructor_shape, cuda_runtime_blocker
from fd_cudagraph_plugin.core.seam import version as fastdeploy_version
from fd_cudagraph_plugin.plugin import ENTRY_POINT_GROUP, ENTRY_POINT_NAME
from fd_cudagraph_plugin.tools import paddle_import
from fd_cudagraph_plugin.tools.wording import shown

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
#: The ``format`` of ``doctor --json``; a change that drops or renames a key bumps it.
DOCTOR_FORMAT = "fd-cudagraph-doctor/1"
DISTRIBUTION = "fd-cudagraph-plugin"
#: The plugin is not on PyPI, and a name there could be anyone's: install what you have.
CHECKOUT = "/path/to/fd-cudagraph-plugin"
WHEEL = f"dist/fd_cudagraph_plugin-{__version__}-py3-none-any.whl"
INSTALL = (
    f"install it from a checkout (pip install {CHECKOUT}) or a wheel built from one "
    f"(pip wheel --no-deps -w dist {CHECKOUT}, then pip install {WHEEL})"
)
#: Constructor shapes of FastDeploy's backend this plugin serves: 2.5, 2.6, develop; and 2.4.
KNOWN_SHAPES = ("(fd_config, dy_runnable, runnable)", "(fd_config, runnable)")


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f" Fix: {self.fix}" if self.fix else ""
        return f"{self.status:<4}  {self.name}: {self.detail}{fix}"


EntryPoints = Callable[..., Iterable[importlib.metadata.EntryPoint]]


def check_entry_point(
    environ: Mapping[str, str],
    earlier: Mapping[str, CheckResult] | None = None,
    *,
    entry_points: EntryPoints = importlib.metadata.entry_points,
) -> CheckResult:
    """The entry point FastDeploy's plugin loader looks for is installed and loads."""
    name = "entry point"
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    if not found:
        return CheckResult(
            name,
            FAIL,
            f"no entry point {ENTRY_POINT_NAME!r} in group {ENTRY_POINT_GROUP}, so FastDeploy "
            "cannot find the plugin.",
            f"{INSTALL} in the Python environment that runs FastDeploy; it is not on PyPI.",
        )
    ep = found[0]
    try:
        ep.load()
    except Exception as error:  # whatever the import raised, FastDeploy would log and skip it
        return CheckResult(
            name,
            FAIL,
            f"{ep.name} = {ep.value} is installed but does not load: "
            f"{type(error).__name__}: {error}. FastDeploy logs this and serves without the plugin.",
            f"reinstall from the checkout or wheel: pip install --force-reinstall {CHECKOUT}.",
        )
    detail = f"{ep.name} = {ep.value} in {ENTRY_POINT_GROUP}, loads."
    if len(found) > 1:
        values = ", ".join(sorted({e.value for e in found}))
        return CheckResult(
            name,
            WARN,
            f"{detail} It is installed {len(found)} times ({values}); FastDeploy loads each.",
            f"pip uninstall {DISTRIBUTION} until none is left, then {INSTALL} once.",
        )
    return CheckResult(name, OK, detail)


def check_fd_plugins(
    environ: Mapping[str, str], earlier: Mapping[str, CheckResult] | None = None
) -> CheckResult:
    """``FD_PLUGINS`` names the entry point, exactly as FastDeploy compares it."""
    name = "FD_PLUGINS"
    fix = (
        f"export FD_PLUGINS={ENTRY_POINT_NAME} (comma-separate other plugins) before launching "
        "the API server; workers inherit it."
    )
    raw = environ.get("FD_PLUGINS")
    if raw is None:
        return CheckResult(
            name,
            FAIL,
            "unset: since FastDeploy PR #4909 an unset FD_PLUGINS loads no plugin at all.",
            fix,
        )
    # FastDeploy splits on commas and compares each piece with the entry-point name as is.
    names = raw.split(",")
    if ENTRY_POINT_NAME in names:
        return CheckResult(name, OK, f"{raw!r} names {ENTRY_POINT_NAME}.")
    if any(piece.strip() == ENTRY_POINT_NAME for piece in names):
        return CheckResult(
            name,
            FAIL,
            f"{raw!r} has spaces around {ENTRY_POINT_NAME}; FastDeploy splits on commas without "
            "stripping, so the name does not match.",
            fix,
        )
    if any(piece.strip() in (DISTRIBUTION, "fd_cudagraph-plugin") for piece in names):
        return CheckResult(
            name,
            FAIL,
            f"{raw!r} names the distribution {DISTRIBUTION}; FastDeploy matches the entry-point "
            f"name {ENTRY_POINT_NAME}.",
            fix,
        )
    return CheckResult(name, FAIL, f"{raw!r} does not name {ENTRY_POINT_NAME}.", fix)


Earlier = Mapping[str, CheckResult]


def _skipped(name: str, earlier: Earlier | None, *causes: str) -> CheckResult | None:
    """SKIP when a check this one needs failed: its line says the cause, this one points to it."""
    for cause in causes:
        found = (earlier or {}).get(cause)
        if found is not None and found.status in (FAIL, SKIP):
            return CheckResult(name, SKIP, f"not checked: see the {cause} line.")
    return None


def check_paddle(environ: Mapping[str, str], earlier: Earlier | None = None) -> CheckResult:
    """Paddle imports, and is a CUDA build (a CPU build serves no CUDA graphs at all)."""
    name = "Paddle"
    try:
        paddle = paddle_import.load("paddle")
    except ImportError as error:
        return CheckResult(
            name,
            FAIL,
            f"cannot import paddle: {error}.",
            "install paddlepaddle-gpu from Paddle's own index, matching your CUDA version.",
        )
    version = getattr(paddle, "__version__", "unknown")
    if paddle.is_compiled_with_cuda():
        return CheckResult(name, OK, f"paddle {version}, compiled with CUDA.")
    if _native(environ):
        return CheckResult(
            name, OK, f"paddle {version}, without CUDA: {NATIVE_NOTE} and needs none."
        )
    if _accelerator() is not None:
        return CheckResult(
            name, OK, f"paddle {version}, a build for {_accelerator()} (see the platform line)."
        )
    return CheckResult(
        name,
        FAIL,
        f"paddle {version} is a CPU build (not compiled with CUDA): FastDeploy serves no CUDA "
        "graphs with it, and register() stands the plugin aside.",
        "on the GPU machine that serves, install paddlepaddle-gpu (not the CPU wheel "
        "paddlepaddle) and run fd-cudagraph doctor there.",
    )


def _accelerator() -> str | None:
    """The name of FastDeploy's platform where it is an accelerator other than NVIDIA CUDA (XPU,
    MetaX, ...), on which FastDeploy serves with its own backend; None otherwise."""
    blocker = _blocker()
    if blocker is None or "platform is" not in blocker or "platform is CPU" in blocker:
        return None
    return blocker.split("platform is ", 1)[1].split(",")[0]


def _blocker() -> str | None:
    try:
        with paddle_import.quiet():  # it imports FastDeploy's platforms: its log lines are not ours
            return cuda_runtime_blocker()
    except Exception as error:  # a FastDeploy platform object that fails: register() would too
        return f"cannot tell the platform: {type(error).__name__}: {error}"


def check_fastdeploy(environ: Mapping[str, str], earlier: Earlier | None = None) -> CheckResult:
    """FastDeploy's backend module imports and has a backend class of a known constructor shape."""
    name = "FastDeploy"
    install = (
        "install PaddlePaddle FastDeploy 2.4 or later (fastdeploy-gpu; the PyPI project named "
        "fastdeploy is unrelated) in this environment."
    )
    try:
        missing = importlib.util.find_spec("fastdeploy") is None
    except (ImportError, ValueError):
        missing = True
    if missing:
        return CheckResult(name, FAIL, "fastdeploy is not installed here.", install)
    paddle = (earlier or {}).get("Paddle")
    if paddle is not None and paddle.detail.startswith("cannot import"):
        return CheckResult(
            name, SKIP, "installed; not imported: it needs Paddle (see the Paddle line)."
        )
    try:
        paddle_import.load("fastdeploy")
        module = importlib.import_module(_BACKEND_MODULE)
    except Exception as error:  # ImportError, or whatever FastDeploy's own imports raise
        return CheckResult(
            name,
            FAIL,
            f"cannot import {_BACKEND_MODULE}: {type(error).__name__}: {error}.",
            install,
        )
    native = getattr(module, _NAME, None)
    if getattr(native, "__module__", "").startswith("fd_cudagraph_plugin"):
        native = getattr(module, "_fd_cudagraph_native_backend", None)  # register() already ran
    version = fastdeploy_version()
    if native is None:
        return CheckResult(
            name,
            FAIL,
            f"FastDeploy {version} has no {_NAME} in {_BACKEND_MODULE}, the name the plugin "
            "rebinds.",
            "use FastDeploy 2.4 .. 2.6 or develop.",
        )
    shape = constructor_shape(native)
    detail = f"FastDeploy {version} imports; its {_NAME} is built as {shape}"
    if shape not in KNOWN_SHAPES:
        return CheckResult(
            name,
            WARN,
            f"{detail}, which this plugin was not written for (known: {', '.join(KNOWN_SHAPES)}).",
            "use FastDeploy 2.4 .. 2.6 or develop, or FD_CUDAGRAPH_BACKEND=native.",
        )
    release = "2.5 or later" if "dy_runnable" in shape else "2.4"
    return CheckResult(name, OK, f"{detail} ({release}).")


def _option_is(env: str, value: str, environ: Mapping[str, str]) -> bool:
    try:
        return read_option(env, environ) == value
    except ConfigError:
        return False  # reported by check_options


def _native(environ: Mapping[str, str]) -> bool:
    return _option_is("FD_CUDAGRAPH_BACKEND", "native", environ)


#: What the Paddle and CUDA-graph checks say when the plugin's runtime will not run.
NATIVE_NOTE = (
    "FD_CUDAGRAPH_BACKEND=native keeps FastDeploy's own backend, so the plugin's CUDA runtime "
    "is not used"
)


def check_cuda_graphs(environ: Mapping[str, str], earlier: Earlier | None = None) -> CheckResult:
    """Paddle reports CUDA graphs as supported on this build and device."""
    name = "CUDA graphs"
    if _native(environ):
        return CheckResult(name, OK, f"not checked: {NATIVE_NOTE}.")
    skipped = _skipped(name, earlier, "Paddle")
    if skipped is not None:
        return skipped
    if _accelerator() is not None:
        return CheckResult(name, SKIP, "not checked: no CUDA here (see the platform line).")
    try:
        from fd_cudagraph_plugin.core.runtime.cuda import cuda_graph_support

        supported = cuda_graph_support()
    except Exception as error:
        return CheckResult(
            name,
            FAIL,
            f"cannot import paddle.device.cuda.graphs: {type(error).__name__}: {error}.",
            "install paddlepaddle-gpu.",
        )
    if supported is None:
        return CheckResult(
            name, OK, "this Paddle has no is_cuda_graph_supported(); capture will tell."
        )
    if supported:
        return CheckResult(name, OK, "paddle.device.cuda.graphs.is_cuda_graph_supported() is True.")
    return CheckResult(
        name,
        FAIL,
        "paddle.device.cuda.graphs.is_cuda_graph_supported() is False on this build.",
        "install paddlepaddle-gpu (CUDA 11+), or serve without CUDA graphs "
        "(--graph-optimization-config '{\"use_cudagraph\": false}').",
    )


def check_platform(environ: Mapping[str, str], earlier: Earlier | None = None) -> CheckResult:
    """Whether ``register()`` installs the plugin's backend here or stands aside, as it logs."""
    name = "platform"
    if _native(environ):
        return CheckResult(name, OK, f"not checked: {NATIVE_NOTE}.")
    skipped = _skipped(name, earlier, "Paddle", "FastDeploy")
    if skipped is not None:
        return skipped
    blocker = _blocker()
    if blocker is None:
        return CheckResult(
            name, OK, "NVIDIA CUDA with a CUDA build of Paddle: register() installs the plugin."
        )
    accelerator = _accelerator()
    if accelerator is not None:
        # By design, not a fault: FastDeploy serves there with its own backend and runners.
        return CheckResult(
            name,
            WARN,
            f"fd-cudagraph-plugin {__version__} stands aside here: {blocker}, and its CUDA "
            "runtime drives NVIDIA CUDA graphs only. register() logs this, and FastDeploy serves "
            f"with its own CUDA-graph backend and runners on {accelerator}.",
        )
    return CheckResult(
        name,
        FAIL,
        f"fd-cudagraph-plugin {__version__} stands aside here: {blocker}; register() logs this "
        "and FastDeploy keeps its own backend.",
        "serve on NVIDIA CUDA with paddlepaddle-gpu and FastDeploy's CUDA platform.",
    )


def _metrics_missing(values: Mapping[str, object]) -> bool:
    if values.get("FD_CUDAGRAPH_METRICS") != "1":
        return False
    try:
        importlib.import_module("prometheus_client")
    except Exception:
        return True
    return False


#: Why the simulated runtime is refused for serving, and what to do.
SIMULATED = (
    "FD_CUDAGRAPH_RUNTIME=simulated runs graphs on a CPU runtime, for the tests and the demo: a "
    "server started with it captures no CUDA graph on the GPU"
)


def check_options(environ: Mapping[str, str], earlier: Earlier | None = None) -> CheckResult:
    """Every ``FD_CUDAGRAPH_*`` option has a value the plugin accepts, and one to serve with.

    An invalid one makes ``register()`` raise in every FastDeploy process, which stops start-up;
    the simulated runtime starts, and serves without CUDA graphs.
    """
    name = "options"
    removed = removed_option_error(environ)
    values, errors = {}, [str(removed)] if removed else []
    for option in OPTIONS:
        if removed is not None and f"{option.env}=" in str(removed).split(" was removed")[0]:
            continue  # one message for a removed value, not also "not a known value"
        try:
            values[option.env] = read_option(option.env, environ)
        except ConfigError as error:
            errors.append(str(error))
    fixes = []
    if values.get("FD_CUDAGRAPH_RUNTIME") == "simulated":
        errors.append(f"{SIMULATED}.")
        fixes.append(
            "run unset FD_CUDAGRAPH_RUNTIME (or remove it from the server's environment) before "
            "starting the server, to serve with CUDA graphs."
        )
    if errors:
        return CheckResult(name, FAIL, " ".join(errors), " ".join(fixes))
    set_here = [o.env for o in OPTIONS if environ.get(o.env, "").strip()]
    defaults = len(OPTIONS) - len(set_here)
    detail = ", ".join(_as_read(env, environ[env].strip(), values[env]) for env in set_here)
    detail = f"{detail}; the other {defaults}" if set_here else f"all {defaults}"
    detail += " at their defaults"
    caveats = [note.removesuffix(". Unset it.") for note in unused_options(environ)]
    fixes += [f"unset {env}." for env in UNUSED if environ.get(env, "").strip()]
    if values.get("FD_CUDAGRAPH_BACKEND") == "native":
        caveats.append("the plugin loads but FastDeploy keeps its own backend")
        fixes.append("unset FD_CUDAGRAPH_BACKEND to use the plugin's.")
    if _metrics_missing(values):
        caveats.append(
            "FD_CUDAGRAPH_METRICS=1 but prometheus_client is not importable here, so no metrics "
            "are exported (register() logs it once)"
        )
        fixes.append(
            "pip install prometheus_client in the Python environment that runs FastDeploy."
        )
    if caveats:
        return CheckResult(name, WARN, f"{detail}: {'; '.join(caveats)}.", " ".join(fixes))
    return CheckResult(name, OK, f"{detail}.")


def _as_read(env: str, raw: str, value: object) -> str:
    """``FD_CUDAGRAPH_KV_RESERVE=2GiB (read as 2.00 GiB, 2147483648 bytes)``: what the plugin
    will use, where it reads otherwise than written."""
    read = describe(env, value)
    return f"{env}={raw}" if read.lower() == raw.lower() else f"{env}={raw} (read as {read})"


def check_unknown_options(
    environ: Mapping[str, str], earlier: Earlier | None = None
) -> CheckResult:
    """A set ``FD_CUDAGRAPH_*`` variable that is no option is most likely a typo; ``register()``
    stops on it."""
    name = "unknown options"
    hints = unknown_options(environ)
    if not hints:
        return CheckResult(name, OK, f"no unknown {OPTION_PREFIX}* variable is set.")
    return CheckResult(
        name,
        FAIL,
        f"set but not options of this plugin, so register() refuses to start: {', '.join(hints)}.",
        "rename or unset them.",
    )


# ------------------------------------------------------------------ what the plugin writes


def probe_writable(path: str) -> None:
    """Create and remove a file where ``path`` would be written (its nearest existing directory):
    what ``os.access`` cannot tell (root on ``/proc``, a read-only mount). The names still to be
    made are checked against the file system's limits, which a probe file of its own name cannot
    tell (``check_lengths``). A worker's start creates nothing; only the doctor does this."""
    import tempfile

    target = os.path.abspath(rank_zero_path(path))
    ancestor = os.path.dirname(target)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{ancestor} is a file, so no directory can be made below it")
    check_lengths(target, ancestor)
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as error:
        raise ValueError(
            f"cannot create files in {ancestor} ({error.strerror or error}); choose a writable "
            "directory"
        ) from None


#: FastDeploy's log directory when FD_LOG_DIR is unset (``fastdeploy/envs.py``), relative to the
#: directory the server starts in.
DEFAULT_LOG_DIR = "log"
#: Where the plugin writes under FD_LOG_DIR: the graph-memory record FD_CUDAGRAPH_KV_RESERVE=auto
#: reads back (``core/reserve.py``), and Paddle's dot files (FD_CUDAGRAPH_DUMP_DOT=1).
RECORD_DIR, DOT_DIR = "fd_cudagraph", "GraphDotFiles"
#: Longest FD_LOG_DIR taken (PATH_MAX on Linux).
MAX_PATH = 4096


def _resolved(path: str) -> str:
    """``path`` as the reader needs it: absolute, with ``~`` expanded; said relative to what."""
    absolute = os.path.abspath(os.path.expanduser(path))
    return absolute if absolute == path else f"{absolute} ({path!r} from {os.getcwd()})"


def _outputs(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(what, path)`` of every place the plugin writes with these settings."""
    log_dir = environ.get("FD_LOG_DIR") or DEFAULT_LOG_DIR
    found = [
        ("the graph-memory record (FD_CUDAGRAPH_KV_RESERVE=auto reads it back)",
         os.path.join(log_dir, RECORD_DIR, "graph_memory.dp0.tp0.json")),
    ]  # fmt: skip
    values = {}
    for env in (*PATH_OPTIONS, "FD_CUDAGRAPH_DUMP_DOT", "FD_CUDAGRAPH_METRICS"):
        try:
            values[env] = read_option(env, environ)
        except ConfigError:
            values[env] = None  # the options line says why
    if values["FD_CUDAGRAPH_DUMP_DOT"] == "1":
        found.append(("dot files (FD_CUDAGRAPH_DUMP_DOT=1)", os.path.join(log_dir, DOT_DIR, "x")))
    for env in PATH_OPTIONS:
        if values.get(env):
            found.append((env, rank_zero_path(values[env])))
    multiproc = environ.get("PROMETHEUS_MULTIPROC_DIR")
    if values["FD_CUDAGRAPH_METRICS"] == "1" and multiproc:
        found.append(("metrics (PROMETHEUS_MULTIPROC_DIR)", os.path.join(multiproc, "x")))
    return found


def _setting(what: str) -> str:
    """The setting that places the output ``what`` of ``_outputs``."""
    if what in PATH_OPTIONS:
        return what
    return "PROMETHEUS_MULTIPROC_DIR" if what.startswith("metrics") else "FD_LOG_DIR"


def check_outputs(environ: Mapping[str, str], earlier: Earlier | None = None) -> CheckResult:
    """FD_LOG_DIR and every path the plugin writes: a directory there, or one that can be made,
    and a file can be created in it. Relative paths are said resolved, from here."""
    name = "outputs"
    raw = environ.get("FD_LOG_DIR")
    if raw is not None and (not raw.strip() or len(raw) > MAX_PATH or "\0" in raw):
        return CheckResult(
            name,
            FAIL,
            f"FD_LOG_DIR={shown(raw)} is no directory path.",
            "set FD_LOG_DIR to a directory (or unset it for FastDeploy's default, ./log).",
        )
    log_dir = raw or DEFAULT_LOG_DIR
    where = "FD_LOG_DIR" if raw else "FD_LOG_DIR unset: FastDeploy's default"
    if os.path.exists(log_dir) and not os.path.isdir(log_dir):
        return CheckResult(
            name,
            FAIL,
            f"{where} {_resolved(log_dir)} is a file, not a directory: the graph-memory record "
            "cannot be written under it.",
            "set FD_LOG_DIR to a directory, or move the file away.",
        )
    problems, places, special, too_long = [], [], [], []
    for what, path in _outputs(environ):
        directory = os.path.dirname(os.path.abspath(path))
        if os.path.exists(path) and not os.path.isfile(path):
            # Never opened (a FIFO would block): the plugin refuses each write and counts it.
            special.append(f"{what} names {path}, which is no regular file")
            continue
        try:
            probe_writable(path)
        except ValueError as error:
            problems.append(f"{what} under {directory}: {error}")
            if isinstance(error, NameTooLong) and _setting(what) not in too_long:
                too_long.append(_setting(what))
        else:
            places.append(f"{what} under {directory}")
    state = (
        "exists" if os.path.isdir(log_dir) else "does not exist yet; it is made at the first write"
    )
    detail = f"{where} {_resolved(log_dir)} ({state})"
    if problems:
        fixes = []
        if len(problems) > len(too_long):
            fixes.append(
                "make those directories writable for the user that runs FastDeploy, or point "
                "FD_LOG_DIR and the FD_CUDAGRAPH_* paths elsewhere"
            )
        if too_long:
            fixes.append(
                f"give {' and '.join(too_long)} a shorter name: each file or directory name, and "
                "the whole path, within the file system's limit the line names"
            )
        return CheckResult(
            name,
            FAIL,
            f"{detail}; cannot write: {'; '.join(problems)}. A failed write is counted and logged "
            "once, and serving goes on without it.",
            "; ".join(fixes) + ".",
        )
    if special:
        return CheckResult(
            name,
            WARN,
            f"{detail}; {'; '.join(special)}: the plugin starts, refuses every write to it (a "
            "FIFO would block the worker) and counts them.",
            "name a regular file.",
        )
    return CheckResult(name, OK, f"{detail}; writable: {'; '.join(places)}.")


CHECKS: tuple[Callable[[Mapping[str, str], Earlier], CheckResult], ...] = (
    check_entry_point,
    check_fd_plugins,
    check_paddle,
    check_fastdeploy,
    check_cuda_graphs,
    check_platform,
    check_options,
    check_unknown_options,
    check_outputs,
)


def run_checks(environ: Mapping[str, str] | None = None) -> list[CheckResult]:
    source = os.environ if environ is None else environ
    earlier: dict[str, CheckResult] = {}
    for check in CHECKS:
        result = check(source, earlier)
        earlier[result.name] = result
    return list(earlier.values())


def exit_code(results: Iterable[CheckResult]) -> int:
    """1 when anything needed to serve with the plugin failed, else 0 (warnings included)."""
    return 1 if any(result.status == FAIL for result in results) else 0


def format_results(results: list[CheckResult]) -> str:
    lines = [result.line() for result in results]
    failed = sum(result.status == FAIL for result in results)
    warned = sum(result.status == WARN for result in results)
    skipped = sum(result.status == SKIP for result in results)
    counts = f"{failed} FAIL, {warned} WARN, {skipped} SKIP"
    if failed:
        lines.append(
            f"{counts}: FastDeploy will not serve with the plugin until the FAIL lines are fixed."
        )
    elif any(r.name == "platform" and r.status == WARN for r in results):
        lines.append(f"{counts}: FastDeploy will load the plugin, which stands aside here.")
    else:
        lines.append(f"{counts}: FastDeploy will load the plugin.")
    return "\n".join(lines)


def to_json(results: list[CheckResult]) -> dict:
    return {
        "format": DOCTOR_FORMAT,
        "checks": [
            {"name": r.name, "status": r.status, "detail": r.detail, "fix": r.fix} for r in results
        ],
        "exit_code": exit_code(results),
    }
