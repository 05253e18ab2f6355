"""Importing this package loads model-register plugins, as upstream's ``models/__init__`` does."""

from __future__ import annotations

# Real model modules import the decorator (and through it the graph backend) first.
import fastdeploy.model_executor.graph_optimization.decorator  # noqa: F401
from fastdeploy.plugins.model_register import load_model_register_plugins

load_model_register_plugins()
