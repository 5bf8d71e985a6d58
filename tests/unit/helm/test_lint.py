"""`make lint`'s chart check: helm lint --strict and helm template with every values file."""

from __future__ import annotations

import subprocess

from tests.support.helm import CI_VALUES, REPO


def test_lint_script_is_clean_for_default_and_every_ci_values_file() -> None:
    result = subprocess.run([str(REPO / "tools" / "helm" / "lint.sh")], check=False,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    checked = [line.removeprefix("== ") for line in result.stderr.splitlines()
               if line.startswith("== ")]
    assert checked == ["default values", *(str(p.relative_to(REPO)) for p in CI_VALUES)]
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout
