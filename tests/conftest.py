"""Shared pytest set-up for megatron-sat.

- puts tests/ on sys.path so test modules can ``from dist_utils import run_distributed, init_megatron``
  (multi-process gloo/NCCL launcher; see tests/dist_utils.py);
- marker ``gpu``: tests that need CUDA are skipped on CPU-only machines.
"""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
