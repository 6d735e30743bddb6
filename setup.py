"""The package is defined in pyproject.toml (PEP 621); this file adds one thing pyproject.toml cannot say.

megatron_sat_lm_eval.pth, written into site-packages beside the package (wheel and editable installs): at interpreter
start it makes lm-eval know the `megatron_sat` model backend, so that plain `lm_eval --model megatron_sat` works
(lm-eval 0.4.13 has no plugin entry point for models; see megatron_sat/analysis/lm_eval_registration.py). The line
imports nothing heavy: it waits for lm-eval's registry to be imported.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "megatron_sat_lm_eval.pth"
PTH_LINE = "import megatron_sat.analysis.lm_eval_registration as _msat_lm_eval; _msat_lm_eval.install()\n"


class BuildPyWithPth(build_py):
    """build_py, plus the .pth at the root of what is installed (a wheel's build_lib; an editable install's
    unpacked wheel, where setuptools' editable_wheel puts files that are not part of a package)."""

    def run(self):
        super().run()
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, PTH), "w") as f:
            f.write(PTH_LINE)

    def get_outputs(self, *args, **kwargs):
        extra = [] if self.editable_mode else [os.path.join(self.build_lib, PTH)]
        return [*super().get_outputs(*args, **kwargs), *extra]


setup(cmdclass={"build_py": BuildPyWithPth})
