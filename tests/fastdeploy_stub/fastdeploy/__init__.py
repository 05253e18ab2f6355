"""Test stand-in for PaddlePaddle FastDeploy 2.x (only the graph-optimization surface)."""

from __future__ import annotations

__version__ = "2.6.0"  # rebound by _stub_version.use
