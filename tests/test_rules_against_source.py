"""The project's copy of the capture rules against FastDeploy's own ``config.py``, per branch.

Runs only where a git directory of ``gongshaotian/FastDeploy`` is given (``FD_SOURCE_GIT_DIR``):
FastDeploy cannot be installed here, and its ``config.py`` imports half of FastDeploy. The test
takes ``GraphOptimizationConfig`` whole and the statements of ``FDConfig.__init__`` from
``max_capture_shape`` to the ``init_with_cudagrpah_size(...)`` call, at the commit the rules name,
and runs them on a grid of settings: the decode list and ``real_bsz_to_captured_size`` must be
the copy's. (``postprocess``, the roles and sequence-parallel MoE are held against the stand-in in
``test_plan.py``.)
"""

from __future__ import annotations

import ast
import itertools
import logging
import os
import subprocess
import textwrap
import typing
from types import SimpleNamespace

import pytest

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.tools.capture_rules import RULES
from fd_cudagraph_plugin.tools.plan import PlanInput, derive_plan

GIT_DIR = os.environ.get("FD_SOURCE_GIT_DIR", "")
pytestmark = pytest.mark.skipif(
    not GIT_DIR, reason="set FD_SOURCE_GIT_DIR to a git directory of gongshaotian/FastDeploy"
)
#: 2.4 is left out: its FDConfig scales and trims in code the copy mirrors by hand elsewhere.
CHECKED = [name for name, rules in RULES.items() if rules.generation != "2.4"]
SPEC = SimpleNamespace(MTP="mtp", SUFFIX="suffix", NGRAM="ngram", NAIVE="naive")


def _fastdeploy_rules(commit: str):
    """``GraphOptimizationConfig`` and the capture statements of ``FDConfig.__init__``."""
    source = subprocess.run(
        ["git", f"--git-dir={GIT_DIR}", "show", f"{commit}:fastdeploy/config.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    tree, lines = ast.parse(source), source.splitlines()
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    graph = classes["GraphOptimizationConfig"]
    init = next(n for n in classes["FDConfig"].body if getattr(n, "name", "") == "__init__")
    first = next(n for n in init.body if "max_capture_shape" in ast.unparse(n))
    call = next(n for n in init.body if "init_with_cudagrpah_size(" in ast.unparse(n))
    capture = textwrap.dedent("\n".join(lines[first.lineno - 1 : call.end_lineno]))
    names = {
        "logger": logging.getLogger("fastdeploy-source"),
        "paddle": SimpleNamespace(is_compiled_with_xpu=lambda: False),
        "SpecMethod": SPEC,
        # The typing names config.py imports and its annotations use.
        **{name: getattr(typing, name) for name in ("Any", "Dict", "Literal", "Optional", "Union")},
    }
    exec("\n".join(lines[graph.lineno - 1 : graph.end_lineno]), names)
    return names["GraphOptimizationConfig"], capture


def _theirs(rules, seqs: int, method: str | None, k: int | None, sizes) -> object:
    graph_class, capture = rules
    graph = graph_class(
        {"use_cudagraph": True, **({"cudagraph_capture_sizes": list(sizes)} if sizes else {})}
    )
    name = "ngram_match" if method == "ngram" and "ngram_match" in capture else method
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=seqs),
        speculative_config=SimpleNamespace(method=name, num_speculative_tokens=k or 0),
        graph_opt_config=graph,
    )
    try:
        exec(capture, {"self": config, "graph_opt_config": graph, "SpecMethod": SPEC})
    except AssertionError:
        return "refused"
    bsz = dict(getattr(graph, "real_bsz_to_captured_size", None) or {})
    return list(graph.cudagraph_capture_sizes), bsz


def _ours(release: str, seqs: int, method: str | None, k: int | None, sizes) -> object:
    inputs = PlanInput(
        max_num_seqs=seqs,
        spec_method=method,
        num_speculative_tokens=k,
        capture_sizes=sizes,
        fastdeploy_version=release,
    )
    try:
        plan = derive_plan(inputs, use_fastdeploy=False)
    except ConfigError as error:
        return "refused" if "even" in str(error) else f"error: {error}"
    return plan.capture_sizes, plan.real_bsz_to_captured_size


GRID = list(
    itertools.product(
        (1, 3, 8, 64, 256, 512),
        ((None, None), ("mtp", 1), ("mtp", 3), ("ngram", 2), ("suffix", 1)),
        (None, (1, 2, 5, 40)),
    )
)


@pytest.mark.parametrize("release", CHECKED)
def test_the_copy_derives_what_the_branch_it_names_derives(release):
    rules = RULES[release]
    source = _fastdeploy_rules(rules.commit)
    differ = []
    for seqs, (method, k), sizes in GRID:
        if seqs > rules.max_num_seqs or (method and method not in rules.spec_methods):
            continue  # refused before the lists: FDConfig.check, SpeculativeConfig
        theirs, ours = (
            _theirs(source, seqs, method, k, sizes),
            _ours(release, seqs, method, k, sizes),
        )
        if theirs != ours:
            differ.append((seqs, method, k, sizes, theirs, ours))
    assert not differ, f"{len(differ)} settings differ, e.g. {differ[:2]}"
