"""Which FastDeploy tree plan's rules were read from, and which tree an installed FastDeploy is.

The facts pinned here were read from ``fastdeploy/config.py`` of the ``gongshaotian/FastDeploy``
branches: r3_cherry_pick_2.5 (8d7f3d4) scales only MTP's decode cap, within 512, has no suffix
method and builds no ``real_bsz_to_captured_size``; r3_ban_cpucache_2.5 (fd6f890) does all of
these. develop at e53f518 has ``draft_model_use_cudagraph`` false and scales MTP and suffix only,
as r3_eos_2.6 does; its version string is ``2.6.0-dev`` where the release's is ``2.6.0``.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import fastdeploy
import pytest

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.tools.capture_rules import RELEASES, RULES
from fd_cudagraph_plugin.tools.cli import main
from fd_cudagraph_plugin.tools.installed import release_of
from fd_cudagraph_plugin.tools.plan import PlanInput, derive_plan
from fd_cudagraph_plugin.tools.tune import tune

BRANCHES = {
    "2.4": "2.4_r3",
    "2.5-cherry-pick": "r3_cherry_pick_2.5",
    "2.5": "r3_ban_cpucache_2.5",
    "2.6": "r3_eos_2.6",
    "develop-e53f518": "develop",
    "develop": "r3_mm_dev",
}


def _copy(release: str, **settings) -> object:
    return derive_plan(PlanInput(fastdeploy_version=release, **settings), use_fastdeploy=False)


@pytest.mark.parametrize("release", RELEASES)
def test_plan_names_the_branch_and_commit_its_rules_were_read_from(release, capsys):
    rules = RULES[release]
    assert rules.branch == BRANCHES[release]
    assert re.fullmatch(r"[0-9a-f]{7}", rules.commit) and re.fullmatch(
        r"\d{4}-\d\d-\d\d", rules.date
    )
    assert main(["plan", "--fastdeploy-version", release]) == 0
    lines = capsys.readouterr().out.splitlines()
    source = f"gongshaotian/FastDeploy branch {rules.branch} at {rules.commit} ({rules.date})"
    if release == fastdeploy._stub_version.current():
        # The stand-in FastDeploy is that release: its FDConfig computes the lists, and the text
        # names no copy (--json still names the branch and commit of the rules for it).
        assert lines[0].startswith(f"rules: FastDeploy {release} rules, computed by the installed")
        assert not any(line.startswith("rules read from") for line in lines)
    else:
        assert lines[1] == f"rules read from: {source}"
    assert main(["plan", "--fastdeploy-version", release, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["rules_branch"], document["rules_commit"]) == (rules.branch, rules.commit)


# (settings, r3_cherry_pick_2.5's decode list and bsz map, r3_ban_cpucache_2.5's), by hand from
# each branch's FDConfig.__init__.
TWO_FIVES = [
    ({"max_num_seqs": 8, "spec_method": "mtp"}, ([16, 8, 4, 2], {}), ([16, 8, 4, 2], "map")),
    (
        # MTP's cap is min(512, 256 x 4) on the cherry-pick branch, 256 x 4 on the other.
        {"max_num_seqs": 256, "spec_method": "mtp", "num_speculative_tokens": 3},
        (512, {}),
        (1024, "map"),
    ),
    (
        {"max_num_seqs": 8, "spec_method": "ngram", "num_speculative_tokens": 2},
        ([8, 6, 3], {}),
        ([8, 6, 3], {}),
    ),
    ({"max_num_seqs": 8}, ([8, 4, 2, 1], {}), ([8, 4, 2, 1], {})),
]


@pytest.mark.parametrize(("settings", "cherry", "ban"), TWO_FIVES, ids=str)
def test_the_two_2_5_branches_are_two_rule_sets(settings, cherry, ban):
    """The 2.5 rules built a real_bsz_to_captured_size that r3_cherry_pick_2.5 does not have."""
    for release, (sizes, bsz) in (("2.5-cherry-pick", cherry), ("2.5", ban)):
        plan = _copy(release, **settings)
        if isinstance(sizes, int):
            assert plan.capture_sizes[0] == sizes, release
        else:
            assert plan.capture_sizes == sizes, release
        if bsz == "map":  # every running-request count up to max_num_seqs has its size
            running = range(1, settings["max_num_seqs"] + 1)
            assert set(running) <= set(plan.real_bsz_to_captured_size), release
        else:
            assert plan.real_bsz_to_captured_size == bsz, release
    cherry_plan = _copy("2.5-cherry-pick", **settings)
    assert "keyed by token count" in cherry_plan.backends[0].decode


def test_r3_cherry_pick_2_5_has_no_suffix_method():
    with pytest.raises(ConfigError, match=r"FastDeploy 2\.5-cherry-pick has no such method"):
        _copy("2.5-cherry-pick", spec_method="suffix")
    assert _copy("2.5", spec_method="suffix").real_bsz_to_captured_size


def test_r3_cherry_pick_2_5_asserts_an_even_token_cap_for_mtp_only():
    with pytest.raises(ConfigError, match="asserts max_num_seqs x \\(k \\+ 1\\) is even"):
        _copy("2.5-cherry-pick", max_num_seqs=3, spec_method="mtp", num_speculative_tokens=2)
    _copy("2.5-cherry-pick", max_num_seqs=3, spec_method="ngram", num_speculative_tokens=2)


def test_tune_refuses_running_request_sizes_for_a_tree_without_a_bsz_map():
    with pytest.raises(ConfigError, match=r"FastDeploy 2\.5-cherry-pick builds no real_bsz_to"):
        tune({1: 1}, 1, num_speculative_tokens=1, fastdeploy_version="2.5-cherry-pick")


SETTINGS = [
    {"max_num_seqs": 8},
    {"max_num_seqs": 300},
    {"max_num_seqs": 16, "spec_method": "mtp", "num_speculative_tokens": 2},
    {"max_num_seqs": 16, "spec_method": "suffix", "num_speculative_tokens": 3},
    {"max_num_seqs": 16, "spec_method": "ngram", "num_speculative_tokens": 1},
    {"max_num_seqs": 64, "capture_sizes": (1, 3, 70)},
    {"max_num_seqs": 24, "tensor_parallel_size": 3, "sequence_parallel_moe": True},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_develop_at_e53f518_derives_its_lists_as_2_6_does(settings):
    ours, theirs = _copy("develop-e53f518", **settings), _copy("2.6", **settings)
    assert _derived(ours) == _derived(theirs)
    assert not ours.draft_model_use_cudagraph


def _derived(plan) -> dict:
    """The plan as JSON, without what names the tree (release, branch, commit, notes)."""
    naming = (
        "fastdeploy_version",
        "fastdeploy_version_asked",
        "rules_branch",
        "rules_commit",
        "notes",
    )
    return {key: value for key, value in plan.to_json().items() if key not in naming}


def test_develop_at_e53f518_differs_from_r3_mm_dev_in_ngram_and_the_draft_model():
    ngram = {"max_num_seqs": 16, "spec_method": "ngram", "num_speculative_tokens": 1}
    assert _copy("develop-e53f518", **ngram).capture_sizes[0] == 16
    assert _copy("develop", **ngram).capture_sizes[0] == 32
    mtp = {"max_num_seqs": 8, "spec_method": "mtp"}
    assert [b.name for b in _copy("develop-e53f518", **mtp).backends] == ["target model"]
    assert [b.name for b in _copy("develop", **mtp).backends] == ["target model", "MTP draft model"]


def _graph(*, prefill=True, flag=True, bsz=True, draft=False) -> SimpleNamespace:
    """A default GraphOptimizationConfig's attributes, as each branch defines them."""
    graph = SimpleNamespace(draft_model_use_cudagraph=draft)
    if prefill:
        graph.cudagraph_capture_sizes_prefill = [1, 2, 4, 8]
    if flag:
        graph.flag_cudagraph_capture_sizes_initlized = False
    if bsz:
        graph.real_bsz_to_captured_size = {}
    return graph


@pytest.mark.parametrize(
    ("graph", "version", "release"),
    [
        (_graph(prefill=False, flag=False, bsz=False), "2.3.0-dev", "2.4"),
        (_graph(flag=False, bsz=False), "2.5.0", "2.5-cherry-pick"),
        (_graph(flag=False), "2.5.0", "2.5"),
        (_graph(), "2.6.0", "2.6"),
        (_graph(), "2.6.0-dev", "develop-e53f518"),
        (_graph(), "Unknown", "develop-e53f518"),
        (_graph(draft=True), "2.6.0-dev", "develop"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_an_installed_tree_is_recognised_from_its_config_and_version(graph, version, release):
    assert release_of(graph, version) == release


@pytest.mark.parametrize("fd_version", ["2.6"], indirect=True)
@pytest.mark.parametrize(
    ("version", "release"), [("2.6.0-dev", "develop-e53f518"), ("2.6.0", "2.6")]
)
def test_plan_says_develop_for_an_installed_develop_tree(fd_version, version, release, monkeypatch):
    """develop at e53f518 (2.6.0-dev, draft_model_use_cudagraph false) was reported as 2.6."""
    monkeypatch.setattr(fastdeploy, "__version__", version)
    plan = derive_plan(PlanInput(max_num_seqs=8))
    assert plan.release == release and plan.from_fastdeploy
    assert plan.rules.startswith(f"FastDeploy {release} rules, computed by the installed")
    assert f"(version {version})" in plan.rules
