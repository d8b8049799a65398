"""The CI skip rule of tests/conftest.py: under ``CI=true`` a skip fails the run unless its
reason is on ALLOWED_CI_SKIPS; outside CI a skip stays a skip. Runs pytest on a small test
file with our conftest loaded as a plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SAMPLE = textwrap.dedent('''
    import pytest
    from conftest import skip_on_gpu_host

    def test_plain_skip():
        pytest.skip("shellcheck is not installed")

    @pytest.mark.skipif(True, reason="needs something")
    def test_skip_mark():
        pass

    def test_gpu_host_skip():
        skip_on_gpu_host("a GPU-less host's answer")

    def test_passes():
        pass
''')
MODULE_SKIP = 'import pytest\nnp = pytest.importorskip("no_such_module_here")\n\ndef test_x():\n    pass\n'


def _pytest(tmp_path: Path, ci: str | None, module_skip: bool = False) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    if module_skip:
        (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-rfEs", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def test_under_ci_only_listed_skips_skip(tmp_path):
    cp = _pytest(tmp_path, "true")
    out = cp.stdout
    assert cp.returncode == 1, out + cp.stderr
    # a skip in the test body fails the test; a skip mark (evaluated at set-up) errors it
    assert "FAILED test_sample.py::test_plain_skip" in out and "ERROR test_sample.py::test_skip_mark" in out
    assert "skipped under CI=true: 'shellcheck is not installed'" in out
    assert "skipped under CI=true: 'needs something'" in out
    assert "1 failed, 1 passed, 1 skipped, 1 error" in out, out
    assert "on a GPU host: a GPU-less host's answer" in out  # the allowed one is reported as a skip


def test_under_ci_a_skipped_module_fails_the_run(tmp_path):
    cp = _pytest(tmp_path, "true", module_skip=True)
    assert cp.returncode != 0
    assert "ERROR collecting test_module_skip.py" in cp.stdout
    assert "skipped under CI=true: \"could not import 'no_such_module_here'" in cp.stdout, cp.stdout


def test_outside_ci_a_skip_stays_a_skip(tmp_path):
    cp = _pytest(tmp_path, None, module_skip=True)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "1 passed, 4 skipped" in cp.stdout, cp.stdout
