"""Every way the GPU benchmarks reach fd-cudagraph-plugin, in one module that needs no torch.

The GPU parts (``run.sh``) run only where a GPU and PyTorch are; CI has neither. So that a change
of the plugin cannot break a part unseen, each bench reaches the plugin only through the functions
here (``tests/test_benchmarks.py`` checks their source for any other way), and that test runs every
function here against the plugin on the CPU: CPU Paddle, the tests' FastDeploy stand-in and the
simulated runtime. What they read is the plugin's public surface: its entry point, the backend's
``stats()`` and ``capture_report``, ``budget.margin``, the runtime's ``paddle_cuda()``, the mark
``register()`` leaves on the runner's methods, and its logger's name.
"""

from __future__ import annotations

import importlib
import os
import re
from collections import defaultdict
from typing import Any

#: The plugin's logger (``logging.getLogger``): its log lines, for bench_wakeup.
LOGGER = "fd_cudagraph_plugin"
#: What ``register()`` leaves on each runner method it wraps: the method it wrapped.
WRAPPED = "_fd_cudagraph_original"
ENTRY_POINT_GROUP = "fastdeploy.model_register_plugins"
MiB = 2**20


def entry_point_target(root: str) -> str:
    """'module:function' of the plugin's entry point: from the installed metadata if the plugin is
    installed, else from the checkout's setup.py."""
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.value.startswith("fd_cudagraph_plugin"):
                return ep.value
    except Exception:
        pass
    try:
        with open(os.path.join(root, "setup.py"), encoding="utf-8") as handle:
            text = handle.read()
        found = re.search(
            r"(fd_cudagraph_plugin[\w.]*\s*:\s*\w+)", text.split(ENTRY_POINT_GROUP)[1]
        )
        if found:
            return re.sub(r"\s", "", found.group(1))
    except (OSError, IndexError):
        pass
    return "fd_cudagraph_plugin.plugin:register"


def register(target: str) -> None:
    """Call the entry point as FastDeploy's loader does."""
    module, _, func = target.partition(":")
    getattr(importlib.import_module(module), func)()


def why_not_bound() -> str:
    """Why ``register()`` bound no backend (it stands aside off a CUDA platform), or ""."""
    from fd_cudagraph_plugin.core import seam

    return seam.cuda_runtime_blocker() or ""


def runtime_check() -> dict:
    """The plugin's CUDA runtime built from the Paddle it finds: which calls stayed unset, and
    whether CUDA graphs are supported."""
    from fd_cudagraph_plugin.core.runtime import cuda

    api = cuda.paddle_cuda()
    return {
        "paddle_cuda_unset": [k for k, v in vars(api).items() if v is None],
        "cuda_graph_support": cuda.cuda_graph_support(),
    }


def plugin_facts(root: str, tqdm: str) -> dict:
    """Where the plugin came from: it must be this checkout (run.sh puts it first on the path)."""
    import sys

    pkg = sys.modules.get("fd_cudagraph_plugin")
    plugin_dir = os.path.dirname(getattr(pkg, "__file__", "") or "")
    return {
        "plugin_dir": plugin_dir,
        "plugin_is_this_checkout": os.path.realpath(plugin_dir)
        == os.path.realpath(os.path.join(root, "fd_cudagraph_plugin")),
        "plugin_version": getattr(pkg, "__version__", None),
        "tqdm": tqdm,
    }


def _mib(count):
    return None if count is None else round(count / MiB, 1)


def _total(value):
    return sum(value.values()) if isinstance(value, dict) else value


def figures(backend, report_path=None, report_detail=True) -> tuple[dict, list[str]]:
    """``stats()``, ``capture_report`` and the memory-report file, read defensively.
    Returns (figures, the names that could not be read)."""
    import json

    fig, missing = {}, []
    try:
        st = backend.stats()
    except Exception as error:
        st = None
        missing.append(f"stats(): {type(error).__name__}: {error}"[:200])
    if st is not None:

        def pick(key, f=lambda v: v):
            if key in st:
                return f(st[key])
            missing.append(f"stats()[{key!r}]")
            return None

        fig["plugin_stats"] = {
            "captures": pick("captures"),
            "replays_served": pick("replays", _total),
            "replays_at_capture": _total((st.get("capture_time") or {}).get("replays")),
            "eager_fallbacks": pick("eager_fallbacks"),
            "padded_tokens": pick("padded_tokens"),
            "graph_mib_total": pick("graph_bytes_total", _mib),
            "largest_graph_mib": pick("largest_graph_bytes", _mib),
            "pool_policy": pick("pool_policy"),
        }
    if report_detail:
        rep = getattr(backend, "capture_report", None)
        if rep is None:
            missing.append("capture_report")
        else:

            def attr(name, f=lambda v: v):
                try:
                    value = getattr(rep, name)
                    return f(value() if name == "summary" else value)
                except Exception:
                    missing.append(f"capture_report.{name}")
                    return None

            records = attr("records", list) or []
            try:
                per_size = {r.size: round(r.graph_bytes / MiB, 2) for r in records}
                capture_ms = [round(r.seconds * 1e3, 1) for r in records[:3]]
            except AttributeError:
                missing.append("capture_report.records[].size/graph_bytes/seconds")
                per_size, capture_ms = None, None
            fig["plugin_report"] = {
                "graphs": attr("graphs"),
                "graph_mib": attr("graph_bytes", _mib),
                "largest_graph_mib": attr("largest_graph_bytes", _mib),
                "seconds": attr("seconds", lambda v: round(v, 3)),
                "setup_seconds": attr("setup_seconds", lambda v: round(v, 4)),
                "agreement_seconds": attr("agreement_seconds", lambda v: round(v, 4)),
                "summary": attr("summary"),
                "per_size_mib": per_size,
                "capture_ms_first3": capture_ms,
            }
        if report_path:
            try:
                with open(report_path) as f:
                    j = json.load(f)
                fig["memory_report_file"] = {
                    "graph_mib": _mib(j.get("graph_bytes")),
                    "graphs": j.get("graphs"),
                    "format": j.get("format"),
                }
            except Exception as error:
                fig["memory_report_file"] = f"{type(error).__name__}: {error}"[:200]
    return fig, missing


def report(backend) -> Any:
    """The backend's last capture session's report (None before any)."""
    return getattr(backend, "capture_report", None)


def summary(backend) -> str | None:
    """The capture session's one log line."""
    rep = report(backend)
    return None if rep is None else rep.summary()


def session_timings(backend) -> dict:
    """bench_ctime: where the session's time went, and the backend's own capture seconds."""
    rep = report(backend)
    own = backend.stats()["capture_seconds"]
    return {
        "setup_ms": rep.setup_seconds * 1e3,
        "agreement_ms": rep.agreement_seconds * 1e3,
        "agreement_points": rep.agreement_points,
        "session_ms": rep.seconds * 1e3,
        "own_capture_seconds_sum_ms": sum(own.values()) * 1e3,
    }


def warmups_by_role(backend) -> dict[str, list[int]]:
    """The warm-ups each graph of the last session had, by backend role (target, draft)."""
    found: dict[str, set[int]] = defaultdict(set)
    for record in report(backend).records:
        found[record.role].add(record.warmups)
    return {role: sorted(v) for role, v in sorted(found.items())}


def served(backend) -> dict:
    """The steps the backend served since construction: replays and eager steps (any reason)."""
    stats = backend.stats()
    return {"replays": _count(stats["replays"]), "eager": _count(stats["eager_fallbacks"])}


def _count(value) -> int:
    """A count, or the sum of a (nested) dict of counts."""
    return sum(map(_count, value.values())) if isinstance(value, dict) else int(value)


def report_fields(backend, names=("seconds", "graphs", "cause", "moved")) -> tuple[dict, set]:
    """Some fields of the last capture report and its summary; the names it lacks."""
    rep, found, missing = report(backend), {}, set()
    if rep is None:
        return found, missing
    for name in names:
        if hasattr(rep, name):
            found[name] = getattr(rep, name)
        else:
            missing.add(f"capture_report.{name}")
    try:
        found["summary"] = rep.summary()
    except Exception as error:
        missing.add(f"capture_report.summary(): {type(error).__name__}")
    return found, missing


def kv_reserve(backend) -> tuple[int | None, str]:
    """What FD_CUDAGRAPH_KV_RESERVE took out of the KV budget at this start, and where the figure
    came from (``stats()["memory"]``; None: nothing taken)."""
    memory = backend.stats()["memory"]
    return memory["kv_reserve_bytes"], memory["kv_reserve_source"]


def margin(total: int) -> int:
    """What the plugin's advice keeps free after capture on a device of ``total`` bytes."""
    from fd_cudagraph_plugin.core import budget

    return budget.margin(total)


def forget_options() -> None:
    """Read the ``FD_CUDAGRAPH_*`` options again at their next use (a worker reads them once):
    for a part that runs plugin backends with other options one after another in one process."""
    from fd_cudagraph_plugin.core import process

    process.current().forget_options()


def is_wrapped(method) -> bool:
    return hasattr(method, WRAPPED)


def unwrapped(method):
    """The runner method as written, whatever ``register()`` wrapped around it."""
    while hasattr(method, WRAPPED):
        method = getattr(method, WRAPPED)
    return method


def captures(backend) -> int:
    """Graphs the backend captured since construction, recaptures included."""
    return backend.captures


def role(backend) -> str | None:
    """The role the capture session gave the backend (target, draft)."""
    return getattr(backend, "role", None)


#: The module each distribution the plugin requires is imported as, where the names differ.
_MODULE: dict[str, str] = {}


def requirements(root: str) -> dict[str, str]:
    """The plugin's ``install_requires`` (``setup.py``), each distribution to its module name."""
    with open(os.path.join(root, "setup.py"), encoding="utf-8") as handle:
        found = re.search(r"install_requires\s*=\s*\[([^\]]*)\]", handle.read())
    names = re.findall(r"[\"']([A-Za-z0-9_.\-]+)", found.group(1)) if found else []
    return {name: _MODULE.get(name, name.replace("-", "_")) for name in names}
