"""Packaging for megatron-sat (SATFormer pretraining on NVIDIA Megatron-Core).

Requirement lists live in requirements/*.txt so that `make venv` can install them without letting pip
re-resolve megatron-core (whose 0.19.x wheels declare Requires-Python>=3.12 although the cp311 wheel works on
Python 3.11; see the Makefile).

Optional, not declared: NVIDIA Apex (no PyPI release; the PyPI package named `apex` is unrelated). It is present
in NVIDIA containers and megatron-core uses its fused kernels when it is importable.
"""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _reqs(name):
    out = []
    with open(os.path.join(HERE, "requirements", name + ".txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(line)
    return out


setup(
    name="megatron-sat",
    version="0.1.0",
    description="Pretraining codebase for SATFormer built on NVIDIA Megatron-Core",
    packages=find_packages(include=["megatron_sat", "megatron_sat.*", "recipes", "recipes.*"]) + ["megatron_sat_tools"],
    package_dir={"megatron_sat_tools": "tools"},  # tools/ as a package, for the console scripts below
    package_data={"megatron_sat.analysis": ["lm_eval_tasks/*"]},  # the bundled based_* lm-eval tasks
    python_requires=">=3.11",
    install_requires=_reqs("base") + ["megatron-core>=0.19,<0.20"],
    extras_require={
        "te": _reqs("te"),
        "hf": _reqs("hf"),
        "train": _reqs("train"),
        "eval": _reqs("eval"),
        "dev": _reqs("dev"),
    },
    entry_points={"console_scripts": [
        "megatron-sat-train = megatron_sat.train:main",
        "megatron-sat-collect-grid = megatron_sat.analysis.collect:main",
        *(f"megatron-sat-{name.replace('_', '-')} = megatron_sat_tools.{name}:main" for name in (
            "convert_to_hf", "convert_from_hf", "preprocess_data", "evaluate", "analyze_gates", "plan_layout",
            "submit_grid", "merge_datasets", "dry_run")),
    ]},
)
