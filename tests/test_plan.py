"""``fd-cudagraph plan`` derives what FastDeploy derives, and says what each backend captures."""

from __future__ import annotations

import itertools
import json

import pytest
from conftest import FD_VERSIONS, graph_config, make_config, speculative_config
from fastdeploy import _stub_version

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.settings import Settings
from fd_cudagraph_plugin.tools.capture_rules import RULES, default_capture_sizes
from fd_cudagraph_plugin.tools.cli import main
from fd_cudagraph_plugin.tools.plan import PlanInput, derive_plan, format_ranges

DEFAULT_128 = [128, 120, 112, 104, 96, 88, 80, 72, 64, 56, 48, 40, 32, 24, 16, 8, 4, 2, 1]


def test_default_list_at_128_seqs_is_19_graphs():
    plan = derive_plan(PlanInput(max_num_seqs=128))
    assert plan.capture_sizes == DEFAULT_128
    assert plan.total_graphs == 19


def test_default_list_at_256_seqs_is_27_graphs():
    plan = derive_plan(PlanInput(max_num_seqs=256))
    assert plan.capture_sizes == [256, 240, 224, 208, 192, 176, 160, 144, *DEFAULT_128]
    assert plan.total_graphs == 27


def test_mtp_k1_scales_sizes_and_adds_a_draft_backend():
    plan = derive_plan(PlanInput(max_num_seqs=128, spec_method="mtp", num_speculative_tokens=1))
    assert plan.capture_sizes == [2 * s for s in DEFAULT_128]
    assert plan.capture_sizes[0] == 256 and plan.capture_sizes[-1] == 2
    assert [b.name for b in plan.backends] == ["target model", "MTP draft model"]
    assert [b.graphs for b in plan.backends] == [19, 19] and plan.total_graphs == 38
    # 1 request -> 2 tokens, 3 requests -> the 8-token graph (doc §2.2 example).
    assert [plan.real_bsz_to_captured_size[b] for b in (1, 2, 3, 4, 5, 8)] == [2, 4, 8, 8, 16, 16]


def test_user_sizes_are_scaled_by_draft_tokens_and_capped():
    plan = derive_plan(
        PlanInput(
            max_num_seqs=16, spec_method="ngram", num_speculative_tokens=2, capture_sizes=(1, 4, 32)
        )
    )
    assert plan.capture_sizes == [12, 3]
    assert any("drops 96" in note for note in plan.notes)


def test_user_sizes_above_max_num_seqs_are_dropped_with_a_note():
    plan = derive_plan(PlanInput(max_num_seqs=64, capture_sizes=(1, 8, 64, 300)))
    assert plan.capture_sizes == [64, 8, 1]
    assert any("drops 300" in note and "= 64" in note for note in plan.notes)


def test_no_decode_size_left_is_an_error_naming_the_fix():
    with pytest.raises(ConfigError, match=r"no decode capture size is left.*--max-num-seqs"):
        derive_plan(PlanInput(max_num_seqs=4, capture_sizes=(8, 16)))


def test_naive_keeps_token_keys():
    naive = derive_plan(PlanInput(max_num_seqs=8, spec_method="naive"))
    assert naive.num_speculative_tokens == 0 and naive.real_bsz_to_captured_size == {}
    assert naive.capture_sizes == [8, 4, 2, 1]


def test_mixed_role_turns_sequence_parallel_moe_off_before_the_filter():
    """FastDeploy's postprocess disables SP-MoE in the mixed role before filter_capture_size."""
    plan = derive_plan(
        PlanInput(max_num_seqs=16, tensor_parallel_size=4, sequence_parallel_moe=True)
    )
    assert plan.capture_sizes == [16, 8, 4, 2, 1] and not plan.filtered_for_tp
    assert plan.stale_padding == []
    assert any("mixed role" in note for note in plan.notes)


def test_sequence_parallel_moe_filter_leaves_fastdeploy_map_stale_and_plugin_repads():
    plan = derive_plan(
        PlanInput(
            max_num_seqs=16,
            tensor_parallel_size=4,
            sequence_parallel_moe=True,
            splitwise_role="decode",
        )
    )
    assert plan.capture_sizes == [16, 8, 4]
    # FastDeploy's map was built before the filter: 1 and 2 still name removed graphs.
    assert plan.real_shape_to_captured_size[1] == 1 and plan.real_shape_to_captured_size[2] == 2
    assert plan.stale_padding == [(1, 1, 4), (2, 2, 4)]
    assert plan.padding[1] == plan.padding[2] == 4  # what the plugin pads to
    assert any("removes decode sizes 1, 2 and prefill sizes 1, 2" in note for note in plan.notes)
    assert plan.capture_sizes_prefill[-1] == 4  # the prefill list is filtered too


def test_sequence_parallel_moe_is_disabled_when_seqs_below_tp():
    plan = derive_plan(
        PlanInput(
            max_num_seqs=2,
            tensor_parallel_size=4,
            sequence_parallel_moe=True,
            splitwise_role="decode",
        )
    )
    assert plan.capture_sizes == [2, 1] and not plan.filtered_for_tp
    assert any("disables it" in note for note in plan.notes)


MODE_CASES = [
    # (graph_opt_level, full_cuda_graph, only_prefill) -> (decode graphs, prefill graphs) on 2.5+
    # and on 2.4, which has no static split mode, routes cudagraph_only_prefill steps to the
    # backend and captures them at the decode sizes.
    ((0, True, False), (5, 0), (5, 0)),
    ((1, True, False), (5, 0), (5, 0)),
    ((1, False, False), (5, 4), (5, 0)),
    ((0, True, True), (0, 0), (0, 5)),
    ((1, True, True), (0, 0), (0, 5)),
    ((1, False, True), (0, 4), (0, 5)),
]


@pytest.mark.parametrize("release", FD_VERSIONS)
@pytest.mark.parametrize(
    ("mode", "graphs", "graphs_2_4"), MODE_CASES, ids=[str(m) for m, _, _ in MODE_CASES]
)
def test_graphs_per_backend_follow_the_execution_mode_and_release(
    mode, graphs, graphs_2_4, release
):
    level, full, only_prefill = mode
    plan = derive_plan(
        PlanInput(
            max_num_seqs=16,
            graph_opt_level=level,
            full_cuda_graph=full,
            only_prefill=only_prefill,
            capture_sizes=(1, 2, 4, 8, 16),
            capture_sizes_prefill=(1, 2, 4, 8) if release != "2.4" else None,
            fastdeploy_version=release,
        )
    )
    (backend,) = plan.backends
    expected = graphs_2_4 if release == "2.4" else graphs
    assert (backend.decode_graphs, backend.prefill_graphs) == expected
    if only_prefill:
        assert backend.decode.startswith("eager")
    elif release == "2.4" and level:
        assert backend.decode.startswith("Paddle-managed static graphs")
    elif level and full:
        assert "FastDeploy's own backend runs these eagerly" in backend.decode
    else:
        assert backend.decode.startswith("plugin CUDA graphs")


@pytest.mark.parametrize(
    ("release", "graphs"), [("2.4", 35), ("2.5", 0), ("2.6", 0), ("develop", 0)]
)
def test_only_prefill_in_dynamic_mode_captures_only_where_the_release_routes_prefill(
    release, graphs, capsys
):
    """From 2.5 GraphOptBackend sends prefill steps to the backend only in static split mode,
    so dynamic cudagraph_only_prefill captures nothing; 2.4 routes the prefill-only steps its
    runner flags and captures one graph per decode size (512 with cudagraph_only_prefill)."""
    argv = ["plan", *graph_config(cudagraph_only_prefill=True), "--max-num-seqs", "16"]
    argv += ["--fastdeploy-version", release]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"target model: {graphs} graphs (0 decode, {graphs} prefill)" in out
    assert f"total graphs: {graphs}" in out


@pytest.mark.parametrize(
    ("release", "graphs"), [("2.4", 34), ("2.5", 27), ("2.6", 27), ("develop", 54)]
)
def test_mtp_at_256_seqs_counts_the_releases_draft_default(release, graphs, capsys):
    """The MTP draft has graphs by default only on develop. 2.5 and later scale the 27 automatic
    sizes by k + 1; 2.4 scales only the cap (512 tokens: 35 sizes) and its MTP capture loop never
    captures size 1, so its target captures 34."""
    argv = ["plan", "--max-num-seqs", "256", *speculative_config(method="mtp")]
    assert main([*argv, "--fastdeploy-version", release]) == 0
    out = capsys.readouterr().out
    assert f"total graphs: {graphs}" in out
    assert ("MTP draft model:" in out) == (release == "develop")


@pytest.mark.parametrize("release", FD_VERSIONS)
def test_max_num_seqs_is_capped_as_the_release_checks_it(release, capsys):
    cap = RULES[release].max_num_seqs
    assert cap == (256 if release in ("2.4", "2.5") else 512)
    base = ["plan", "--fastdeploy-version", release, "--max-num-seqs"]
    assert main([*base, str(cap)]) == 0
    capsys.readouterr()
    assert main([*base, str(cap + 1)]) == 2
    said = (
        f"--max-num-seqs must be at most {cap} on FastDeploy {release}"
        if cap < 512
        else "--max-num-seqs must be an integer in 1..512; got 513."  # the launch line's bound
    )
    assert said in capsys.readouterr().err


def test_default_prefill_list_keeps_512_twice_and_counts_one_graph():
    plan = derive_plan(PlanInput(max_num_seqs=8, graph_opt_level=1, full_cuda_graph=False))
    assert plan.capture_sizes_prefill[:2] == [512, 512] and len(plan.capture_sizes_prefill) == 36
    assert plan.backends[0].prefill_graphs == 35
    assert any("512 twice" in note for note in plan.notes)


def test_static_split_with_user_sizes_warns_about_the_default_prefill_list():
    plan = derive_plan(
        PlanInput(max_num_seqs=8, graph_opt_level=1, full_cuda_graph=False, capture_sizes=(1, 8))
    )
    assert plan.capture_sizes_prefill == [8, 4, 2, 1]
    assert any("cudagraph_capture_sizes_prefill too" in note for note in plan.notes)


def test_prefill_sizes_without_decode_sizes_are_replaced_by_the_automatic_list():
    plan = derive_plan(PlanInput(max_num_seqs=8, capture_sizes_prefill=(1, 16)))
    assert len(plan.capture_sizes_prefill) == 36
    assert any("give cudagraph_capture_sizes too to keep it" in note for note in plan.notes)
    config = make_config(8, cudagraph_capture_sizes_prefill=[1, 16])
    assert config.graph_opt_config.cudagraph_capture_sizes_prefill == plan.capture_sizes_prefill


def test_default_capture_sizes_is_the_plan_list_for_that_many_seqs():
    for seqs in (1, 3, 8, 100, 128, 300, 512):
        assert (
            default_capture_sizes(seqs) == derive_plan(PlanInput(max_num_seqs=seqs)).capture_sizes
        )


def test_format_ranges_groups_runs_of_the_same_size():
    plan = derive_plan(PlanInput(max_num_seqs=8))
    assert format_ranges(plan.real_shape_to_captured_size) == "0->0, 1->1, 2->2, 3-4->4, 5-8->8"


# --------------------------------------------------------------- cross-check with the stand-in

GRID = list(
    itertools.product(
        # FastDeploy refuses max_num_seqs above its release's cap and k outside 1..5.
        [1, 3, 8, 100, 128, 256, 300, 512],  # max_num_seqs
        [None, ("mtp", 1), ("mtp", 2), ("mtp", 5), ("ngram", 3), ("suffix", 1), ("naive", None)],
        [(1, False), (2, True), (3, True), (4, True), (4, False)],  # (tp, sequence-parallel MoE)
        [None, (1, 2, 4, 8, 16, 32), (3, 5, 6, 12, 100, 600), (256,)],  # cudagraph_capture_sizes
        [False, True],  # cudagraph_only_prefill
        ["mixed", "decode"],  # splitwise_role
    )
)


def _compare_with_stand_in(
    release,
    seqs,
    spec,
    parallel,
    sizes,
    only_prefill,
    role="mixed",
    prefill_sizes=None,
    prefill_cap=512,
    use_fastdeploy=False,
) -> list[str]:
    """What differs between the plan and the stand-in ``FDConfig`` of ``release`` for one
    setting: by default the project's copy of the rules; with ``use_fastdeploy`` the plan
    computed by the stand-in itself."""
    _stub_version.use(release)
    tp, sp_moe = parallel
    method, k = spec or (None, None)
    graph = {"cudagraph_only_prefill": only_prefill, "max_capture_shape_prefill": prefill_cap}
    if sizes:
        graph["cudagraph_capture_sizes"] = list(sizes)
    if prefill_sizes:
        graph["cudagraph_capture_sizes_prefill"] = list(prefill_sizes)
    inputs = PlanInput(
        max_num_seqs=seqs,
        spec_method=method,
        num_speculative_tokens=k,
        tensor_parallel_size=tp,
        sequence_parallel_moe=sp_moe,
        only_prefill=only_prefill,
        capture_sizes=sizes,
        capture_sizes_prefill=prefill_sizes,
        max_capture_shape_prefill=prefill_cap,
        splitwise_role=role,
        fastdeploy_version=release,
    )
    rules = RULES[release]
    if seqs > rules.max_num_seqs or (method and method not in rules.spec_methods):
        # FDConfig.check (skipped in test mode) and SpeculativeConfig's method list refuse it.
        with pytest.raises(ConfigError, match=r"at most|has no such method"):
            derive_plan(inputs, use_fastdeploy=use_fastdeploy)
        return []
    speculative = {"method": method} if spec else None
    if k is not None:
        speculative["num_speculative_tokens"] = k
    try:
        config = make_config(
            seqs,
            speculative=speculative,
            tp=tp,
            sequence_parallel_moe=sp_moe,
            splitwise_role=role,
            **graph,
        )
    except AssertionError:  # 2.4 and 2.5: an odd max_num_seqs x (k + 1) under MTP
        with pytest.raises(ConfigError, match="even"):
            derive_plan(inputs, use_fastdeploy=use_fastdeploy)
        return []
    except ValueError:
        # The stand-in cannot build its map from an empty list (FastDeploy builds {0: 0} and fails
        # at the first model call instead). Either way no decode size is left.
        config = None
    theirs = config.graph_opt_config if config else None
    if theirs is None or not theirs.cudagraph_capture_sizes:
        with pytest.raises(ConfigError, match="no decode capture size is left"):
            derive_plan(inputs, use_fastdeploy=use_fastdeploy)
        return []
    plan = derive_plan(inputs, use_fastdeploy=use_fastdeploy)
    settings = Settings.from_fd_config(config, fastdeploy_2_4=release == "2.4")
    checks = {
        "source": plan.from_fastdeploy == use_fastdeploy,
        "cudagraph_capture_sizes": plan.capture_sizes == theirs.cudagraph_capture_sizes,
        "cudagraph_capture_sizes_prefill": (
            plan.capture_sizes_prefill == getattr(theirs, "cudagraph_capture_sizes_prefill", None)
        ),
        "real_shape_to_captured_size": (
            plan.real_shape_to_captured_size == theirs.real_shape_to_captured_size
        ),
        "real_shape_to_captured_size_prefill": (
            plan.real_shape_to_captured_size_prefill
            == (getattr(theirs, "real_shape_to_captured_size_prefill", None) or {})
        ),
        "real_bsz_to_captured_size": (
            plan.real_bsz_to_captured_size
            == (getattr(theirs, "real_bsz_to_captured_size", None) or {})
        ),
        "use_cudagraph": plan.use_cudagraph == theirs.use_cudagraph,
        "draft_model_use_cudagraph": (
            plan.draft_model_use_cudagraph == theirs.draft_model_use_cudagraph
        ),
        # The plugin's own settings, read from that config, capture exactly the plan's list and
        # pad exactly as the plan prints.
        "Settings.capture_sizes": list(settings.capture_sizes) == plan.capture_sizes,
        "Settings.decode_table": dict(enumerate(settings.decode_table)) == plan.padding,
    }
    return [name for name, same in checks.items() if not same]


def _differences(cases, **kwargs) -> dict:
    found = {case: _compare_with_stand_in(*case, **kwargs) for case in cases}
    return {case: names for case, names in found.items() if names}


@pytest.mark.parametrize("release", FD_VERSIONS)
def test_the_copy_of_the_rules_matches_the_stand_in_over_a_grid(release):
    """The project's copy, for every release, against the stand-in's ``FDConfig`` of that release
    (written independently from FastDeploy's branches)."""
    differences = _differences([(release, *case) for case in GRID])
    assert not differences, f"{len(differences)} differ, e.g. {list(differences.items())[:3]}"


@pytest.mark.parametrize("release", FD_VERSIONS)
def test_with_fastdeploy_importable_its_own_fdconfig_computes_the_plan(release):
    """The stand-in is importable here: the plan comes from its FDConfig, for every release."""
    cases = [(release, *case) for case in GRID[::7]]
    differences = _differences(cases, use_fastdeploy=True)
    assert not differences, f"{len(differences)} differ, e.g. {list(differences.items())[:3]}"


PREFILL_GRID = [
    (release, seqs, None, (1, False), sizes, only_prefill, "mixed", prefill_sizes, prefill_cap)
    for release, seqs, sizes, prefill_sizes, prefill_cap, only_prefill in itertools.product(
        FD_VERSIONS,
        [8, 128],  # max_num_seqs
        [None, (1, 2, 4)],  # cudagraph_capture_sizes
        [None, (1, 16, 64, 700)],  # cudagraph_capture_sizes_prefill
        [1, 8, 100, 512, 1024],  # max_capture_shape_prefill
        [False, True],  # cudagraph_only_prefill
    )
]


def test_plan_prefill_lists_match_stand_in_fastdeploy_config():
    differences = _differences(PREFILL_GRID)
    assert not differences, f"{len(differences)} differ, e.g. {list(differences.items())[:3]}"


@pytest.mark.parametrize("fd_version", ["2.4", "develop"], indirect=True)
def test_default_release_is_the_installed_fastdeploys(fd_version):
    plan = derive_plan(PlanInput(max_num_seqs=8))
    assert plan.release == fd_version and plan.from_fastdeploy
    assert plan.rules.startswith(f"FastDeploy {fd_version} rules, computed by the installed")
    other = "develop" if fd_version == "2.4" else "2.4"
    copy = derive_plan(PlanInput(max_num_seqs=8, fastdeploy_version=other))
    assert copy.release == other and not copy.from_fastdeploy
    assert f"follows {fd_version}'s rules" in copy.rules


# --------------------------------------------------------------- command line


def test_cli_plan_json_has_fastdeploy_keys(capsys):
    assert main(["plan", "--max-num-seqs", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cudagraph_capture_sizes"] == DEFAULT_128
    assert out["cudagraph_capture_sizes"] == sorted(out["cudagraph_capture_sizes"], reverse=True)
    assert out["cudagraph_capture_sizes_prefill"][:2] == [512, 512]
    assert out["real_shape_to_captured_size"]["3"] == 4
    assert out["real_shape_to_captured_size"]["128"] == 128
    assert out["total_graphs"] == 19


def test_cli_plan_text_names_modes_and_graph_counts(capsys):
    argv = ["plan", "--max-num-seqs", "64", *speculative_config(method="mtp")]
    graph = graph_config(
        graph_opt_level=1, full_cuda_graph=False, cudagraph_capture_sizes=[1, 2, 4, 8]
    )
    assert main([*argv, *graph]) == 0
    out = capsys.readouterr().out
    assert "static split mode" in out
    assert "cudagraph_capture_sizes (4): 16, 8, 4, 2" in out
    assert "target model: 8 graphs (4 decode, 4 prefill)" in out
    assert "MTP draft model: 8 graphs" in out
    assert "total graphs: 16" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs must be an integer in 1..512; got 0."),
        (
            ["--tensor-parallel-size", "0"],
            "--tensor-parallel-size must be an integer in 1..512; got 0.",
        ),
        (
            graph_config(max_capture_shape_prefill=0),
            "--graph-optimization-config: max_capture_shape_prefill must be an integer in "
            "1..65536; got 0.",
        ),
        (
            speculative_config(method="mtp", num_speculative_tokens=0),
            "--speculative-config num_speculative_tokens must be an integer in 1..5 for mtp",
        ),
        (
            speculative_config(method="ngram", num_speculative_tokens=100000000),
            "--speculative-config: num_speculative_tokens must be an integer in 0..5",
        ),
        (["--max-num-seqs", "513"], "--max-num-seqs must be an integer in 1..512; got 513."),
        (
            ["--max-num-seqs", "300", "--fastdeploy-version", "2.5"],
            "--max-num-seqs must be at most 256 on FastDeploy 2.5",
        ),
        (
            graph_config(max_capture_shape_prefill=1000000000),
            "--graph-optimization-config: max_capture_shape_prefill must be an integer in "
            "1..65536; got 1000000000.",
        ),
        (
            ["--max-num-seqs", "2", *graph_config(cudagraph_capture_sizes=[4, 8])],
            "no decode capture size is left",
        ),
    ],
)
def test_cli_plan_bad_setting_exits_2_naming_it(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


ROUGH_EDGES = [
    # k without a method used to print speculative=none without a word.
    (
        speculative_config(num_speculative_tokens=2),
        "--speculative-config num_speculative_tokens 2 needs a method (mtp, ngram or suffix)",
    ),
    # naive used to print k=0 for k=3 silently.
    (
        speculative_config(method="naive", num_speculative_tokens=3),
        "FastDeploy's NAIVE has no draft tokens",
    ),
    # A tensor-parallel size of 10^11 used to be accepted.
    (
        ["--tensor-parallel-size", "100000000000"],
        "--tensor-parallel-size must be an integer in 1..512; got 100000000000.",
    ),
    (
        [*speculative_config(method="suffix"), "--fastdeploy-version", "2.4"],
        "FastDeploy 2.4 has no such method",
    ),
    (
        [
            *("--max-num-seqs", "3", "--fastdeploy-version", "2.5"),
            *speculative_config(method="mtp", num_speculative_tokens=2),
        ],
        "FastDeploy 2.5 asserts max_num_seqs x (k + 1) is even",
    ),
]


@pytest.mark.parametrize(("argv", "message"), ROUGH_EDGES, ids=[m for _, m in ROUGH_EDGES])
def test_settings_fastdeploy_would_ignore_or_refuse_exit_2_naming_the_flag(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plan", *graph_config(cudagraph_capture_sizes=[-1, 2])],
            "--graph-optimization-config: each cudagraph_capture_sizes entry must be an integer "
            "in 1..2147483647; got -1.",
        ),
        (
            ["plan", *graph_config(cudagraph_capture_sizes_prefill=[-8])],
            "each cudagraph_capture_sizes_prefill entry must be an integer in 1..2147483647; "
            "got -8.",
        ),
        (["demo", "--sizes", "-4,8"], "--sizes: sizes must be positive integers"),
        (["plan", "--max-num-seqs", "-5"], "--max-num-seqs must be an integer in 1..512; got -5."),
        (["plan", "-tp", "-2"], "--tensor-parallel-size must be an integer in 1..512; got -2."),
    ],
)
def test_a_negative_value_is_checked_as_a_value_not_taken_for_an_option(argv, message, capsys):
    """A negative value (``--max-num-seqs -5``) is checked as a value: argparse once said
    "expected one argument"."""
    try:
        code = main(argv)
    except SystemExit as exit_info:  # demo's own option: argparse's usage error
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "expected one argument" not in err


@pytest.mark.parametrize(
    ("release", "role"),
    [("2.4", "mixed"), ("2.4", "decode"), ("2.6", "decode"), ("develop", "decode")],
)
def test_the_printed_map_is_the_one_the_plugin_pads_with_after_the_tp_filter(release, role, capsys):
    """With sequence-parallel MoE (expert parallelism over TP 3) FastDeploy keeps [24] of
    [24, 16, 8, 4, 2, 1] but its map still sends 1 token to a graph of size 1; the plan prints
    what the plugin uses. 2.4 also puts a 0 first under expert parallelism, which is no graph."""
    argv = ["plan", "--max-num-seqs", "24", "--tensor-parallel-size", "3"]
    argv += ["--enable-expert-parallel", "--splitwise-role", role, "--fastdeploy-version", release]
    assert main(argv) == 0
    out = capsys.readouterr().out
    kept = "(2): 0, 24" if release == "2.4" else "(1): 24"
    assert f"cudagraph_capture_sizes {kept}\n" in out
    (line,) = [x for x in out.splitlines() if x.startswith("real_shape_to_captured_size")]
    assert line.endswith(": 0->0, 1-24->24") and "FastDeploy's own is stale" in line
    assert "still maps 16 token counts to removed sizes 1, 2, 4, 8, 16" in out
    plan = derive_plan(
        PlanInput(
            24,
            tensor_parallel_size=3,
            sequence_parallel_moe=True,
            expert_parallel=True,
            splitwise_role=role,
            fastdeploy_version=release,
        )
    )
    assert plan.real_shape_to_captured_size[1] == 1  # FastDeploy's own, in --json
    assert set(plan.padding.values()) == {0, 24}


def test_unknown_splitwise_role_exits_2_naming_the_roles(capsys):
    assert main(["plan", "--splitwise-role", "both"]) == 2
    err = capsys.readouterr().err
    assert "--splitwise-role must be one of mixed, prefill, decode; got 'both'." in err


def test_prefill_node_without_only_prefill_captures_nothing():
    plan = derive_plan(PlanInput(max_num_seqs=8, splitwise_role="prefill"))
    assert not plan.use_cudagraph and plan.total_graphs == 0
    assert any("give cudagraph_only_prefill true" in note for note in plan.notes)
    graphed = derive_plan(
        PlanInput(
            max_num_seqs=8,
            splitwise_role="prefill",
            only_prefill=True,
            graph_opt_level=1,
            full_cuda_graph=False,
        )
    )
    assert graphed.use_cudagraph and graphed.total_graphs > 0


def test_prefill_node_with_only_prefill_still_filters_for_sequence_parallel_moe():
    plan = derive_plan(
        PlanInput(
            max_num_seqs=16,
            tensor_parallel_size=4,
            sequence_parallel_moe=True,
            splitwise_role="prefill",
            only_prefill=True,
        )
    )
    assert plan.filtered_for_tp and all(size % 4 == 0 for size in plan.capture_sizes)


@pytest.mark.parametrize(("draft_graphs", "backends"), [(True, 2), (False, 1)])
def test_mtp_draft_backend_follows_draft_model_use_cudagraph(draft_graphs, backends):
    plan = derive_plan(
        PlanInput(max_num_seqs=8, spec_method="mtp", draft_model_use_cudagraph=draft_graphs)
    )
    assert len(plan.backends) == backends


def test_cli_plan_takes_the_role_and_the_draft_flag(capsys):
    argv = ["plan", "--max-num-seqs", "16", "--tensor-parallel-size", "4"]
    assert main([*argv, "--enable-expert-parallel", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cudagraph_capture_sizes"] == [16, 8, 4, 2, 1]
    assert main([*argv, "--enable-expert-parallel", "--splitwise-role", "decode", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cudagraph_capture_sizes"] == [16, 8, 4]
    mtp = speculative_config(method="mtp")
    assert main(["plan", *mtp, *graph_config(draft_model_use_cudagraph=False)]) == 0
    assert "MTP draft model:" not in capsys.readouterr().out


# --------------------------------------------------------------- FastDeploy's own flags


def _plan_json(argv: list[str], capsys) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("fastdeploy", "settings"),
    [
        (graph_config(cudagraph_capture_sizes=[1, 2, 4]), {"capture_sizes": (1, 2, 4)}),
        (
            speculative_config(method="mtp", num_speculative_tokens=2),
            {"spec_method": "mtp", "num_speculative_tokens": 2},
        ),
        (
            speculative_config(method="ngram_match", num_speculative_tokens=1),
            {"spec_method": "ngram"},
        ),
        (
            graph_config(
                graph_opt_level=1,
                full_cuda_graph=False,
                cudagraph_only_prefill=True,
                max_capture_shape_prefill=64,
                use_cudagraph=True,
            ),
            {
                "graph_opt_level": 1,
                "full_cuda_graph": False,
                "only_prefill": True,
                "max_capture_shape_prefill": 64,
            },
        ),
        (
            ["-tp", "4", "--enable-expert-parallel", "--splitwise-role", "decode"],
            {
                "tensor_parallel_size": 4,
                "sequence_parallel_moe": True,
                "expert_parallel": True,
                "splitwise_role": "decode",
            },
        ),
        (
            [
                *("-tp", "4", "--enable-expert-parallel", "--disable-sequence-parallel-moe"),
                *("--splitwise-role", "decode"),
            ],
            {"tensor_parallel_size": 4, "expert_parallel": True, "splitwise_role": "decode"},
        ),
    ],
    ids=["capture sizes", "mtp", "ngram_match", "levels", "expert parallel", "SP-MoE disabled"],
)
def test_fastdeploys_own_flags_plan_what_the_settings_they_name_plan(fastdeploy, settings, capsys):
    """Each key of FastDeploy's JSON and each of its flags is the setting it names: the launch
    line plans what those settings plan (ngram_match is ngram; expert parallelism over TP 4 turns
    sequence-parallel MoE on)."""
    base = ["--max-num-seqs", "16", "--fastdeploy-version", "2.6"]
    theirs = _plan_json([*base, *fastdeploy], capsys)
    ours = derive_plan(PlanInput(max_num_seqs=16, fastdeploy_version="2.6", **settings)).to_json()
    for document in (theirs, ours):
        document.pop("notes"), document.pop("rules")  # the rules line says which parser read it
    assert theirs == ours


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        (
            "--graph-optimization-config",
            '{"cudagraph_capture_size": [1]}',
            "'cudagraph_capture_size' is no key of FastDeploy's config (did you mean "
            "cudagraph_capture_sizes?)",
        ),
        ("--graph-optimization-config", '{"use_cudagraph": 1}', "use_cudagraph must be true"),
        ("--graph-optimization-config", '{"cudagraph_capture_sizes": []}', "non-empty list"),
        ("--graph-optimization-config", '{"graph_opt_level": 3}', "graph_opt_level must be"),
        ("--graph-optimization-config", "[1, 2]", "must be a JSON object; got list"),
        ("--graph-optimization-config", "{use_cudagraph: true}", "is not valid JSON"),
        ("--speculative-config", '{"method": "eagle"}', "method must be one of"),
        ("--speculative-config", '{"num_speculative_tokens": 9}', "in 0..5"),
        ("--speculative-config", '{"method": "ngram", "num_model_steps": 2}', "MTP only"),
        ("--graph-optimization-config", "x" * 70000, "at most 65536 are read"),
    ],
    ids=lambda v: v[:30] if isinstance(v, str) else v,
)
@pytest.mark.parametrize("release", ["2.6", "develop"], ids=["copy", "FastDeploy's parser"])
def test_fastdeploys_json_is_checked_as_fastdeploy_takes_it_in_one_line(
    flag, value, said, release, capsys
):
    """Read by the small parser (2.6 here) or by the stand-in's own (develop): the same checks,
    except JSON that FastDeploy's parser cannot load, which it refuses in its own words."""
    assert main(["plan", "--fastdeploy-version", release, flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    try:
        json.loads(value)
    except ValueError:
        if release == "develop":
            refused = "fd-cudagraph: FastDeploy 2.6.0's own parser refuses this launch line: "
            assert err.startswith(refused) and f"argument {flag}: invalid loads value" in err
            return
    assert said in err and err.startswith(f"fd-cudagraph: {flag}")


def test_keys_that_change_nothing_captured_are_named_and_use_cudagraph_false_captures_nothing(
    capsys,
):
    config = '{"use_cudagraph": false, "cudagraph_num_of_warmups": 3}'
    assert main(["plan", "--graph-optimization-config", config]) == 0
    out = capsys.readouterr().out
    assert "total graphs: 0" in out and "use_cudagraph is false" in out
    assert "cudagraph_num_of_warmups change nothing FastDeploy captures" in out


def test_num_model_steps_raises_k_for_mtp_as_speculative_config_does():
    plan = derive_plan(PlanInput(8, spec_method="mtp", num_model_steps=3))
    assert plan.num_speculative_tokens == 3
    assert any("num_model_steps 3 raises num_speculative_tokens to 3" in n for n in plan.notes)


# --------------------------------------------------------------- fastdeploy-gpu versions


@pytest.mark.parametrize(
    ("version", "tree"),
    [
        ("2.4", "2.4"),
        ("2.4.1", "2.4"),
        ("2.5.0.post1", "2.5"),
        ("2.5", "2.5"),
        ("2.6.1", "2.6"),
        ("2.6.0rc1", "2.6"),
        ("v2.6", "2.6"),
        ("develop", "develop"),
        ("2.5-cherry-pick", "2.5-cherry-pick"),
    ],
)
def test_a_fastdeploy_gpu_version_is_answered_by_its_release_lines_rules(version, tree, capsys):
    document = _plan_json(["--fastdeploy-version", version], capsys)
    assert document["fastdeploy_version"] == tree
    assert document["fastdeploy_version_asked"] == version
    assert document["rules_branch"] == RULES[tree].branch
    assert document["format"] == "fd-cudagraph-plan/1"
    main(["plan", "--fastdeploy-version", version])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"rules: FastDeploy {tree} rules")
    assert (f"(for fastdeploy-gpu {version})" in first) == (version != tree)


@pytest.mark.parametrize(
    ("version", "said"),
    [
        ("2.7.0", "fastdeploy-gpu 2.7.0 is no release line these rules were read for"),
        ("2.3", "no release line"),
        ("2.6.0-dev", "is a development build, which no version string places"),
        ("2.3.0-dev", "2.4_r3 says 2.3.0-dev"),
        ("2.6.0.dev0", "Pass the release line its tree was cut for (2.4, 2.5 or 2.6), or develop"),
        ("latest", "must be a fastdeploy-gpu version"),
    ],
)
def test_a_version_no_rules_answer_is_one_line_saying_which_do(version, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--fastdeploy-version", version])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert said in line and "--fastdeploy-version" in line


@pytest.mark.parametrize("release", ["2.5", "2.6"])
def test_saturation_under_ngram_is_checked_in_tokens_where_fastdeploy_does_not_scale(
    release, capsys
):
    """ngram on 2.5 and 2.6 keys graphs by token count without scaling the cap: a verify step
    carries up to max_num_seqs x (k + 1) tokens, and no list can hold those above the cap."""
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    argv = ["plan", "--max-num-seqs", "64", "--speculative-config", config, "--json"]
    assert main([*argv, "--fastdeploy-version", release]) == 0
    (warning,) = json.loads(capsys.readouterr().out)["warnings"]
    assert "below max_num_seqs 64 x (k + 1) = 192 tokens" in warning
    assert "steps of 65..192 tokens run eagerly whatever the list" in warning
    assert "Add a size" not in warning  # no size above the cap would be kept
    # develop scales ngram: its largest graph holds 192 tokens, nothing to warn of.
    assert main([*argv, "--fastdeploy-version", "develop"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []


# ------------------------------------------------------- FD_CUDAGRAPH_FIT: what recaptures make


@pytest.mark.parametrize(
    ("value", "budget"),
    [
        ("graphs:2", "at most 2 graphs"),
        (
            "padding:10",
            "with the fewest graphs whose padding on those steps is at most 10% above the whole "
            "list's",
        ),
    ],
)
def test_fd_cudagraph_fit_says_recaptures_make_a_subset_of_the_decode_list(
    value, budget, monkeypatch, capsys
):
    monkeypatch.setenv("FD_CUDAGRAPH_FIT", value)
    assert main(["plan", "--max-num-seqs", "8", "--fastdeploy-version", "2.6"]) == 0
    note = capsys.readouterr().out.splitlines()[-1]
    assert note.startswith(
        f"note: FD_CUDAGRAPH_FIT={value} (it fits the decode graphs the plugin captures in "
        "dynamic mode (graph_opt_level 0), as here): each recapture after a lifecycle call"
    )
    assert f"served since the last capture least, {budget}, always with its largest size, 8" in (
        note
    )
    assert (
        "after fewer than 256 decode steps, the whole list (4 sizes). The first capture at start "
        "makes the whole list, or fits to what FD_CUDAGRAPH_STATS_FILE recorded of this same plan "
        "at earlier starts"
    ) in note
    document = _plan_json(["--max-num-seqs", "8", "--fastdeploy-version", "2.6"], capsys)
    assert document["fit"] == {"option": f"FD_CUDAGRAPH_FIT={value}", "applies": True}
    assert document["notes"][-1] == note.removeprefix("note: ")


def test_fd_cudagraph_fit_under_mtp_counts_running_requests_and_fits_the_draft_too(
    monkeypatch, capsys
):
    monkeypatch.setenv("FD_CUDAGRAPH_FIT", "graphs:2")
    mtp = speculative_config(method="mtp", num_speculative_tokens=2)
    argv = ["--max-num-seqs", "8", *mtp, "--fastdeploy-version", "develop", *("-tp", "2")]
    (note,) = [n for n in _plan_json(argv, capsys)["notes"] if "FD_CUDAGRAPH_FIT" in n]
    assert "always with its largest size, 24" in note
    assert "Steps are counted by running requests." in note
    assert "The MTP draft model captures the same sizes." in note
    assert "Rank 0's traffic decides." in note


@pytest.mark.parametrize(
    ("launch", "why"),
    [
        (graph_config(graph_opt_level=1), "this is static full mode"),
        (graph_config(graph_opt_level=1, full_cuda_graph=False), "this is static split mode"),
        (graph_config(cudagraph_only_prefill=True), "with cudagraph_only_prefill no decode graph"),
        (graph_config(use_cudagraph=False), "use_cudagraph is off"),
    ],
    ids=["static full", "static split", "only prefill", "no graphs"],
)
def test_fd_cudagraph_fit_outside_dynamic_decode_graphs_changes_nothing(
    launch, why, monkeypatch, capsys
):
    monkeypatch.setenv("FD_CUDAGRAPH_FIT", "graphs:2")
    document = _plan_json(["--max-num-seqs", "8", "--fastdeploy-version", "2.6", *launch], capsys)
    assert document["fit"] == {"option": "FD_CUDAGRAPH_FIT=graphs:2", "applies": False}
    assert document["notes"][-1].startswith(
        f"FD_CUDAGRAPH_FIT=graphs:2 changes nothing here: {why}"
    )
    assert document["notes"][-1].endswith(
        "it fits only the decode graphs the plugin captures in dynamic mode (graph_opt_level 0)."
    )


@pytest.mark.parametrize("value", [None, "off", ""])
def test_without_fd_cudagraph_fit_the_plan_says_nothing_of_it(value, monkeypatch, capsys):
    if value is not None:
        monkeypatch.setenv("FD_CUDAGRAPH_FIT", value)
    document = _plan_json(["--max-num-seqs", "8"], capsys)
    assert document["fit"] is None
    assert not any("FD_CUDAGRAPH_FIT" in note for note in document["notes"])


@pytest.mark.parametrize("value", ["graphs:0", "padding:x", "many"])
def test_a_bad_fd_cudagraph_fit_is_the_error_register_gives(value, monkeypatch, capsys):
    from fd_cudagraph_plugin.core.options import PluginOptions

    monkeypatch.setenv("FD_CUDAGRAPH_FIT", value)
    with pytest.raises(ConfigError) as error:
        PluginOptions.from_env()
    assert main(["plan", "--max-num-seqs", "8"]) == 2
    assert capsys.readouterr().err == f"fd-cudagraph: {error.value}\n"


@pytest.mark.parametrize("release", FD_VERSIONS)
@pytest.mark.parametrize(
    "graph",
    [
        {},
        {"graph_opt_level": 1},
        {"graph_opt_level": 1, "full_cuda_graph": False},
        {"cudagraph_only_prefill": True},
    ],
    ids=["dynamic", "static full", "static split", "only prefill"],
)
@pytest.mark.parametrize("speculative", [None, {"method": "mtp", "num_speculative_tokens": 1}])
def test_the_plans_mode_is_the_one_the_plugins_settings_read_from_that_config(
    release, graph, speculative
):
    """Where the fit applies is core.mode.Mode's answer, for the mode the plugin reads from the
    stand-in's FDConfig of the same settings."""
    _stub_version.use(release)
    config = make_config(8, speculative=speculative, **graph)
    settings = Settings.from_fd_config(config, fastdeploy_2_4=release == "2.4")
    inputs = PlanInput(
        max_num_seqs=8,
        spec_method=(speculative or {}).get("method"),
        num_speculative_tokens=(speculative or {}).get("num_speculative_tokens"),
        graph_opt_level=graph.get("graph_opt_level", 0),
        full_cuda_graph=graph.get("full_cuda_graph", True),
        only_prefill=graph.get("cudagraph_only_prefill", False),
        fastdeploy_version=release,
    )
    mode = derive_plan(inputs, use_fastdeploy=False).capture_mode
    ours, theirs = mode, settings.mode
    for name in ("kind", "only_prefill", "keyed_by_running", "decode_sizes", "fittable"):
        assert getattr(ours, name) == getattr(theirs, name), name
