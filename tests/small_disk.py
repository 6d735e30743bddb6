"""A small tmpfs of a test's own, to fill: the full-disk tests of tests/test_faults.py and test_faults_signals.py."""

import subprocess
from contextlib import contextmanager

import pytest


@contextmanager
def small_tmpfs(folder, size: int):
    """`folder` (made here) as a tmpfs of `size` bytes, unmounted after; the test is skipped where mounting needs root
    and this process is not."""
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                           text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a small tmpfs to fill ({mount.stderr.strip()}): needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
