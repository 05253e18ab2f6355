"""FastDeploy's launch line, for every tool: taken whole, read as the chosen tree reads it.

The flags come from ``launch_flags.FLAGS`` (every ``add_argument`` of ``EngineArgs.add_cli_args``
and of the API server's ``make_arg_parser`` in each tree the rules name); the ones that change
what is captured are read (``--dynamic-load-weight``, ``--swap-space`` among them), the others
are named once. Where FastDeploy is importable (the stand-in here), its own parser reads them.
"""

from __future__ import annotations

import json

import pytest

from fd_cudagraph_plugin.tools import plan as plan_module
from fd_cudagraph_plugin.tools.capture_rules import RULES
from fd_cudagraph_plugin.tools.cli import main
from fd_cudagraph_plugin.tools.launch_flags import CAPTURE_FLAGS, FLAGS, arity
from fd_cudagraph_plugin.tools.plan import PlanInput, derive_plan

#: The issue's launch line: an operator pastes it as it is.
LAUNCH = [
    *("--model", "/models/ERNIE-4.5-21B-A3B-Paddle", "--port", "8180"),
    *("--max-model-len", "32768", "--quantization", "wint4", "--max-num-seqs", "64"),
]
#: A value each capture flag takes (the others take any string).
VALUES = {
    "--max-num-seqs": "8",
    "--tensor-parallel-size": "1",
    "--data-parallel-size": "1",
    "--splitwise-role": "mixed",
    "--graph-optimization-config": "{}",
    "--speculative-config": "{}",
    "--swap-space": "0",
}


@pytest.fixture
def no_fastdeploy(monkeypatch):
    """Plan as where FastDeploy is not importable: the project's list and copy answer."""
    monkeypatch.setattr(plan_module, "installed_fastdeploy", lambda: None)


def _line(tree: str) -> list[str]:
    argv = []
    for spellings, values, trees in FLAGS:
        if tree not in trees:
            continue
        flag = spellings[-1]  # -tp for --tensor-parallel-size: both spellings are taken
        kind = arity(values, tree)
        value = VALUES.get(spellings[0], "x")
        argv += {"0": [flag], "bool": [flag], "+": [flag, value, value]}.get(kind, [flag, value])
    return argv


@pytest.mark.parametrize("tree", list(RULES))
def test_every_flag_of_the_trees_launch_line_is_taken(tree, no_fastdeploy, capsys):
    argv = _line(tree)
    assert len(argv) > 150
    assert main(["plan", *argv, "--fastdeploy-version", tree]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    (note,) = [line for line in out.splitlines() if "change nothing FastDeploy captures" in line]
    named = set(note.removeprefix("note: ").split(" change nothing")[0].split(", "))
    expected = {s[0] for s, _, trees in FLAGS if tree in trees and s[0] not in CAPTURE_FLAGS}
    assert named == expected  # each once, the capture flags not among them


def test_a_pasted_launch_line_is_planned_with_its_other_flags_named_once(no_fastdeploy, capsys):
    assert main(["plan", *LAUNCH, "--dynamic-load-weight"]) == 0
    out = capsys.readouterr().out
    assert "cudagraph_capture_sizes (10): 64, 56, 48, 40, 32, 24, 16, 8, 4, 2, 1" not in out
    assert "cudagraph_capture_sizes (11): 64, 56, 48, 40, 32, 24, 16, 8, 4, 2, 1" in out
    assert out.count("--model, --port, --max-model-len, --quantization change nothing") == 0
    assert out.count("--model, --max-model-len, --quantization, --port change nothing") == 1


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--fastdeploy-version", "2.4", "--enable-overlap-schedule"],
            "--enable-overlap-schedule: FastDeploy 2.4's launch line has no such flag",
        ),
        (
            ["--fastdeploy-version", "2.5", "--no-enable-overlap-schedule"],
            "it is a flag of FastDeploy 2.6, develop-e53f518, develop",
        ),
        (["--fastdeploy-version", "2.6", "--write-through-threshold", "3"], "FastDeploy develop."),
        (["--config", "serve.yaml"], "--config serve.yaml: FastDeploy reads settings from that"),
    ],
    ids=["2.4 lacks it", "2.5 has no --no- form", "develop only", "yaml"],
)
def test_a_flag_the_trees_parser_would_refuse_is_refused_naming_why(argv, said, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1


def test_with_fastdeploy_importable_its_own_parser_reads_the_flags(capsys):
    """The stand-in's EngineArgs.add_cli_args knows --model but not --revision: the plan says
    whose parser read the flags, and that parser's refusal is the answer."""
    assert main(["plan", "--max-num-seqs", "4", "--model", "m", "--port", "80"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("flags read by its EngineArgs.add_cli_args")
    assert main(["plan", "--max-num-seqs", "4", "--revision", "v1"]) == 2
    assert "FastDeploy 2.6.0's own parser refuses these flags" in capsys.readouterr().err
    assert (
        main(["plan", "--max-num-seqs", "4", "--fastdeploy-version", "2.6", "--revision", "v"]) == 0
    )


@pytest.mark.parametrize("release", list(RULES))
@pytest.mark.parametrize("use_fastdeploy", [False, True], ids=["copy", "FastDeploy"])
def test_dynamic_load_weight_plans_dynamic_mode_on_every_release(release, use_fastdeploy):
    if use_fastdeploy and release not in ("2.4", "2.5", "2.6", "develop"):
        pytest.skip("the stand-in plays 2.4, 2.5, 2.6 and develop")
    if use_fastdeploy:
        from fastdeploy import _stub_version

        _stub_version.use(release)
    try:
        inputs = PlanInput(graph_opt_level=1, fastdeploy_version=release)
        static = derive_plan(inputs, use_fastdeploy=use_fastdeploy)
        weights = derive_plan(
            PlanInput(graph_opt_level=1, dynamic_load_weight=True, fastdeploy_version=release),
            use_fastdeploy=use_fastdeploy,
        )
    finally:
        if use_fastdeploy:
            _stub_version.use("develop")
    assert weights.from_fastdeploy == use_fastdeploy
    assert static.mode.startswith("static") and weights.mode == "dynamic"
    assert any(
        "--dynamic-load-weight: FastDeploy sets graph_opt_level to 0" in n for n in weights.notes
    )


@pytest.mark.parametrize("release", list(RULES))
@pytest.mark.parametrize("use_fastdeploy", [False, True], ids=["copy", "FastDeploy"])
def test_swap_space_turns_only_prefill_off_on_develop_only(release, use_fastdeploy):
    """r3_mm_dev alone: a host cache ends cudagraph_only_prefill after the decode list was built
    for it (up to 512), so decode graphs up to 512 are captured; the other trees keep it."""
    if use_fastdeploy and release not in ("2.4", "2.5", "2.6", "develop"):
        pytest.skip("the stand-in plays 2.4, 2.5, 2.6 and develop")
    if use_fastdeploy:
        from fastdeploy import _stub_version

        _stub_version.use(release)
    try:
        plan = derive_plan(
            PlanInput(
                max_num_seqs=8, only_prefill=True, host_cache=True, fastdeploy_version=release
            ),
            use_fastdeploy=use_fastdeploy,
        )
    finally:
        if use_fastdeploy:
            _stub_version.use("develop")
    decode_graphs = plan.backends[0].decode_graphs
    if release == "develop":
        assert decode_graphs == 35 and max(plan.capture_sizes) == 512
        assert any("turns cudagraph_only_prefill off" in note for note in plan.notes)
    else:
        assert decode_graphs == 0
        assert any("keeps cudagraph_only_prefill" in note for note in plan.notes)


def test_plan_warns_when_the_largest_graph_is_below_max_num_seqs(no_fastdeploy, capsys):
    assert main(["plan", "--max-num-seqs", "256", "--capture-sizes", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    assert (
        "warning: the largest decode graph holds 8 tokens, below max_num_seqs 256 (one token per "
        "running request in a decode step): decode steps of 9..256 tokens run eagerly"
    ) in out
    assert main(["plan", "--max-num-seqs", "256"]) == 0
    assert "warning" not in capsys.readouterr().out
    # Under the filter the default list can end below max_num_seqs too: 20 -> 16 with TP 8.
    argv = ["--max-num-seqs", "20", "-tp", "8", "--enable-expert-parallel"]
    assert main(["plan", *argv, "--splitwise-role", "decode", "--json"]) == 0
    (warning,) = json.loads(capsys.readouterr().out)["warnings"]
    assert "holds 16 tokens" in warning and "17..20 tokens run eagerly" in warning


def test_graphs_off_in_the_mixed_role_do_not_blame_the_prefill_role(no_fastdeploy, capsys):
    config = '{"use_cudagraph": false}'
    assert main(["plan", "--graph-optimization-config", config]) == 0
    out = capsys.readouterr().out
    assert "use_cudagraph is false" in out and "splitwise_role prefill" not in out
    assert main(["plan", "--splitwise-role", "prefill"]) == 0
    assert "splitwise_role prefill sets use_cudagraph" in capsys.readouterr().out
