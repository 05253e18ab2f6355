"""Shared set-up of the GPU measurements: the torch stand-in for Paddle, the stand-in FastDeploy
modules, the two backends built as FastDeploy builds them, a toy decoder on persistent buffers,
and device and timing helpers. ``python harness.py`` is run.sh's ``setup`` part.

* FastDeploy's backend is read from the file ``$FD_HARNESS_FASTDEPLOY_BACKEND`` names
  (``fastdeploy/model_executor/graph_optimization/cudagraph_piecewise_backend.py`` of a FastDeploy
  checkout or install); this repository holds none of FastDeploy's code. Without it, every
  comparison with FastDeploy is skipped and the run says so (``fastdeploy`` in its JSON line).
* The plugin is registered through its ``fastdeploy.model_register_plugins`` entry point, as
  FastDeploy's plugin loader does, and the class that ``register()`` binds in
  ``graph_optimization_backend`` is built with ``(fd_config=, dy_runnable=, runnable=)``. Its
  figures come from ``stats()``, ``capture_report`` and ``FD_CUDAGRAPH_MEMORY_REPORT``; a field
  a refactor renamed is listed under ``surface_missing`` and the run goes on.

``FD_HARNESS_CPU_DRY_RUN=1``: no-op graphs on the CPU and a tiny toy, to check the plumbing
(figures mean nothing, replays return stale outputs).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
import types
import warnings
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
DRY = os.environ.get("FD_HARNESS_CPU_DRY_RUN") == "1"
FASTDEPLOY_BACKEND_ENV = "FD_HARNESS_FASTDEPLOY_BACKEND"
MiB = 2**20

import fd_stubs  # noqa: E402
import plugin_surface  # noqa: E402
import torch  # noqa: E402
import torch_paddle_shim  # noqa: E402

paddle = torch_paddle_shim.install(dry_run=DRY)
fd_stubs.install()
GPUModelRunner = fd_stubs.GPUModelRunner
plain_capture_model = fd_stubs.plain_capture_model
GOB = sys.modules[fd_stubs.BACKEND_MODULE]
NATIVE = sys.modules[fd_stubs.NATIVE_MODULE]


def _tqdm_stand_in() -> str:
    """The plugin shows capture progress with tqdm (its one dependency). A machine with torch may
    lack it; then a silent stand-in keeps the capture path the same, and runs say so."""
    try:
        import tqdm  # noqa: F401

        return "installed"
    except ImportError:
        pass

    class Bar:
        def __init__(self, *args, **kwargs):
            pass

        def update(self, n=1):
            pass

        def set_postfix_str(self, *args, **kwargs):
            pass

        def close(self):
            pass

    sys.modules["tqdm"] = types.ModuleType("tqdm")
    sys.modules["tqdm"].tqdm = Bar
    return "not installed: a silent stand-in (progress bars cost nothing here)"


TQDM = _tqdm_stand_in()


# ---------------------------------------------------------- FastDeploy's own backend


def _load_fastdeploy_backend() -> tuple[type | None, str | None, str | None]:
    """(class, why skipped, load error). Skipped: the variable is unset; an error: it names a
    file that is missing or does not load."""
    path = os.environ.get(FASTDEPLOY_BACKEND_ENV, "").strip()
    if not path:
        return (
            None,
            f"{FASTDEPLOY_BACKEND_ENV} not set: comparisons with FastDeploy's backend skipped "
            f"(set it to the path of FastDeploy's cudagraph_piecewise_backend.py)",
            None,
        )
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        return None, None, f"{FASTDEPLOY_BACKEND_ENV}={path}: no such file"
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().split("\n")
        # A copy may carry its path in FastDeploy's tree as its first line.
        if lines and lines[0].strip().endswith(".py") and " " not in lines[0].strip():
            lines = lines[1:]
        module = types.ModuleType("fastdeploy_cudagraph_piecewise_backend")
        module.__file__ = path
        sys.modules[module.__name__] = module  # dataclasses look their module up
        exec(compile("\n".join(lines), path, "exec"), module.__dict__)
        return module.CudaGraphPiecewiseBackend, None, None
    except Exception as error:
        return None, None, f"loading {path}: " + fmt_exc(error, 1500)


def fmt_exc(error: BaseException, limit: int = 3000) -> str:
    return "".join(traceback.format_exception(error))[-limit:]


FASTDEPLOY_CLASS, FASTDEPLOY_SKIPPED, FASTDEPLOY_ERROR = _load_fastdeploy_backend()
# FastDeploy's graph_optimization_backend imports its own class before any plugin loads.
GOB.CudaGraphPiecewiseBackend = NATIVE.CudaGraphPiecewiseBackend = FASTDEPLOY_CLASS


def fastdeploy_status() -> str:
    """For a run's JSON line: "loaded <path>", "skipped: ..." or "error: ..."."""
    if FASTDEPLOY_CLASS is not None:
        return "loaded " + os.environ[FASTDEPLOY_BACKEND_ENV]
    return f"skipped: {FASTDEPLOY_SKIPPED}" if FASTDEPLOY_SKIPPED else f"error: {FASTDEPLOY_ERROR}"


# ---------------------------------------------------------- the plugin, loaded as FastDeploy does


def entry_point_target() -> str:
    return plugin_surface.entry_point_target(ROOT)


def register_plugin() -> type:
    """Call the entry point as FastDeploy's loader does; return the class it bound."""
    target = entry_point_target()
    plugin_surface.register(target)
    cls = GOB.CudaGraphPiecewiseBackend
    if cls is None or cls is FASTDEPLOY_CLASS:
        why = plugin_surface.why_not_bound() or "see stderr.log"
        raise RuntimeError(f"{target}() bound no backend in graph_optimization_backend: {why}")
    return cls


def backend_class(kind: str) -> type:
    """'fd': FastDeploy's backend; 'plugin': the class the plugin's register() binds."""
    if kind == "fd":
        if FASTDEPLOY_CLASS is None:
            raise RuntimeError(FASTDEPLOY_ERROR or FASTDEPLOY_SKIPPED)
        return FASTDEPLOY_CLASS
    return register_plugin()


def construct(cls: type, cfg, model):
    """As FastDeploy 2.5+/develop's GraphOptBackend builds its backend. ``model``'s bound
    ``__call__`` is the runnable, so the plugin finds the layer (``__self__``) it serves."""
    runnable = getattr(model, "__call__", model)  # noqa: B004
    return cls(fd_config=cfg, dy_runnable=runnable, runnable=runnable)


def plugin_facts() -> dict:
    """Where the plugin came from: it must be this checkout (run.sh puts it first on the path)."""
    return plugin_surface.plugin_facts(ROOT, TQDM)


plugin_figures = plugin_surface.figures


def set_plugin_env(pool=None, self_check=None, memory_report=None, fit=None) -> None:
    """The plugin's options for this process (read once per process: a change after the plugin
    read them needs ``plugin_surface.forget_options()``)."""
    os.environ["FD_CUDAGRAPH_RUNTIME"] = "cuda"
    for key, value in (
        ("POOL", pool),
        ("SELF_CHECK", self_check),
        ("MEMORY_REPORT", memory_report),
        ("FIT", fit),
    ):
        if value:
            os.environ["FD_CUDAGRAPH_" + key] = value
        else:
            os.environ.pop("FD_CUDAGRAPH_" + key, None)


def plugin_env() -> dict:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("FD_CUDAGRAPH_")}


def emit(out: dict) -> None:
    """One JSON line on stdout: what run.sh collects into results.jsonl."""
    out.setdefault("dry_run", DRY)
    print(json.dumps(out, default=str), flush=True)


def finish(out: dict, missing: set[str]) -> None:
    """Emit ``out`` (with the plugin fields that could not be read) and exit: 1 on errors."""
    if missing:
        out["surface_missing"] = sorted(missing)
    emit(out)
    sys.exit(1 if out["errors"] else 0)


def skip_without_fastdeploy(out: dict, finish) -> None:
    """A run of FastDeploy's backend says whether the backend loaded; without it, it is skipped."""
    out["fastdeploy"] = fastdeploy_status()
    if FASTDEPLOY_CLASS is None and FASTDEPLOY_SKIPPED:
        out["skipped"] = FASTDEPLOY_SKIPPED
        finish()


# ------------------------------------------------------------------ device helpers


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def reserved() -> int:
    return 0 if DRY else torch.cuda.memory_reserved()


def allocated() -> int:
    return 0 if DRY else torch.cuda.memory_allocated()


def empty_cache() -> None:
    if not DRY:
        torch.cuda.empty_cache()


def live_graphs() -> int:
    """Graph objects alive in this process (on the GPU every torch CUDA graph, which pins its
    pool until reset or freed; in the dry run the shim's captured no-op graphs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if DRY:
            kind = torch_paddle_shim.DryGraph
            return sum(1 for o in gc.get_objects() if isinstance(o, kind) and o._graph is not None)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.cuda.CUDAGraph))


# ------------------------------------------------------------------ configs, model, inputs, timing


def make_config(sizes, warmups=2, unique_pool=True):
    return fd_stubs.make_fd_config(sizes, warmups=warmups, unique_pool=unique_pool)


def default_sizes(max_bs=512) -> list[int]:
    """FastDeploy's automatic capture list up to 512: 1, 2, 4, 8, then every 16 (36 sizes)."""
    return [1, 2, 4, 8, *range(16, max_bs + 1, 16)]


def model_dims(layers, hidden, inter):
    """The toy's shape; in the dry run a tiny one (its figures mean nothing there anyway)."""
    if DRY:
        return min(layers, 2), 64, 128
    return layers, hidden, inter


class Toy:
    """A toy decoder reading a persistent input buffer X (as a serving engine keeps its inputs).
    layers=0: a single elementwise kernel (for dispatch timing)."""

    def __init__(self, layers, hidden, inter, X, seed=0, dtype=torch.bfloat16):
        g = torch.Generator(device=X.device).manual_seed(seed)
        H, I = hidden, inter  # noqa: E741
        self.X = X
        shapes = ((H, 3 * H), (H, H), (H, I), (I, H))
        self.W = [
            tuple(torch.randn(*shape, dtype=dtype, generator=g) * 0.02 for shape in shapes)
            for _ in range(layers)
        ]

    @staticmethod
    def rms(h):
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)

    def __call__(self, forward_meta=None, **kw):
        n = forward_meta.ids_remove_padding.shape[0]
        h = self.X[:n]
        if not self.W:
            return h * 2
        for wqkv, wo, w1, w2 in self.W:
            r = h
            q, k, v = (self.rms(h) @ wqkv).chunk(3, -1)
            h = r + (torch.softmax(q * k, -1) * v) @ wo
            r = h
            h = r + torch.nn.functional.silu(self.rms(h) @ w1) @ w2
        return h


class Inputs:
    """A persistent ids buffer and per-token-count kwargs, as GPUModelRunner passes them."""

    def __init__(self, max_tokens):
        self.ids = torch.zeros(max_tokens, dtype=torch.int64)
        self._cache = {}

    def kw(self, n):
        kw = self._cache.get(n)
        if kw is None:
            view = self.ids[:n]
            meta = SimpleNamespace(
                ids_remove_padding=view,
                exist_prefill=False,
                seq_lens_this_time=None,
                real_bsz=0,
                step_use_cudagraph=True,
            )
            kw = self._cache[n] = {"ids_remove_padding": view, "forward_meta": meta}
        return kw


def step_time_us(fn, reps=None, warm=10) -> float:
    reps = reps or (20 if DRY else 200)
    for _ in range(warm):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps * 1e6


def med(xs):
    return statistics.median(xs) if xs else None


def check_surface() -> dict:
    """The Paddle calls of the plugin's CUDA runtime: does the shim provide each, and does
    ``paddle_cuda()`` build from them?"""
    found = {
        name: torch_paddle_shim.resolve(paddle, name) is not None
        for name in torch_paddle_shim.RUNTIME_CALLS
    }
    result = {"shim_runtime_calls": found, "errors": []}
    missing = [name for name, ok in found.items() if not ok]
    if missing:
        result["errors"].append("shim lacks paddle." + ", paddle.".join(missing))
    try:
        result.update(plugin_surface.runtime_check())
        if result["paddle_cuda_unset"]:
            result["errors"].append(f"paddle_cuda() left {result['paddle_cuda_unset']} unset")
    except Exception as error:
        result["errors"].append("paddle_cuda(): " + fmt_exc(error, 1500))
    return result


if __name__ == "__main__":  # run.sh setup: can the plugin and FastDeploy's backend be loaded?
    tag = sys.argv[sys.argv.index("--tag") + 1] if "--tag" in sys.argv[:-1] else "setup_check"
    check = {"tag": tag, "fastdeploy": fastdeploy_status(), "errors": []}
    if FASTDEPLOY_ERROR:
        check["errors"].append("fastdeploy backend: " + FASTDEPLOY_ERROR)
    surface = check_surface()
    check["errors"] += surface.pop("errors")
    check.update(surface)
    for name, module in plugin_surface.requirements(ROOT).items():
        # tqdm is optional here: a silent stand-in keeps the capture path the same.
        if name != "tqdm" and importlib.util.find_spec(module) is None:
            check["errors"].append(f"the plugin needs {name}: pip install {name}")
    check["entry_point"] = entry_point_target()
    set_plugin_env()
    try:
        cls = register_plugin()
        check["plugin_class"] = f"{cls.__module__}.{cls.__name__}"
        check.update(plugin_facts())
        if not check["plugin_is_this_checkout"]:
            check["errors"].append(
                f"the plugin was imported from {check['plugin_dir']}, not {ROOT}"
            )
        wrapped = plugin_surface.is_wrapped(GPUModelRunner.capture_model)
        check["runner_capture_model_wrapped"] = wrapped
        if not wrapped:
            check["errors"].append("register() did not wrap GPUModelRunner.capture_model")
    except Exception as error:
        check["errors"].append("register: " + fmt_exc(error))
    check["torch"] = torch.__version__
    check["device"] = (
        "cpu (dry run)"
        if DRY
        else (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    )
    emit(check)
    sys.exit(1 if check["errors"] else 0)
