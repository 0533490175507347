"""A skipped real-engine tier is named, with its reason, in the last lines of the run (issue 27)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_skipped_tier_is_reported_just_above_the_closing_count(tmp_path: Path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "tiers.py").write_text((ROOT / "tests" / "tiers.py").read_text())
    (tmp_path / "tests" / "conftest.py").write_text("from tests.tiers import pytest_terminal_summary  # noqa\n")
    (tmp_path / "tests" / "test_x.py").write_text(textwrap.dedent('''
        import pytest

        def test_plain():
            pass

        @pytest.mark.e2e
        def test_engine_a():
            pytest.skip("e2e venv not installed: torch wheel missing")

        @pytest.mark.e2e
        def test_engine_b():
            pytest.skip("e2e venv not installed: torch wheel missing")

        @pytest.mark.kernel
        def test_kernel():
            pytest.skip("kernel eBPF tests need root")

        def test_unrelated_skip():
            pytest.skip("not a tier")
    '''))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    e2e: x\n    kernel: y\npythonpath = .\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120).stdout.strip().splitlines()
    assert "1 passed, 4 skipped" in out[-1], out[-5:]
    assert out[-3:-1] == ["e2e tier: 2 tests skipped: e2e venv not installed: torch wheel missing",
                          "kernel tier: 1 test skipped: kernel eBPF tests need root"], out[-6:]
    assert not any("not a tier" in line for line in out[-4:])


def test_the_suite_conftest_installs_the_hook():
    """The run above uses the hook from tests/tiers.py; the suite's own conftest must install it."""
    import tests.conftest
    import tests.tiers

    assert tests.conftest.pytest_terminal_summary is tests.tiers.pytest_terminal_summary
