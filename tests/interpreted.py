"""Running Triton kernel tests under the interpreter from a pytest session that imported triton first.

Triton picks interpreter or compiler when *it* is imported. In a session where another module
imported triton before the test file could set ``TRITON_INTERPRET=1`` (transformers does), the file
reruns itself in a fresh process with the variable set; every other test of it is skipped in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def skip_unless_interpreting(request, subprocess_mode: bool) -> None:
    """Autouse-fixture body: in subprocess mode only ``test_interpreted_in_subprocess`` runs here."""
    if subprocess_mode and request.node.originalname != "test_interpreted_in_subprocess":
        pytest.skip("triton was imported before TRITON_INTERPRET=1: covered by test_interpreted_in_subprocess")


def rerun_interpreted(path: str, timeout: int) -> None:
    """Run the test file at ``path`` under ``TRITON_INTERPRET=1`` in a fresh process; assert it passed."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", path],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]


def interpreted_tests(path: str, subprocess_mode: bool, timeout: int):
    """The pair a Triton test file defines at module level, as
    ``_interpreter_available, test_interpreted_in_subprocess = interpreted_tests(__file__, SUBPROCESS, T)``:
    an autouse fixture that skips the file's other tests in subprocess mode, and the test that reruns
    the file under the interpreter there."""

    @pytest.fixture(autouse=True)
    def _interpreter_available(request):
        skip_unless_interpreting(request, subprocess_mode)

    def test_interpreted_in_subprocess():
        if not subprocess_mode:
            pytest.skip("this session runs the kernel directly")
        rerun_interpreted(path, timeout=timeout)

    return _interpreter_available, test_interpreted_in_subprocess
