"""FastDeploy's launch line, for every tool: taken whole, each setting spelt as FastDeploy does.

Where FastDeploy is importable and is the release asked for (the stand-in here), its own parser
reads the line and refuses what FastDeploy would; elsewhere a small parser reads the flags that
change what is captured and names the others once. The tools' earlier flags for the same
settings answer with FastDeploy's spelling.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.tools import launch
from fd_cudagraph_plugin.tools import plan as plan_module
from fd_cudagraph_plugin.tools.capture_rules import RULES
from fd_cudagraph_plugin.tools.cli import main
from fd_cudagraph_plugin.tools.plan import PlanInput, derive_plan

#: An operator's launch line, pasted as it is, head included.
LAUNCH = [
    *("python", "-m", "fastdeploy.entrypoints.openai.api_server"),
    *("--model", "/models/ERNIE-4.5-21B-A3B-Paddle", "--port", "8180"),
    *("--max-model-len", "32768", "--quantization", "wint4", "--max-num-seqs", "64"),
]
#: Lines whose every setting both parsers read (the stand-in's parser has these flags).
LINES = [
    "--max-num-seqs 64",
    "--max-num-seqs 128 -tp 4 --enable-expert-parallel --splitwise-role decode",
    "--tensor-parallel-size 8 --enable-expert-parallel --disable-sequence-parallel-moe",
    "--dynamic-load-weight --swap-space 4 --graph-optimization-config '{\"graph_opt_level\": 1}'",
    '--max-num-seqs 32 --speculative-config \'{"method": "mtp", "num_speculative_tokens": 2}\'',
    '--graph-optimization-config \'{"cudagraph_capture_sizes": [1, 2, 4, 8], '
    '"full_cuda_graph": false, "graph_opt_level": 1, "cudagraph_num_of_warmups": 1}\'',
    "--data-parallel-size 2 --enable-expert-parallel --model m --max-model-len 4096",
]


@pytest.fixture
def no_fastdeploy(monkeypatch):
    """As where FastDeploy is not importable: the small parser and the copy of the rules."""
    monkeypatch.setattr(launch, "installed_fastdeploy", lambda: None)
    monkeypatch.setattr(plan_module, "installed_fastdeploy", lambda: None)


@pytest.mark.parametrize("line", LINES)
def test_fastdeploys_parser_and_the_small_one_read_a_line_alike(line):
    tokens = shlex.split(line)
    theirs = launch.read(tokens)
    ours = launch.read(tokens, use_fastdeploy=False)
    assert "installed FastDeploy's parser" in theirs.read_by
    assert "fd-cudagraph's parser" in ours.read_by
    unread = ("read_by", "given_notes")
    assert dataclasses.replace(theirs, **dict.fromkeys(unread, "")) == dataclasses.replace(
        ours, **dict.fromkeys(unread, "")
    )


def test_a_pasted_launch_line_is_planned_with_its_other_flags_named_once(no_fastdeploy, capsys):
    assert main(["plan", *LAUNCH, "--dynamic-load-weight"]) == 0
    out = capsys.readouterr().out
    assert "cudagraph_capture_sizes (11): 64, 56, 48, 40, 32, 24, 16, 8, 4, 2, 1" in out
    assert out.count("--model, --port, --max-model-len, --quantization change nothing") == 1
    assert "python" not in out


def test_with_fastdeploy_importable_its_own_parser_reads_the_line(capsys):
    """The stand-in's make_arg_parser knows --port and --model but not --revision: the plan says
    whose parser read the line, and that parser's refusal is the answer."""
    assert main(["plan", *LAUNCH]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(
        "read by the installed FastDeploy's parser, its API server's parser (make_arg_parser)"
    )
    assert main(["plan", "--max-num-seqs", "4", "--revision", "v1"]) == 2
    err = capsys.readouterr().err
    assert "does not take '--revision v1'; FastDeploy would refuse this launch line" in err
    # Another release than the installed one: the small parser reads, and names it.
    assert (
        main(["plan", "--max-num-seqs", "4", "--fastdeploy-version", "2.6", "--revision", "v"]) == 0
    )
    assert "--revision changes nothing FastDeploy captures" in capsys.readouterr().out


def test_a_value_fastdeploys_parser_refuses_is_refused_with_its_words(capsys):
    assert main(["plan", "--max-num-seqs", "many"]) == 2
    assert "own parser refuses this launch line: " in capsys.readouterr().err


@pytest.mark.parametrize("flag", sorted(launch.REMOVED))
def test_a_removed_flag_names_fastdeploys_spelling_and_that_spelling_plans(flag, capsys):
    value = {"--capture-sizes": "1,2,64", "--capture-sizes-prefill": "4,16", "--spec-method": "mtp"}
    line = [flag, value.get(flag, "2")]
    if flag.endswith("draft-model-use-cudagraph") or flag == "--num-speculative-tokens":
        line += ["--spec-method", "mtp"]  # what only MTP reads comes with it, as before
    argv = ["tune", "-"] if flag == "--num-speculative-tokens" else ["plan"]
    assert main([*argv, *line]) == 2
    err = capsys.readouterr().err
    said = launch.replacement(line)
    assert f"{flag}" in err.split(" gone")[0] and f"Give {said} instead." in err
    # The spelling as printed, whole: one object per FastDeploy flag, every value in it.
    replacement = shlex.split(said.split(" with ")[0])
    if flag == "--sequence-parallel-moe":
        replacement += ["--tensor-parallel-size", "2"]
    assert main(["plan", "--max-num-seqs", "64", *replacement, "--json"]) == 0, (
        capsys.readouterr().err
    )
    planned = json.loads(capsys.readouterr().out)
    if flag == "--capture-sizes":  # the user's own sizes carried over
        assert planned["cudagraph_capture_sizes"] == [64, 2, 1]
    if flag == "--num-speculative-tokens":  # both removed flags in one object
        assert planned["settings"]["num_speculative_tokens"] == 2


def test_a_yaml_config_is_refused_since_the_tools_do_not_read_it(capsys):
    assert main(["plan", "--config", "serve.yaml"]) == 2
    assert "--config: FastDeploy reads settings from that YAML file" in capsys.readouterr().err


def test_tune_takes_its_trace_files_before_the_launch_line(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("1\n2\n3\n")
    assert main(["tune", str(trace), "--model", "m", "--max-num-seqs", "8"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit, match="2"):
        main(["tune", "--model", "m", str(trace)])
    assert "the trace file m comes after FastDeploy's flags (--model)" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "doctor"])
def test_commands_without_a_launch_line_refuse_other_words(command, capsys):
    with pytest.raises(SystemExit, match="2"):
        main([command, "--max-num-seqs", "8"])
    assert "unrecognized arguments: --max-num-seqs 8" in capsys.readouterr().err


def test_a_launch_line_read_here_checks_what_fastdeploy_bounds(no_fastdeploy):
    for tokens, said in (
        (["--max-num-seqs", "0"], "--max-num-seqs must be an integer in 1..512; got 0."),
        (["-tp", "x"], "--tensor-parallel-size must be an integer in"),
        (["--swap-space", "nan"], "--swap-space must be GiB of host memory"),
        (["--graph-optimization-config", "{"], "is not valid JSON"),
        (["--graph-optimization-config", '{"cuda_graph_capture_sizes": [1]}'], "did you mean"),
        (["--speculative-config", '{"method": "eagle"}'], "method must be one of"),
        (["stray"], "'stray' is no flag of FastDeploy's launch line"),
    ):
        with pytest.raises(ConfigError, match=None) as raised:
            launch.read(tokens)
        assert said in str(raised.value), (tokens, str(raised.value))


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
    sizes = json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 8]})
    assert main(["plan", "--max-num-seqs", "256", "--graph-optimization-config", sizes]) == 0
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


@pytest.mark.parametrize("value", ["²", "٣", "0000000000000000008"])
def test_digits_are_read_as_an_operator_types_them(value, capsys):
    """ASCII digits only (``int()`` refuses a superscript two that ``str.isdigit`` takes), and
    leading zeros do not count toward the bound, as FastDeploy's ``type=int`` reads them."""
    code = main(["plan", "--max-num-seqs", value, "--fastdeploy-version", "2.6"])
    if value.isascii():
        assert code == 0 and "max_num_seqs=8," in capsys.readouterr().out
    else:
        assert code == 2 and "--max-num-seqs must be an integer" in capsys.readouterr().err


def test_an_abbreviated_flag_is_read_as_fastdeploy_reads_it_or_refused(capsys):
    # The stand-in FastDeploy's parser takes abbreviations, as argparse does: so does the plan.
    assert main(["plan", "--max-num-seq", "64"]) == 0
    assert "max_num_seqs=64," in capsys.readouterr().out
    # The small parser cannot know what FastDeploy's would make of it: refused, not dropped.
    assert main(["plan", "--max-num-seq", "64", "--fastdeploy-version", "2.6"]) == 2
    assert "--max-num-seq is an abbreviation" in capsys.readouterr().err
