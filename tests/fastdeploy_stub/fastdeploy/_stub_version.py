"""Test hook (not in FastDeploy): which release this stand-in behaves as.

``use("2.4" | "2.5" | "2.6" | "develop")`` switches every version-dependent behaviour at once:
``ForwardMeta``'s fields, the native backend's constructor, ``GraphOptBackend``'s routing, the
clear method's spelling, config defaults and capture lists, and the runner's capture loops.
Modules read ``current()`` at call time, so a switch applies to objects built afterwards. The
facts come from the fork's branches ``2.4_r3``, ``r3_ban_cpucache_2.5``, ``r3_eos_2.6`` and
``r3_mm_dev`` (see README.md).
"""

from __future__ import annotations

VERSIONS = ("2.4", "2.5", "2.6", "develop")
#: What ``fastdeploy.__version__`` says under each switch.
VERSION_STRINGS = {"2.4": "2.4.0", "2.5": "2.5.0", "2.6": "2.6.0", "develop": "2.6.0"}

_current = "develop"


def current() -> str:
    return _current


def at_least(version: str) -> bool:
    """True when the emulated release is ``version`` or later (develop is the latest)."""
    return VERSIONS.index(_current) >= VERSIONS.index(version)


def use(version: str) -> None:
    """Behave as ``version`` from now on (rebinds the names that differ between releases)."""
    global _current
    if version not in VERSIONS:
        raise ValueError(f"unknown FastDeploy version {version!r}; choose from {VERSIONS}")
    _current = version
    import fastdeploy
    from fastdeploy.model_executor import forward_meta
    from fastdeploy.model_executor.graph_optimization import (
        cudagraph_piecewise_backend,
        decorator,
        graph_optimization_backend,
    )

    fastdeploy.__version__ = VERSION_STRINGS[version]
    forward_meta.ForwardMeta = forward_meta.FORWARD_META[version]
    native = cudagraph_piecewise_backend.native_class(version)
    for module in (graph_optimization_backend, cudagraph_piecewise_backend):
        # Leave a plugin's rebinding alone; swap only between the stand-in's own classes.
        if getattr(module.CudaGraphPiecewiseBackend, "_fd_stub_native", False):
            module.CudaGraphPiecewiseBackend = native
    decorator.spell_clear_method(version)
