"""The docs stay true: every option is documented, the quick-start commands are the CI's, and
design.md keeps rules and dated figures, not version history."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fd_cudagraph_plugin.core.options import OPTIONS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_option_is_in_the_readme_table_with_its_values():
    for option in OPTIONS:
        row = next(
            (line for line in README.splitlines() if line.startswith(f"| `{option.env}`")), ""
        )
        assert row, f"{option.env} missing from the README options table"
        for value in option.choices or (option.default,):
            if value:
                assert f"`{value}`" in row, f"{option.env}: value {value} missing from its row"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'pip install -e ".[test]" && python -m pytest -q\n' in README
    assert 'pip install -q -e ".[test]"' in ci and "python -m pytest -q" in ci.splitlines()


def test_the_readme_test_command_runs_in_a_temporary_directory_of_its_own(
    request, tmp_path_factory
):
    """Another pytest of the same user rotates pytest's shared /tmp/pytest-of-<user> and once
    removed this run's files mid-run; the README's command, without --basetemp, never uses it."""
    made = getattr(request.config, "_fd_cudagraph_basetemp", None)
    if made is None:
        pytest.skip("--basetemp named this run's directory")
    basetemp = tmp_path_factory.getbasetemp()
    assert basetemp == Path(made).resolve() and "pytest-of-" not in str(basetemp)


def test_design_doc_keeps_rules_and_dated_figures_not_version_history():
    """What each version changed and measured lives in CHANGELOG.md; design.md names no plugin
    version and no commit (Paddle's and FastDeploy's releases are sources, not history)."""
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    versions = re.findall(r"\b0\.\d+\.\d+\b", design)
    commits = re.findall(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", design)
    assert not versions and not commits, (versions, commits)
