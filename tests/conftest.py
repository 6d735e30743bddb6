"""Shared pytest set-up for megatron-sat.

- puts tests/ on sys.path so test modules can ``from dist_utils import run_distributed, init_megatron``
  (multi-process gloo/NCCL launcher; see tests/dist_utils.py);
- markers (registered in pyproject.toml): ``slow`` (left out by ``make test-fast``), ``slurm`` (a local Slurm:
  tests/slurm_cluster.py skips without one, naming ``make slurm``), ``gpu`` (skipped here on CPU-only machines);
- fixture ``site``: a CPU site file for the Slurm scripts (tests/test_slurm*.py, tests/test_collect_grid.py).
"""

import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A CPU site file (no GPUs, 1 CPU per task, runs and logs in a temp folder) over slurm/site.sh."""
    d = tmp_path_factory.mktemp("slurm-site")
    runs, logs = d / "runs", d / "logs"
    logs.mkdir()
    path = d / "site.sh"
    path.write_text(f"MSAT_GPUS=0\nMSAT_CPUS_PER_TASK=1\nMSAT_RUNS={runs}\nMSAT_LOGS={logs}\n"
                    f"MSAT_PYTHON={sys.executable}\nsource {_REPO}/slurm/site.sh\n")
    env = dict(os.environ, MSAT_SITE=str(path), MSAT_REPO=_REPO, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return dict(path=str(path), runs=str(runs), logs=str(logs), env=env, root=d)


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_launcher_variables_leak():
    """A test that sets up a process group in the pytest process (a tool run in-process: parallel/process_group.py
    init_from_env writes RANK/.../MASTER_PORT into os.environ) must not hand that world, and its port, to the
    processes later tests start: the variables are restored after every test. Seen: every later single-process
    trainer launch failed with EADDRINUSE on the one inherited MASTER_PORT."""
    before = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
