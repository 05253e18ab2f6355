"""The capture-plan check over a real ``paddle.distributed`` group: two CPU ranks (gloo).

One launch of ``paddle.distributed.launch`` runs every scenario of ``tp_worker.py`` (starting the
ranks costs far more than the scenarios), and each test reads the facts its scenario recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
RANKS = 2
SCENARIOS = (
    "equal-plans",
    "capture-sizes-differ",
    "self-check-error-on-one-rank",
    "self-check-warn-on-one-rank",
)
#: The launch, from start to the last rank's exit, must end within this; each rank also ends
#: itself (with a traceback in its log) a little earlier, should a collective never return.
TIMEOUT_S = 120
RANK_DEADLINE_S = 90


def _kill(launcher: subprocess.Popen, out: Path) -> None:
    """End the launcher and every rank: the launcher starts each rank in a session of its own,
    so killing the launcher's process group alone would leave the ranks running."""
    groups = [launcher.pid]
    for pid_file in out.glob("pid.rank*"):
        groups.append(int(pid_file.read_text()))
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    launcher.wait()


def _logs(log_dir: Path) -> str:
    return "\n".join(
        f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
        for path in sorted(log_dir.glob("workerlog.*"))
    )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """Run every scenario on two ranks; scenario name -> each rank's facts, in rank order."""
    out = tmp_path_factory.mktemp("ranks")
    log_dir = tmp_path_factory.mktemp("launch-log")
    env = {
        **os.environ,
        # The checkout under test, ahead of any installed copy of the plugin.
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--nproc_per_node",
        str(RANKS),
        "--log_dir",
        str(log_dir),
        str(TESTS / "tp_worker.py"),
        "--out",
        str(out),
        "--deadline",
        str(RANK_DEADLINE_S),
    ]
    for name in SCENARIOS:
        command += ["--scenario", name]
    launcher = subprocess.Popen(
        command,
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        launcher_output, _ = launcher.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill(launcher, out)
        pytest.fail(f"the ranks did not finish within {TIMEOUT_S} s\n{_logs(log_dir)}")
    assert launcher.returncode == 0, f"{launcher_output[-3000:]}\n{_logs(log_dir)}"
    results = {}
    for name in SCENARIOS:
        paths = [out / f"{name}.rank{rank}.json" for rank in range(RANKS)]
        missing = [p.name for p in paths if not p.exists()]
        assert not missing, f"no result {missing}\n{_logs(log_dir)}"
        results[name] = [json.loads(p.read_text()) for p in paths]
    return results


def test_equal_plans_pass_the_check_over_the_tp_group_and_every_rank_captures(ranks):
    for facts in ranks["equal-plans"]:
        assert facts["outcome"] == "ok", facts["message"]
        assert facts["exchanges"] == [RANKS]  # one plan exchange, answered by both ranks
        assert facts["captured"] == [8, 4, 2, 1]


def test_differing_capture_sizes_raise_rank_mismatch_with_the_diff_on_every_rank(ranks):
    for rank, facts in enumerate(ranks["capture-sizes-differ"]):
        assert facts["outcome"] == "RankMismatchError"
        assert f"(this is rank {rank})" in facts["message"]
        assert (
            "rank 1: backend0.capture_sizes: rank 0 [8, 4, 2, 1] vs rank 1 [8, 4, 2]"
            in (facts["message"])
        )
        assert facts["exchanges"] == [RANKS]


def test_a_self_check_failure_on_one_rank_stops_every_rank_with_error(ranks):
    for facts in ranks["self-check-error-on-one-rank"]:
        assert facts["outcome"] == "SelfCheckError", facts["message"]
        assert (
            "every rank stops): rank 1: CUDA graph self-check failed for decode size 4"
            in (facts["message"])
        )
        assert facts["exchanges"] == [RANKS, RANKS]  # the plan, then the verdicts


def test_a_self_check_failure_on_one_rank_is_served_eagerly_on_every_rank_with_warn(ranks):
    for facts in ranks["self-check-warn-on-one-rank"]:
        assert facts["outcome"] == "ok", facts["message"]
        assert facts["disabled"] == [4]  # rank 0's own graph of size 4 was fine
        assert facts["exchanges"] == [RANKS, RANKS]
