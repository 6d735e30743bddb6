"""A real Python environment without some packages, for the tests of what happens when one is not installed: a venv
(`python -m venv --without-pip`, a fraction of a second) whose site-packages links every entry of this one's but
the packages named and their dist-info. Its interpreter starts as this one does (the .pth hooks included), and
`import package` fails as on an install that never had it; no import is blocked or replaced in a running process."""

import os
import subprocess
import sys
import sysconfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def venv_without(folder, *packages: str) -> str:
    """The python executable of a new venv in `folder` that has everything this one has but `packages` (import
    names, e.g. "lm_eval", as their folders and dist-info are named)."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = os.path.join(str(folder), "bin", "python")
    theirs = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    left_out = [n for n in os.listdir(ours) if n.split("-")[0].split(".")[0] in packages]
    missing = set(packages) - {n.split("-")[0].split(".")[0] for n in left_out}
    assert not missing, f"not installed here, so nothing to leave out: {sorted(missing)}"
    for name in set(os.listdir(ours)) - set(left_out) - set(os.listdir(theirs)):
        os.symlink(os.path.join(ours, name), os.path.join(theirs, name))
    return python


def run(python: str, code: str, *argv: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c code argv...` from the repository, this checkout first on sys.path."""
    return subprocess.run([python, "-c", code, *argv], input=stdin, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))
