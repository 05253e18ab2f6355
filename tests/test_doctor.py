"""``fd-cudagraph doctor``: one OK / WARN / FAIL line per check, with the fix; FAIL exits 1."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastdeploy.model_executor.graph_optimization import graph_optimization_backend

from fd_cudagraph_plugin.core.options import OPTIONS
from fd_cudagraph_plugin.plugin import ENTRY_POINT_GROUP, ENTRY_POINT_NAME
from fd_cudagraph_plugin.tools import doctor
from fd_cudagraph_plugin.tools.cli import main
from fd_cudagraph_plugin.tools.doctor import FAIL, OK, SKIP, WARN

STUB = Path(__file__).resolve().parent / "fastdeploy_stub"
READY = {"FD_PLUGINS": ENTRY_POINT_NAME}


def _entry_points(*points: importlib.metadata.EntryPoint):
    def lookup(group: str):
        return [p for p in points if p.group == group]

    return lookup


def _point(value: str, name: str = ENTRY_POINT_NAME) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


# --------------------------------------------------------------- entry point


def test_entry_point_of_the_installed_package_is_found_and_loads():
    result = doctor.check_entry_point({})
    assert result.status == OK
    assert "fd_cudagraph_plugin.plugin:register" in result.detail


def test_missing_entry_point_fails_with_an_install_command_that_works():
    """The plugin is not on PyPI: the fix installs a checkout or a wheel, never a name there."""
    result = doctor.check_entry_point({}, entry_points=_entry_points())
    assert result.status == FAIL and "pip install /path/to/fd-cudagraph-plugin" in result.fix
    assert "fd_cudagraph_plugin-" in result.fix and "not on PyPI" in result.fix


@pytest.mark.parametrize(
    "points",
    [
        [_point("fd_cudagraph_plugin_missing_module:register")],
        [_point("fd_cudagraph_plugin.plugin:register"), _point("other:register")],
        [],
    ],
    ids=["does not load", "installed twice", "missing"],
)
def test_no_fix_installs_the_plugin_by_name_from_an_index(points):
    result = doctor.check_entry_point({}, entry_points=_entry_points(*points))
    words = [word.strip(".,;()") for word in result.fix.split()]
    installs = [words[i + 1 : i + 3] for i, w in enumerate(words) if w == "install"]
    assert installs and all(doctor.DISTRIBUTION not in args for args in installs), result.fix


def test_entry_point_that_does_not_load_fails():
    broken = _point("fd_cudagraph_plugin_missing_module:register")
    result = doctor.check_entry_point({}, entry_points=_entry_points(broken))
    assert result.status == FAIL and "does not load" in result.detail


def test_entry_point_installed_twice_warns():
    points = _entry_points(_point("fd_cudagraph_plugin.plugin:register"), _point("other:register"))
    result = doctor.check_entry_point({}, entry_points=points)
    assert result.status == WARN and "installed 2 times" in result.detail


# --------------------------------------------------------------- FD_PLUGINS

FD_PLUGINS_CASES = [
    (None, FAIL, "PR #4909"),
    ("fd_cudagraph_plugin", OK, "names fd_cudagraph_plugin"),
    ("fd_add_dummy_model,fd_cudagraph_plugin", OK, "names fd_cudagraph_plugin"),
    ("fd-cudagraph-plugin", FAIL, "names the distribution fd-cudagraph-plugin"),
    ("fd_add_dummy_model, fd_cudagraph_plugin", FAIL, "without stripping"),
    ("fd_add_dummy_model", FAIL, "does not name fd_cudagraph_plugin"),
    ("", FAIL, "does not name fd_cudagraph_plugin"),
]


@pytest.mark.parametrize(("value", "status", "detail"), FD_PLUGINS_CASES)
def test_fd_plugins_must_name_the_entry_point(value, status, detail):
    environ = {} if value is None else {"FD_PLUGINS": value}
    result = doctor.check_fd_plugins(environ)
    assert result.status == status and detail in result.detail
    if status == FAIL:
        assert "export FD_PLUGINS=fd_cudagraph_plugin" in result.fix


# --------------------------------------------------------------- FastDeploy


def test_fastdeploy_imports_and_has_the_three_argument_backend():
    result = doctor.check_fastdeploy({})
    assert result.status == OK
    assert "(fd_config, dy_runnable, runnable)" in result.detail and "2.5 or later" in result.detail


def test_fastdeploy_2_4_has_the_two_argument_backend():
    graph_optimization_backend.emulate_release_2_4()
    try:
        result = doctor.check_fastdeploy({})
    finally:
        graph_optimization_backend.emulate_release_2_4(False)
    assert result.status == OK and "(fd_config, runnable) (2.4)" in result.detail


def test_fastdeploy_shape_is_read_from_the_native_class_after_register(plugin_registered):
    result = doctor.check_fastdeploy({})
    assert result.status == OK and "(fd_config, dy_runnable, runnable)" in result.detail


def test_fastdeploy_without_the_backend_name_fails(monkeypatch):
    monkeypatch.delattr(graph_optimization_backend, "CudaGraphPiecewiseBackend")
    result = doctor.check_fastdeploy({})
    assert result.status == FAIL and "has no CudaGraphPiecewiseBackend" in result.detail


# --------------------------------------------------------------- Paddle and CUDA graphs


def _cpu_paddle() -> None:
    import paddle

    if paddle.is_compiled_with_cuda():
        pytest.skip("this Paddle has CUDA")


@pytest.mark.parametrize("environ", [{}, {"FD_CUDAGRAPH_RUNTIME": "simulated"}], ids=str)
def test_a_cpu_build_of_paddle_is_one_fail_and_the_checks_it_blocks_are_skipped(environ):
    """It was three FAILs for one cause (Paddle, CUDA graphs, platform), the platform's with
    "nothing needs fixing"; the simulated runtime turned two of them into warnings."""
    _cpu_paddle()
    results = {r.name: r for r in doctor.run_checks({"FD_PLUGINS": ENTRY_POINT_NAME, **environ})}
    paddle = results["Paddle"]
    assert paddle.status == FAIL and "CPU build" in paddle.detail
    assert "paddlepaddle-gpu" in paddle.fix and "nothing needs fixing" not in paddle.line()
    for name in ("CUDA graphs", "platform"):
        assert results[name].status == SKIP
        assert results[name].detail == "not checked: see the Paddle line."
    assert [r.name for r in results.values() if r.status == FAIL] == (
        ["Paddle", "options"] if environ else ["Paddle"]
    )


def test_the_simulated_runtime_is_refused_for_serving_saying_how_to_unset_it():
    """doctor passed with the test-only FD_CUDAGRAPH_RUNTIME=simulated set."""
    result = doctor.check_options({"FD_CUDAGRAPH_RUNTIME": "simulated"})
    assert result.status == FAIL and "for the tests and the demo" in result.detail
    assert "unset FD_CUDAGRAPH_RUNTIME" in result.fix


@pytest.mark.parametrize("check", ["check_paddle", "check_cuda_graphs", "check_platform"])
def test_with_fastdeploys_own_backend_the_cuda_runtime_is_not_checked(check):
    """FD_CUDAGRAPH_BACKEND=native: the plugin's CUDA runtime never runs, so no CUDA check fails."""
    result = getattr(doctor, check)({"FD_CUDAGRAPH_BACKEND": "native"})
    assert result.status == OK and "CUDA runtime is not used" in result.detail


@pytest.mark.parametrize(
    ("device", "why"),
    [
        ("xpu", "FastDeploy's platform is XPU, not NVIDIA CUDA"),
        ("maca", "FastDeploy's platform is MetaX (MACA), not NVIDIA CUDA"),
    ],
)
def test_on_another_accelerator_the_plugin_stands_aside_as_register_logs_it(device, why, capsys):
    """By design, not a fault: FastDeploy serves there with its own backend (a WARN, no fix)."""
    from fastdeploy.platforms import current_platform

    _cpu_paddle()
    current_platform.device_name = device
    results = {r.name: r for r in doctor.run_checks({"FD_PLUGINS": ENTRY_POINT_NAME})}
    platform = results["platform"]
    assert platform.status == WARN and not platform.fix
    assert platform.detail.startswith("fd-cudagraph-plugin") and why in platform.detail
    assert "stands aside" in platform.detail and "its own CUDA-graph backend" in platform.detail
    assert results["Paddle"].status == OK and results["CUDA graphs"].status == SKIP
    assert doctor.exit_code(results.values()) == 0
    assert "which stands aside here" in doctor.format_results(list(results.values()))


def test_the_platform_check_passes_where_register_installs_the_plugin(monkeypatch):
    monkeypatch.setattr(doctor, "cuda_runtime_blocker", lambda: None)
    assert doctor.check_platform({}).status == OK
    assert doctor.check_platform({"FD_CUDAGRAPH_RUNTIME": "simulated"}).status == OK


# --------------------------------------------------------------- options


def test_default_options_are_ok():
    result = doctor.check_options({})
    assert result.status == OK and f"all {len(OPTIONS)} at their defaults" in result.detail


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.choices], ids=lambda o: o.env)
def test_every_enumerated_option_with_a_bad_value_fails_naming_it(option):
    result = doctor.check_options({option.env: "no-such-value"})
    assert result.status == FAIL
    assert option.env in result.detail and option.choices[0] in result.detail


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.parse], ids=lambda o: o.env)
def test_free_form_options_are_checked_by_their_parser(option):
    try:
        option.parse("-1?")
    except ValueError:
        result = doctor.check_options({option.env: "-1?"})
        assert result.status == FAIL and option.env in result.detail
    else:
        assert doctor.check_options({option.env: "-1?"}).status == OK


def test_set_options_are_listed():
    result = doctor.check_options({"FD_CUDAGRAPH_POOL": "graph"})
    assert result.status == OK and "FD_CUDAGRAPH_POOL=graph; the other" in result.detail


@pytest.mark.parametrize(("importable", "status"), [(True, OK), (False, WARN)])
def test_metrics_without_prometheus_client_warn_with_the_fix(importable, status, monkeypatch):
    """FD_CUDAGRAPH_METRICS=1 exports nothing without prometheus_client (the plugin logs it)."""
    if not importable:
        monkeypatch.setitem(sys.modules, "prometheus_client", None)
    result = doctor.check_options({"FD_CUDAGRAPH_METRICS": "1"})
    assert result.status == status
    if not importable:
        assert "prometheus_client is not importable" in result.detail
        assert "pip install prometheus_client" in result.fix


def test_native_backend_choice_warns():
    result = doctor.check_options({"FD_CUDAGRAPH_BACKEND": "native"})
    assert result.status == WARN and "keeps its own backend" in result.detail


def test_unknown_option_fails_with_the_closest_known_name_as_register_does():
    result = doctor.check_unknown_options({"FD_CUDAGRAPH_BACKNED": "native", "FD_PLUGINS": "x"})
    assert result.status == FAIL and "register() refuses to start" in result.detail
    assert "FD_CUDAGRAPH_BACKNED (did you mean FD_CUDAGRAPH_BACKEND?)" in result.detail
    assert doctor.check_unknown_options({"FD_CUDAGRAPH_BACKEND": "native"}).status == OK


# --------------------------------------------------------------- whole run and exit code


def test_every_check_returns_one_result_in_order():
    results = doctor.run_checks(READY)
    assert len(results) == len(doctor.CHECKS)
    assert all(r.status in (OK, WARN, FAIL, SKIP) for r in results)
    assert all("\n" not in r.line() for r in results)


@pytest.fixture
def cuda_machine(monkeypatch):
    """What the checks see on an NVIDIA machine with paddlepaddle-gpu."""
    import paddle

    from fd_cudagraph_plugin.core.runtime import cuda

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(cuda, "cuda_graph_support", lambda: True)
    monkeypatch.setattr(doctor, "cuda_runtime_blocker", lambda: None)


def test_exit_code_is_0_when_ready_and_1_on_any_fail(cuda_machine, monkeypatch, capsys):
    for name, value in READY.items():
        monkeypatch.setenv(name, value)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "0 FAIL" in out and "FAIL " not in out.replace("0 FAIL", "")
    monkeypatch.delenv("FD_PLUGINS")
    assert main(["doctor"]) == 1
    assert "FAIL  FD_PLUGINS: unset" in capsys.readouterr().out


REPO = Path(__file__).resolve().parent.parent


def _doctor_subprocess(tmp_path: Path, pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FD_", "PYTHONPATH"))}
    env.update(READY)
    # This checkout first, so the doctor under test runs and not another installed copy.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *([pythonpath] if pythonpath else [])])
    return subprocess.run(
        [sys.executable, "-m", "fd_cudagraph_plugin", "doctor"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_without_fastdeploy_the_doctor_fails_and_says_what_to_install(tmp_path):
    done = _doctor_subprocess(tmp_path, pythonpath=None)
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if "FastDeploy:" in x)
    assert line.startswith("FAIL") and "fastdeploy-gpu" in line
    assert "Traceback" not in done.stderr


def test_with_the_stand_in_fastdeploy_on_this_cpu_machine_only_paddle_fails(tmp_path):
    done = _doctor_subprocess(tmp_path, pythonpath=str(STUB))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "OK    FastDeploy: FastDeploy 2.6.0 imports" in done.stdout
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert [line.split(":")[0] for line in failed] == ["FAIL  Paddle"], done.stdout
    # Paddle's import says nothing here: no ccache warning, no "Can not import paddle core".
    assert done.stderr == ""


def test_a_removed_option_fails_the_options_check_and_is_no_typo():
    environ = {"FD_CUDAGRAPH_AR_REGISTRATION": "session"}
    result = doctor.check_options(environ)
    assert result.status == FAIL
    assert "FD_CUDAGRAPH_AR_REGISTRATION was removed in fd-cudagraph-plugin 0.2" in result.detail
    assert doctor.check_unknown_options(environ).status == OK


def test_a_removed_value_is_one_message_not_also_an_unknown_value():
    # Before: "FD_CUDAGRAPH_POOL=device was removed ..." and "FD_CUDAGRAPH_POOL='device' is not a
    # known value ..." ran together in one detail.
    result = doctor.check_options({"FD_CUDAGRAPH_POOL": "device"})
    assert result.status == doctor.FAIL
    assert "FD_CUDAGRAPH_POOL=device was removed in fd-cudagraph-plugin 0.3" in result.detail
    assert "not a known value" not in result.detail


def test_doctor_warns_of_an_output_path_that_is_no_regular_file(tmp_path):
    # Before: OK, while every write the plugin then made was refused. (A device under /dev is
    # refused with the options.)
    special = str(tmp_path / "fifo")
    os.mkfifo(special)
    result = doctor.check_outputs({"FD_CUDAGRAPH_STATS_FILE": special})
    assert result.status == WARN
    assert f"FD_CUDAGRAPH_STATS_FILE names {special}, which is no regular file" in result.detail


# --------------------------------------------------------------- what the plugin writes


def test_fd_log_dir_unset_is_fastdeploys_log_resolved_from_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = doctor.check_outputs({})
    assert result.status == OK
    assert f"FastDeploy's default {tmp_path / 'log'} ('log' from {tmp_path})" in result.detail
    assert "graph-memory record (FD_CUDAGRAPH_KV_RESERVE=auto reads it back) under " in (
        result.detail
    )
    assert str(tmp_path / "log" / "fd_cudagraph") in result.detail
    assert list(tmp_path.iterdir()) == []  # probed, nothing left


def test_a_relative_fd_log_dir_and_every_output_path_are_said_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    environ = {
        "FD_LOG_DIR": "logs",
        "FD_CUDAGRAPH_DUMP_DOT": "1",
        "FD_CUDAGRAPH_STATS_FILE": "out/stats-{rank}.jsonl",
    }
    result = doctor.check_outputs(environ)
    assert result.status == OK, result.detail
    assert f"FD_LOG_DIR {tmp_path / 'logs'} ('logs' from {tmp_path})" in result.detail
    assert f"dot files (FD_CUDAGRAPH_DUMP_DOT=1) under {tmp_path / 'logs' / 'GraphDotFiles'}" in (
        result.detail
    )
    assert f"FD_CUDAGRAPH_STATS_FILE under {tmp_path / 'out'}" in result.detail


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda tmp: tmp / "a-file", "is a file, not a directory"),
        (lambda tmp: "/proc/fd-cudagraph-log", "cannot create files in /proc"),
        (lambda tmp: "", "is no directory path"),
    ],
    ids=["a file", "proc", "empty"],
)
def test_an_fd_log_dir_the_record_cannot_go_under_fails(make, said, tmp_path):
    (tmp_path / "a-file").write_text("")
    result = doctor.check_outputs({"FD_LOG_DIR": str(make(tmp_path))})
    assert result.status == FAIL and said in result.detail and "FD_LOG_DIR" in result.fix


def test_an_fd_log_dir_name_too_long_fails_naming_fd_log_dir(tmp_path):
    result = doctor.check_outputs({"FD_LOG_DIR": str(tmp_path / ("d" * 256))})
    assert result.status == FAIL and "256 bytes" in result.detail
    assert "FD_LOG_DIR" in result.fix and "shorter name" in result.fix


def test_the_record_directory_is_where_the_reserve_writes_it(tmp_path):
    """The doctor names the directory core/reserve.py writes the record to."""
    from fd_cudagraph_plugin.core import reserve

    record = reserve.Record.for_rank(str(tmp_path), 0, 0)
    (_, path), *_ = doctor._outputs({"FD_LOG_DIR": str(tmp_path)})
    assert path == record.path


def test_doctor_json_says_its_format(capsys):
    main(["doctor", "--json"])
    import json

    document = json.loads(capsys.readouterr().out)
    assert document["format"] == "fd-cudagraph-doctor/1"
    assert {c["status"] for c in document["checks"]} <= {OK, WARN, FAIL, SKIP}
