"""compat/known_warnings.py: the filters quiet() hands to the processes it spawns through PYTHONWARNINGS are
entries Python takes (a malformed one costs every child interpreter an 'Invalid -W option ignored' line on stderr,
which broke the one-line refusals of every tool a test ran after an in-process evaluation), and they still drop
each known warning, whole messages with commas included, in the child."""

import os
import subprocess
import sys

from megatron_sat.compat import known_warnings


def test_children_take_the_filters_and_drop_every_known_warning(monkeypatch):
    monkeypatch.delenv("MEGATRON_SAT_VERBOSE", raising=False)
    monkeypatch.setenv("PYTHONWARNINGS", "default::DeprecationWarning")  # a user's own entry is kept
    assert known_warnings.quiet()
    assert os.environ["PYTHONWARNINGS"].startswith("default::DeprecationWarning,")
    warn = "; ".join(f"warnings.warn_explicit({m!r}, {c.__name__}, 'x.py', 1, module={mod!r})"
                     for m, c, mods in known_warnings.WARNINGS for mod in mods)
    r = subprocess.run([sys.executable, "-c", f"import warnings; {warn}; print('ran')"], capture_output=True,
                       text=True, timeout=120)
    assert r.stdout == "ran\n" and r.stderr == "", r.stderr
    # the same warnings from another module are not known: they still show
    other = [(m, c) for m, c, _ in known_warnings.WARNINGS][:2]
    warn = "; ".join(f"warnings.warn_explicit({m!r}, {c.__name__}, 'x.py', 1, module='somebody.else')"
                     for m, c in other)
    r = subprocess.run([sys.executable, "-c", f"import warnings; {warn}"], capture_output=True, text=True,
                       timeout=120)
    assert r.stderr.count("Warning: ") == 2, r.stderr
