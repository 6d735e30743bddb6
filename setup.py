"""The package is defined in pyproject.toml (PEP 621); this file adds one thing pyproject.toml cannot say.

megatron_sat_lm_eval.pth, written into site-packages beside the package (wheel and editable installs): at interpreter
start it makes lm-eval know the `megatron_sat` model backend, so that plain `lm_eval --model megatron_sat` works
(lm-eval 0.4.13 has no plugin entry point for models; see megatron_sat/analysis/lm_eval_registration.py). The line
imports nothing heavy and not the megatron_sat package: it imports a copy of lm_eval_registration.py installed beside
it as the top-level module megatron_sat_lm_eval_registration (which imports only importlib and sys), and that waits
for lm-eval's registry to be imported. Importing megatron_sat itself at interpreter start would put the installed
package into sys.modules before the working folder is on sys.path: `python -m megatron_sat.train` in another
checkout would run the installed one's code, and a broken import would break every Python process of the venv.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "megatron_sat_lm_eval.pth"
HOOK = "megatron_sat_lm_eval_registration"  # a top-level module: a copy of the file below
HOOK_SOURCE = os.path.join("megatron_sat", "analysis", "lm_eval_registration.py")
PTH_LINE = f"import {HOOK}; {HOOK}.install()\n"


class BuildPyWithPth(build_py):
    """build_py, plus the .pth at the root of what is installed (a wheel's build_lib; an editable install's
    unpacked wheel, where setuptools' editable_wheel puts files that are not part of a package)."""

    def run(self):
        super().run()
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, PTH), "w") as f:
            f.write(PTH_LINE)
        here = os.path.dirname(os.path.abspath(__file__))
        self.copy_file(os.path.join(here, HOOK_SOURCE), os.path.join(root, HOOK + ".py"))

    def get_outputs(self, *args, **kwargs):
        extra = [] if self.editable_mode else [os.path.join(self.build_lib, name) for name in (PTH, HOOK + ".py")]
        return [*super().get_outputs(*args, **kwargs), *extra]


setup(cmdclass={"build_py": BuildPyWithPth})
