"""The pre-commit hook (.githooks/pre-commit) refuses a staged file ruff would change and lets a clean
one through; `make lint` runs the same checks on the whole tree (pyproject.toml's [tool.ruff])."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / ".githooks" / "pre-commit"
RUFF = Path(sys.executable).with_name("ruff")


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_SYSTEM=os.devnull)
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=env)
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "ruff").symlink_to(RUFF)
    return repo


def _stage_and_hook(repo: Path, source: str) -> subprocess.CompletedProcess:
    (repo / "module.py").write_text(source)
    subprocess.run(["git", "add", "module.py"], cwd=repo, check=True)
    return subprocess.run([str(HOOK)], cwd=repo, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not RUFF.exists(), reason="ruff is in the dev extra (make setup)")
@pytest.mark.parametrize(
    "source, passes",
    [
        ("import os\n\n\ndef main():\n    return 1\n", False),  # an unused import
        ("def main():\n    return undefined_name\n", False),  # an undefined name
        ("def main( ):\n  return 1\n", False),  # not formatted
        ("import os\n\n\ndef main():\n    return os.sep\n", True),
    ],
)
def test_the_hook_checks_staged_files(tmp_path, source, passes):
    result = _stage_and_hook(_repo(tmp_path), source)
    assert (result.returncode == 0) == passes, result.stdout + result.stderr
    if not passes:
        assert "ruff found problems" in result.stdout
