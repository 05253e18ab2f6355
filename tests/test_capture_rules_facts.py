"""``plan``'s copy of the capture rules against what FastDeploy's own code computed, offline.

``tests/data/capture_rules/<tree>.json`` holds facts: for a grid of settings, the decode and
prefill capture lists and ``real_bsz_to_captured_size`` (as runs ``[first, last, size]``) that
``fastdeploy/config.py`` of ``gongshaotian/FastDeploy`` computes at the commit each rule set names:
its ``GraphOptimizationConfig`` and the capture statements of ``FDConfig.__init__`` (the same
extraction as ``test_rules_against_source.py``, which checks them live where
``FD_SOURCE_GIT_DIR`` is set), run once outside this repository, with only the results kept.
No FastDeploy code is in them. These run in CI, without a network or a FastDeploy checkout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.tools.capture_rules import RULES
from fd_cudagraph_plugin.tools.plan import PlanInput, derive_plan

FACTS = Path(__file__).resolve().parent / "data" / "capture_rules"


def _facts(tree: str) -> dict:
    return json.loads((FACTS / f"{tree}.json").read_text(encoding="utf-8"))


def _runs(mapping: dict[int, int]) -> list[list[int]]:
    out: list[list[int]] = []
    for key, value in sorted(mapping.items()):
        if out and out[-1][2] == value and out[-1][1] == key - 1:
            out[-1][1] = key
        else:
            out.append([key, key, value])
    return out


def _ours(tree: str, settings: dict) -> dict:
    sizes = settings["cudagraph_capture_sizes"]
    inputs = PlanInput(
        max_num_seqs=settings["max_num_seqs"],
        spec_method=settings["method"],
        num_speculative_tokens=settings["num_speculative_tokens"],
        capture_sizes=tuple(sizes) if sizes else None,
        fastdeploy_version=tree,
        expert_parallel=settings.get("use_ep", False),
    )
    try:
        plan = derive_plan(inputs, use_fastdeploy=False)
    except ConfigError as error:
        return {"refused": str(error)}
    return {
        "cudagraph_capture_sizes": plan.capture_sizes,
        "cudagraph_capture_sizes_prefill": plan.capture_sizes_prefill,
        "real_bsz_to_captured_size": _runs(plan.real_bsz_to_captured_size),
    }


def test_every_rule_set_has_facts_from_the_commit_it_names():
    assert sorted(path.stem for path in FACTS.glob("*.json")) == sorted(RULES)
    for tree, rules in RULES.items():
        facts = _facts(tree)
        assert facts["format"] == "fd-cudagraph-capture-facts/1"
        assert (facts["branch"], facts["commit"]) == (rules.branch, rules.commit), tree
        assert len(facts["cases"]) >= 40


@pytest.mark.parametrize("tree", list(RULES))
def test_the_copy_derives_what_fastdeploys_code_computed_at_that_commit(tree):
    differ = []
    for case in _facts(tree)["cases"]:
        theirs, ours = case["fastdeploy"], _ours(tree, case["settings"])
        if "refused" in theirs:
            # FastDeploy asserts an even token cap; the plan refuses the same settings, saying so.
            if "even" not in ours.get("refused", ""):
                differ.append((case["settings"], theirs, ours))
        elif ours != theirs:
            differ.append((case["settings"], theirs, ours))
    assert not differ, f"{len(differ)} of {len(_facts(tree)['cases'])} differ, e.g. {differ[:2]}"


def test_the_facts_check_can_fail(monkeypatch):
    """A planted error in the copy (2.6 forgetting to scale the cap by k + 1) is caught."""
    from fd_cudagraph_plugin.tools import capture_rules

    real = capture_rules.fastdeploy_bsz_map
    monkeypatch.setattr(capture_rules, "fastdeploy_bsz_map", lambda sizes, k: real(sizes, k + 1))
    with pytest.raises(AssertionError, match="differ"):
        test_the_copy_derives_what_fastdeploys_code_computed_at_that_commit("2.6")
