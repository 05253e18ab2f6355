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
from fd_cudagraph_plugin.tools.doctor import FAIL, OK, WARN

STUB = Path(__file__).resolve().parent / "fastdeploy_stub"
READY = {"FD_PLUGINS": ENTRY_POINT_NAME, "FD_CUDAGRAPH_RUNTIME": "simulated"}


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


@pytest.mark.parametrize("check", [doctor.check_paddle, doctor.check_cuda_graphs])
def test_cpu_paddle_fails_for_serving_and_warns_on_the_simulated_runtime(check):
    import paddle

    if paddle.is_compiled_with_cuda():
        pytest.skip("this Paddle has CUDA")
    failed = check({})
    assert failed.status == FAIL and "paddlepaddle-gpu" in failed.fix
    warned = check({"FD_CUDAGRAPH_RUNTIME": "simulated"})
    assert warned.status == WARN and "simulated" in warned.detail


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
        ("cuda", "this Paddle is not compiled with CUDA"),  # this machine's Paddle is a CPU build
    ],
)
def test_doctor_says_when_the_plugin_stands_aside_as_register_logs_it(device, why, capsys):
    import paddle
    from fastdeploy.platforms import current_platform

    if paddle.is_compiled_with_cuda():
        pytest.skip("this Paddle has CUDA")
    current_platform.device_name = device
    assert main(["doctor"]) == 1
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("FAIL  platform")]
    assert line.startswith("FAIL  platform: fd-cudagraph-plugin") and why in line
    assert "stands aside" in line and "keeps its own CUDA-graph backend" in line


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
    result = doctor.check_options({"FD_CUDAGRAPH_RUNTIME": "simulated"})
    assert result.status == OK and "FD_CUDAGRAPH_RUNTIME=simulated; the other" in result.detail


@pytest.mark.parametrize(("importable", "status"), [(True, OK), (False, WARN)])
def test_metrics_without_prometheus_client_warn_with_the_fix(importable, status, monkeypatch):
    """FD_CUDAGRAPH_METRICS=1 exports nothing without prometheus_client (metrics.py logs it)."""
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
    assert all(r.status in (OK, WARN, FAIL) for r in results)
    assert all("\n" not in r.line() for r in results)


def test_exit_code_is_0_when_ready_and_1_on_any_fail(monkeypatch, capsys):
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


def test_with_the_stand_in_fastdeploy_the_doctor_passes(tmp_path):
    done = _doctor_subprocess(tmp_path, pythonpath=str(STUB))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK    FastDeploy: FastDeploy 2.6.0 imports" in done.stdout


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


@pytest.mark.parametrize("special", ["/dev/full", "fifo"])
def test_doctor_warns_of_an_output_path_that_is_no_regular_file(tmp_path, special):
    # Before: OK, while every write the plugin then made was refused.
    if special == "fifo":
        special = str(tmp_path / "fifo")
        os.mkfifo(special)
    result = doctor.check_options({"FD_CUDAGRAPH_STATS_FILE": special})
    assert result.status == WARN
    assert f"FD_CUDAGRAPH_STATS_FILE names {special}, which is no regular file" in result.detail
