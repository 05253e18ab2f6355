"""``@support_graph_optimization``: routes a layer's keyword-only calls through GraphOptBackend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastdeploy.model_executor.graph_optimization.graph_optimization_backend import (
    GraphOptBackend,
)


def support_graph_optimization(cls: type) -> type:
    """Class decorator; mutates ``cls`` (adds ``GraphOptWrapper`` to its bases)."""
    if GraphOptWrapper in cls.__bases__:
        return cls
    cls.__bases__ = (*cls.__bases__, GraphOptWrapper)
    origin_init = cls.__init__

    def __init__(self, fd_config: Any, **kwargs: Any) -> None:
        origin_init(self, fd_config=fd_config, **kwargs)
        goc = fd_config.graph_opt_config
        self.use_graph_opt = goc.graph_opt_level > 0 or goc.use_cudagraph
        if self.use_graph_opt:
            GraphOptWrapper.__init__(self, fd_config=fd_config, graph_opt_backend=None)

    def __call__(self, **kwargs: Any) -> Any:
        if not self.use_graph_opt:
            return self.forward(**kwargs)
        return self.graph_opt_backend(**kwargs)

    cls.__init__ = __init__
    cls.__call__ = __call__
    return cls


class GraphOptWrapper:
    def __init__(self, graph_opt_backend: Callable | None = None, fd_config: Any = None) -> None:
        if graph_opt_backend is None:
            graph_opt_backend = GraphOptBackend(self.forward, fd_config)
        self.graph_opt_backend = graph_opt_backend

    def forward(self, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __call__(self, **kwargs: Any) -> Any:
        return self.graph_opt_backend(**kwargs)

    def clear_graph_opt_backend(self, fd_config: Any) -> None:
        assert fd_config.graph_opt_config.graph_opt_level < 1, (
            "Currently unable to update weights in static graph mode."
        )
        self.graph_opt_backend.clear_cudagraph_piecewise_backend()


_CLEAR = GraphOptWrapper.clear_graph_opt_backend


def clear_method_name(version: str) -> str:
    """2.4 and 2.5 spell it ``clear_grpah_opt_backend``; 2.6 and develop fixed the typo."""
    return "clear_grpah_opt_backend" if version in ("2.4", "2.5") else "clear_graph_opt_backend"


def spell_clear_method(version: str) -> None:
    """Give ``GraphOptWrapper`` only the clear method that ``version`` has."""
    for name in ("clear_graph_opt_backend", "clear_grpah_opt_backend"):
        if name in GraphOptWrapper.__dict__:
            delattr(GraphOptWrapper, name)
    setattr(GraphOptWrapper, clear_method_name(version), _CLEAR)
