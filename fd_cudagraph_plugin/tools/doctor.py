"""``fd-cudagraph doctor``: will FastDeploy serve with this plugin here? One line per check.

Each check is a small function of the environment that returns a ``CheckResult``; ``CHECKS``
lists them in the order a start-up goes through them. FAIL means FastDeploy will not serve with
the plugin (the command exits 1); WARN means it will, with a caveat worth knowing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from fd_cudagraph_plugin import __version__
from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.options import (
    OPTION_PREFIX,
    OPTIONS,
    PATH_OPTIONS,
    describe,
    probe_writable,
    rank_zero_path,
    read_option,
    removed_option_error,
    unknown_options,
)
from fd_cudagraph_plugin.core.seam import BACKEND_MODULE as _BACKEND_MODULE
from fd_cudagraph_plugin.core.seam import BACKEND_NAME as _NAME
from fd_cudagraph_plugin.core.seam import constructor_shape, cuda_runtime_blocker
from fd_cudagraph_plugin.core.seam import version as fastdeploy_version
from fd_cudagraph_plugin.plugin import ENTRY_POINT_GROUP, ENTRY_POINT_NAME

OK, WARN, FAIL = "OK", "WARN", "FAIL"
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
    environ: Mapping[str, str], *, entry_points: EntryPoints = importlib.metadata.entry_points
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


def check_fd_plugins(environ: Mapping[str, str]) -> CheckResult:
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


def check_fastdeploy(environ: Mapping[str, str]) -> CheckResult:
    """FastDeploy's backend module imports and has a backend class of a known constructor shape."""
    name = "FastDeploy"
    try:
        module = importlib.import_module(_BACKEND_MODULE)
    except Exception as error:  # ImportError, or whatever FastDeploy's own imports raise
        return CheckResult(
            name,
            FAIL,
            f"cannot import {_BACKEND_MODULE}: {type(error).__name__}: {error}.",
            "install PaddlePaddle FastDeploy 2.4 or later (fastdeploy-gpu; the PyPI project "
            "named fastdeploy is unrelated) in this environment.",
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


def _simulated(environ: Mapping[str, str]) -> bool:
    return _option_is("FD_CUDAGRAPH_RUNTIME", "simulated", environ)


def _native(environ: Mapping[str, str]) -> bool:
    return _option_is("FD_CUDAGRAPH_BACKEND", "native", environ)


#: What the Paddle and CUDA-graph checks say when the plugin's runtime will not run.
NATIVE_NOTE = (
    "FD_CUDAGRAPH_BACKEND=native keeps FastDeploy's own backend, so the plugin's CUDA runtime "
    "is not used"
)


def check_paddle(environ: Mapping[str, str]) -> CheckResult:
    """Paddle imports and has CUDA (without it the plugin stands aside)."""
    name = "Paddle"
    try:
        import paddle
    except Exception as error:
        return CheckResult(
            name,
            FAIL,
            f"cannot import paddle: {type(error).__name__}: {error}.",
            "install paddlepaddle-gpu from Paddle's own index, matching your CUDA version.",
        )
    version = getattr(paddle, "__version__", "unknown")
    if paddle.is_compiled_with_cuda():
        return CheckResult(name, OK, f"paddle {version}, compiled with CUDA.")
    if _native(environ):
        return CheckResult(
            name, OK, f"paddle {version}, without CUDA: {NATIVE_NOTE} and needs none."
        )
    if _simulated(environ):
        return CheckResult(
            name,
            WARN,
            f"paddle {version} has no CUDA; FD_CUDAGRAPH_RUNTIME=simulated runs graphs on the "
            "CPU, for tests and demos, not for serving.",
            "install paddlepaddle-gpu and unset FD_CUDAGRAPH_RUNTIME to serve.",
        )
    return CheckResult(
        name,
        FAIL,
        f"paddle {version} is not compiled with CUDA, so the plugin stands aside (see the "
        "platform line).",
        "install paddlepaddle-gpu (not the CPU wheel paddlepaddle).",
    )


def check_cuda_graphs(environ: Mapping[str, str]) -> CheckResult:
    """Paddle reports CUDA graphs as supported on this build and device."""
    name = "CUDA graphs"
    if _native(environ):
        return CheckResult(name, OK, f"not checked: {NATIVE_NOTE}.")
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
    if _simulated(environ):
        return CheckResult(
            name,
            WARN,
            "not supported by this Paddle; FD_CUDAGRAPH_RUNTIME=simulated does not need them.",
            "install paddlepaddle-gpu and unset FD_CUDAGRAPH_RUNTIME to serve.",
        )
    return CheckResult(
        name,
        FAIL,
        "paddle.device.cuda.graphs.is_cuda_graph_supported() is False on this build.",
        "install paddlepaddle-gpu (CUDA 11+), or serve without CUDA graphs "
        "(--graph-optimization-config '{\"use_cudagraph\": false}').",
    )


def check_platform(environ: Mapping[str, str]) -> CheckResult:
    """Whether ``register()`` installs the plugin's backend here or stands aside, as it logs."""
    name = "platform"
    if _native(environ):
        return CheckResult(name, OK, f"not checked: {NATIVE_NOTE}.")
    if _simulated(environ):
        return CheckResult(
            name,
            OK,
            "FD_CUDAGRAPH_RUNTIME=simulated: register() installs the plugin's backend on any "
            "platform (CPU graphs, for tests and demos).",
        )
    try:
        blocker = cuda_runtime_blocker()
    except Exception as error:  # a FastDeploy platform object that fails: register() would too
        return CheckResult(
            name,
            FAIL,
            f"cannot tell the platform: {type(error).__name__}: {error}; register() would fail "
            "the same way.",
            "check the FastDeploy installation (see the FastDeploy line).",
        )
    if blocker is not None:
        return CheckResult(
            name,
            FAIL,
            f"fd-cudagraph-plugin {__version__} stands aside here: {blocker}, and its CUDA "
            "runtime drives NVIDIA CUDA graphs only. register() logs this, and FastDeploy keeps "
            "its own CUDA-graph backend and runners.",
            "serve on NVIDIA CUDA with paddlepaddle-gpu to use the plugin; elsewhere FastDeploy's "
            "own backend is the one that serves, and nothing needs fixing.",
        )
    return CheckResult(
        name, OK, "NVIDIA CUDA with a CUDA build of Paddle: register() installs the plugin."
    )


def _metrics_missing(values: Mapping[str, object]) -> bool:
    if values.get("FD_CUDAGRAPH_METRICS") != "1":
        return False
    try:
        importlib.import_module("prometheus_client")
    except Exception:
        return True
    return False


def check_options(environ: Mapping[str, str]) -> CheckResult:
    """Every ``FD_CUDAGRAPH_*`` option has a value the plugin accepts.

    An invalid one makes ``register()`` raise in every FastDeploy process, which stops start-up.
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
            continue
        if option.env in PATH_OPTIONS and values[option.env]:
            try:
                probe_writable(values[option.env])
            except ValueError as error:
                errors.append(f"{option.env}={environ[option.env]!r}: {error}. Fix or unset it.")
    if errors:
        return CheckResult(name, FAIL, " ".join(errors))
    set_here = [o.env for o in OPTIONS if environ.get(o.env, "").strip()]
    defaults = len(OPTIONS) - len(set_here)
    detail = ", ".join(_as_read(env, environ[env].strip(), values[env]) for env in set_here)
    detail = f"{detail}; the other {defaults}" if set_here else f"all {defaults}"
    detail += " at their defaults"
    caveats, fixes = [], []
    for env in PATH_OPTIONS:
        special = _special_file(values.get(env))
        if special:
            caveats.append(
                f"{env} names {special}, which is no regular file: the plugin starts, refuses "
                "every write to it (a FIFO would block the worker) and counts them"
            )
            fixes.append(f"name a regular file in {env}.")
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


def _special_file(template: object) -> str:
    """The path of ``template`` (placeholders as rank 0) when it exists and is no regular file."""
    if not isinstance(template, str) or not template:
        return ""
    path = rank_zero_path(template)
    return path if os.path.exists(path) and not os.path.isfile(path) else ""


def _as_read(env: str, raw: str, value: object) -> str:
    """``FD_CUDAGRAPH_KV_RESERVE=2GiB (read as 2.00 GiB, 2147483648 bytes)``: what the plugin
    will use, where it reads otherwise than written."""
    read = describe(env, value)
    return f"{env}={raw}" if read.lower() == raw.lower() else f"{env}={raw} (read as {read})"


def check_unknown_options(environ: Mapping[str, str]) -> CheckResult:
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


CHECKS: tuple[Callable[[Mapping[str, str]], CheckResult], ...] = (
    check_entry_point,
    check_fd_plugins,
    check_fastdeploy,
    check_paddle,
    check_cuda_graphs,
    check_platform,
    check_options,
    check_unknown_options,
)


def run_checks(environ: Mapping[str, str] | None = None) -> list[CheckResult]:
    source = os.environ if environ is None else environ
    with warnings.catch_warnings():
        # Importing Paddle (directly or through FastDeploy) warns about ccache, which has nothing
        # to do with serving.
        warnings.filterwarnings("ignore", message="No ccache found")
        return [check(source) for check in CHECKS]


def exit_code(results: Iterable[CheckResult]) -> int:
    """1 when anything needed to serve with the plugin failed, else 0 (warnings included)."""
    return 1 if any(result.status == FAIL for result in results) else 0


def format_results(results: list[CheckResult]) -> str:
    lines = [result.line() for result in results]
    failed = sum(result.status == FAIL for result in results)
    warned = sum(result.status == WARN for result in results)
    if failed:
        lines.append(
            f"{failed} FAIL, {warned} WARN: FastDeploy will not serve with the plugin until the "
            "FAIL lines are fixed."
        )
    else:
        lines.append(f"0 FAIL, {warned} WARN: FastDeploy will load the plugin.")
    return "\n".join(lines)
