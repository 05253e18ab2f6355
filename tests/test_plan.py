"""``fd-cudagraph plan`` derives what FastDeploy derives, and says what each backend captures."""

from __future__ import annotations

import itertools
import json

import pytest
from conftest import make_config

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.settings import Settings
from fd_cudagraph_plugin.tools.capture_rules import default_capture_sizes
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


def test_naive_keeps_token_keys_and_k_without_method_is_noted():
    naive = derive_plan(PlanInput(max_num_seqs=8, spec_method="naive", num_speculative_tokens=3))
    assert naive.num_speculative_tokens == 0 and naive.real_bsz_to_captured_size == {}
    assert naive.capture_sizes == [8, 4, 2, 1]
    plain = derive_plan(PlanInput(max_num_seqs=8, num_speculative_tokens=2))
    assert plain.capture_sizes == [8, 4, 2, 1]
    assert any("no effect without --spec-method" in note for note in plain.notes)


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
    # (graph_opt_level, full_cuda_graph, only_prefill) -> (decode graphs, prefill graphs)
    ((0, True, False), (5, 0)),
    ((1, True, False), (5, 0)),
    ((1, False, False), (5, 4)),
    ((0, True, True), (0, 5)),
    ((1, True, True), (0, 5)),
    ((1, False, True), (0, 4)),
]


@pytest.mark.parametrize(("mode", "graphs"), MODE_CASES, ids=[str(m) for m, _ in MODE_CASES])
def test_graphs_per_backend_follow_the_execution_mode(mode, graphs):
    level, full, only_prefill = mode
    plan = derive_plan(
        PlanInput(
            max_num_seqs=16,
            graph_opt_level=level,
            full_cuda_graph=full,
            only_prefill=only_prefill,
            capture_sizes=(1, 2, 4, 8, 16),
            capture_sizes_prefill=(1, 2, 4, 8),
        )
    )
    (backend,) = plan.backends
    assert (backend.decode_graphs, backend.prefill_graphs) == graphs
    if only_prefill:
        assert backend.decode.startswith("eager")
    elif level and full:
        assert "FastDeploy's own backend runs these eagerly" in backend.decode
    else:
        assert backend.decode.startswith("plugin CUDA graphs")


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
    assert any("--capture-sizes-prefill" in note for note in plan.notes)


def test_prefill_sizes_without_decode_sizes_are_replaced_by_the_automatic_list():
    plan = derive_plan(PlanInput(max_num_seqs=8, capture_sizes_prefill=(1, 16)))
    assert len(plan.capture_sizes_prefill) == 36
    assert any("pass --capture-sizes too" in note for note in plan.notes)
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
        # FastDeploy refuses max_num_seqs > 512 and k outside 1..5 (test_fastdeploy_limits_...).
        [1, 3, 8, 100, 128, 256, 300, 512],  # max_num_seqs
        [None, ("mtp", 1), ("mtp", 2), ("mtp", 5), ("ngram", 3), ("suffix", 1), ("naive", 2)],
        [(1, False), (2, True), (3, True), (4, True), (4, False)],  # (tp, sequence-parallel MoE)
        [None, (1, 2, 4, 8, 16, 32), (3, 5, 6, 12, 100, 600), (256,)],  # cudagraph_capture_sizes
        [False, True],  # cudagraph_only_prefill
    )
)


def _compare_with_stand_in(
    seqs, spec, parallel, sizes, only_prefill, prefill_sizes=None, prefill_cap=512
) -> list[str]:
    """What differs between the plan and the stand-in ``FDConfig`` for one setting."""
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
    )
    try:
        config = make_config(
            seqs,
            speculative={"method": method, "num_speculative_tokens": k} if spec else None,
            tp=tp,
            sequence_parallel_moe=sp_moe,
            **graph,
        )
        theirs = config.graph_opt_config
        theirs_sizes = theirs.cudagraph_capture_sizes
    except ValueError:
        # The stand-in cannot build its map from an empty list (FastDeploy builds {0: 0} and fails
        # at the first model call instead). Either way no decode size is left.
        theirs_sizes = []
    if not theirs_sizes:
        with pytest.raises(ConfigError, match="no decode capture size is left"):
            derive_plan(inputs)
        return []
    plan = derive_plan(inputs)
    settings = Settings.from_fd_config(config)
    checks = {
        "cudagraph_capture_sizes": plan.capture_sizes == theirs_sizes,
        "cudagraph_capture_sizes_prefill": (
            plan.capture_sizes_prefill == theirs.cudagraph_capture_sizes_prefill
        ),
        "real_shape_to_captured_size": (
            plan.real_shape_to_captured_size == theirs.real_shape_to_captured_size
        ),
        "real_shape_to_captured_size_prefill": (
            plan.real_shape_to_captured_size_prefill == theirs.real_shape_to_captured_size_prefill
        ),
        "real_bsz_to_captured_size": (
            plan.real_bsz_to_captured_size == theirs.real_bsz_to_captured_size
        ),
        # The plugin's own settings, read from that config, capture exactly the plan's list.
        "Settings.capture_sizes": list(settings.capture_sizes) == plan.capture_sizes,
    }
    return [name for name, same in checks.items() if not same]


def _differences(cases) -> dict:
    found = {case: _compare_with_stand_in(*case) for case in cases}
    return {case: names for case, names in found.items() if names}


def test_plan_matches_stand_in_fastdeploy_config_over_a_grid():
    """The stand-in ``FDConfig`` was written independently from the same documentation."""
    differences = _differences(GRID)
    assert not differences, f"{len(differences)} differ, e.g. {list(differences.items())[:3]}"


PREFILL_GRID = [
    (seqs, None, (1, False), sizes, only_prefill, prefill_sizes, prefill_cap)
    for seqs, sizes, prefill_sizes, prefill_cap, only_prefill in itertools.product(
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
    argv = ["plan", "--max-num-seqs", "64", "--spec-method", "mtp", "--graph-opt-level", "1"]
    assert main([*argv, "--no-full-cuda-graph", "--capture-sizes", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    assert "static split mode" in out
    assert "cudagraph_capture_sizes (4): 16, 8, 4, 2" in out
    assert "target model: 8 graphs (4 decode, 4 prefill)" in out
    assert "MTP draft model: 8 graphs" in out
    assert "total graphs: 16" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1; got 0"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an integer >= 1"),
        (["--max-capture-shape-prefill", "0"], "--max-capture-shape-prefill must be"),
        (["--spec-method", "mtp", "--num-speculative-tokens", "0"], "must be an integer in 1..5"),
        (["--spec-method", "ngram", "--num-speculative-tokens", "100000000"], "in 1..5"),
        (["--max-num-seqs", "513"], "--max-num-seqs must be at most 512; got 513"),
        (["--max-capture-shape-prefill", "1000000000"], "--max-capture-shape-prefill must be at"),
        (["--max-num-seqs", "2", "--capture-sizes", "4,8"], "no decode capture size is left"),
    ],
)
def test_cli_plan_bad_setting_exits_2_naming_it(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_splitwise_role_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--splitwise-role", "both"])
    assert exit_info.value.code == 2
    assert "--splitwise-role: invalid choice: 'both'" in capsys.readouterr().err


def test_prefill_node_without_only_prefill_captures_nothing():
    plan = derive_plan(PlanInput(max_num_seqs=8, splitwise_role="prefill"))
    assert not plan.use_cudagraph and plan.total_graphs == 0
    assert any("--only-prefill" in note for note in plan.notes)
    graphed = derive_plan(PlanInput(max_num_seqs=8, splitwise_role="prefill", only_prefill=True))
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
    assert main([*argv, "--sequence-parallel-moe", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cudagraph_capture_sizes"] == [16, 8, 4, 2, 1]
    assert main([*argv, "--sequence-parallel-moe", "--splitwise-role", "decode", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cudagraph_capture_sizes"] == [16, 8, 4]
    assert main(["plan", "--spec-method", "mtp", "--no-draft-model-use-cudagraph"]) == 0
    assert "MTP draft model:" not in capsys.readouterr().out
