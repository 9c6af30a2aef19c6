"""The repository passes its lint configuration (pyproject.toml's [tool.ruff]: pycodestyle, pyflakes,
import order, bugbear), checked without Ray: a lint failure is a test failure, not a reviewer's note."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_the_repository_passes_ruff():
    result = ruff(str(ROOT))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_with_this_configuration_sees_an_unused_import_and_unsorted_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\nprint(os.sep)\n")
    result = ruff("--config", str(ROOT / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert result.returncode == 1 and "F401" in result.stdout and "I001" in result.stdout, result.stdout
