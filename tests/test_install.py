"""The package as users install it, outside the source tree: the wheel, the container's install script, and the
README's cluster walkthrough run as written on a real two-node Slurm.

    .venv/bin/python -m pytest -q -ra tests/test_install.py        # a few minutes on 2 cores

  * the wheel (pip wheel .) holds every module and data file of the source tree that the package needs
    (megatron_sat/, recipes/, tools/ as megatron_sat_tools, slurm/ as megatron_sat_tools/slurm, the lm-eval task
    YAMLs, the exported HF modeling code);
  * installed with --no-deps into a fresh venv that sees the project's dependencies, its console scripts run from
    a folder outside the repository: train three steps (the debug recipes warm up for two), submit_grid
    --dry-run, convert_to_hf, plan_layout;
  * docker/install.sh (what the container runs) in a fresh venv that already has torch: megatron-core and the
    package with the hf extra, torch untouched, then the same commands;
  * the README's "On a Slurm cluster" block, read from README.md and run by bash as written (scales 760M ->
    ladder1, the CPU settings MSAT_GPUS=0 and MSAT_CPUS_PER_TASK=1 from the environment, CORPUS, TOKENIZER and
    TASKS set as the README asks) with the wheel's venv first on PATH, in a folder outside the repository, on a
    local Slurm of two nodes: every step succeeds and leaves what it promises.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile

import pytest
import test_slurm_multinode
from megatron_sat_tools import collect_grid

from megatron_sat.data.corpus import default_corpus_documents
from megatron_sat.data.tokenizer import train_bpe_tokenizer
from megatron_sat.sweep import records

pytestmark = pytest.mark.slow  # builds and installs the wheel; the README walkthrough on a local Slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cluster = test_slurm_multinode.cluster  # the fixture: a local Slurm of two nodes, n1 and n2 (module-scoped)
# where each source folder lands in the wheel, and which of its files the package needs
LAYOUT = {"megatron_sat": "megatron_sat", "recipes": "recipes", "tools": "megatron_sat_tools",
          "slurm": "megatron_sat_tools/slurm"}
NOT_SHIPPED = {"__pycache__"}


def _run(cmd, cwd, env, timeout=600, ok=True):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if ok:
        assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSAT_", "SLURM_", "PYTHON"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VIRTUAL_ENV"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1", **extra)
    return env


def _source_files():
    """Every file of the package's source folders, as its path inside the wheel."""
    out = set()
    for src, dst in LAYOUT.items():
        for folder, dirs, files in os.walk(os.path.join(ROOT, src)):
            dirs[:] = [d for d in dirs if d not in NOT_SHIPPED]
            for name in files:
                if name.endswith((".pyc", ".pyo")):
                    continue
                rel = os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, src))
                out.add(f"{dst}/{rel}")
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), ROOT],
         cwd=str(out), env=_clean_env())
    (path,) = [os.path.join(out, n) for n in os.listdir(out) if n.endswith(".whl")]
    return path


def _venv(path, env):
    _run([sys.executable, "-m", "venv", "--without-pip", str(path)], cwd=str(path.parent), env=env)
    return path / "bin" / "python"


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory, wheel):
    """A fresh venv holding only the wheel; the project's own site-packages (its dependencies) added behind it by a
    .pth path line, which does not run that folder's .pth files, so the editable checkout stays out of sight."""
    env = _clean_env()
    python = _venv(tmp_path_factory.mktemp("venv") / "wheel", env)
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd="/", env=env).stdout.strip()
    with open(os.path.join(purelib, "project-deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", wheel],
         cwd="/", env=env)
    return python


def _smoke(python, workdir):
    """The console scripts of an install, run from a folder outside the repository."""
    bindir = os.path.dirname(python)
    env = _clean_env(PATH=f"{bindir}:{os.environ['PATH']}")
    os.makedirs(workdir, exist_ok=True)
    where = _run([str(python), "-c", "import megatron_sat, megatron_sat_tools, recipes; "
                  "print(megatron_sat.__file__, megatron_sat_tools.__file__, recipes.__file__)"], workdir, env)
    for path in where.stdout.split():
        assert not path.startswith(ROOT + os.sep), f"imported from the source tree: {path}"
    train = _run(["megatron-sat-train", "--recipe", "debug_satformer", "--train-iters", "3", "--save", "ckpt",
                  "--no-progress-bar"], workdir, env)
    assert os.path.isfile(os.path.join(workdir, "ckpt", "latest_checkpointed_iteration.txt")), train.stdout
    grid = _run(["megatron-sat-submit-grid", "--dry-run"], workdir, env).stdout
    assert "24 run(s)" in grid and "megatron_sat_tools/slurm/array.sbatch" in grid, grid[-2000:]
    slurm_dir = _run(["megatron-sat-submit-grid", "--slurm-dir"], workdir, env).stdout.strip()
    assert {"train.sbatch", "array.sbatch", "launch.sh", "site.sh"} <= set(os.listdir(slurm_dir))
    _run(["megatron-sat-convert-to-hf", "--load", "ckpt", "--output", "hf"], workdir, env)
    assert json.load(open(os.path.join(workdir, "hf", "config.json")))["model_type"] == "SATFormer"
    plan = _run(["megatron-sat-plan-layout", "--recipe", "satformer_1.3B"], workdir, env).stdout
    assert "status    OK" in plan, plan


def test_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files() - names)
    assert not missing, f"the wheel lacks {len(missing)} file(s) of the source tree: {missing}"
    # and what it ships can import there: no shipped module reaches into tests/ (the chaos harness lives there)
    helpers = "|".join(n[:-3] for n in os.listdir(os.path.join(ROOT, "tests")) if n.endswith(".py")) + "|chaos_\\w+"
    reaching = [n for n in sorted(names) if n.endswith(".py") and re.search(
        rf'^\s*(import|from)\s+({helpers})\b|ROOT, "tests"', zipfile.ZipFile(wheel).read(n).decode(), flags=re.M)]
    assert not reaching, f"shipped modules that import the tests' helpers (not in the wheel): {reaching}"
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    scripts = re.findall(r"^(megatron-sat-[\w-]+) = ", entry_points, flags=re.M)
    assert {"megatron-sat-train", "megatron-sat-submit-grid", "megatron-sat-convert-to-hf",
            "megatron-sat-plan-layout", "megatron-sat-collect-grid", "megatron-sat-evaluate"} <= set(scripts)
    assert b"lm_eval_registration" in zipfile.ZipFile(wheel).read("megatron_sat_lm_eval.pth")  # plain lm_eval's hook
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    for need in ("megatron-core", "xxhash", "pyyaml"):
        assert re.search(rf"^Requires-Dist: {need}\b", metadata, flags=re.M | re.I), f"{need} is not declared"
    assert re.search(r"^Requires-Dist: deepspeed.*extra == \"profile\"", metadata, flags=re.M), \
        "deepspeed must be an optional extra"


def test_wheel_install_runs_outside_the_repository(wheel_venv, tmp_path):
    _smoke(wheel_venv, str(tmp_path / "work"))
    # the wheel's megatron_sat_lm_eval.pth: plain lm_eval finds the backend (lm_eval_registration.py)
    known = _run([str(wheel_venv), "-c", "from lm_eval.api.registry import model_registry as r; "
                  "print(r.get('megatron_sat').__module__)"], str(tmp_path), _clean_env()).stdout
    assert known.strip() == "megatron_sat.analysis.lm_eval_backend", known


def test_container_install_script_keeps_torch(tmp_path):
    """docker/install.sh as the container runs it, in a fresh venv that already has torch (as the NGC image does)."""
    env = _clean_env()
    python = _venv(tmp_path / "venv", env)
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "torch==2.13.0"], "/", env)
    torch_file = _run([str(python), "-c", "import torch; print(torch.__file__)"], "/", env).stdout.strip()
    stamp = os.stat(torch_file).st_mtime_ns
    # pip inside the fresh venv: the script calls `$PYTHON -m pip`
    _run([str(python), "-m", "ensurepip"], "/", env)
    # extras hf only (what the smoke commands need): the script's logic is the same for any extras, and the
    # default's lm-eval, wandb, scipy and matplotlib would add minutes of installing to every CI run
    out = _run(["bash", os.path.join(ROOT, "docker", "install.sh")], "/", dict(env, PYTHON=str(python), MSAT_EXTRAS="hf"),
               timeout=1200)
    assert "torch 2.13.0" in out.stdout and "(kept)" in out.stdout, out.stdout[-2000:]
    assert os.stat(torch_file).st_mtime_ns == stamp, "docker/install.sh reinstalled torch"
    _smoke(python, str(tmp_path / "work"))


def walkthrough_block() -> str:
    """The README's cluster walkthrough: the bash block after the `walkthrough:` marker."""
    text = open(os.path.join(ROOT, "README.md")).read()
    marker = text.index("<!-- walkthrough:")
    m = re.compile(r"```bash\n(.*?)\n```", re.S).search(text, marker)
    assert m, "README.md: no bash block after the walkthrough marker"
    return m.group(1)


def test_readme_cluster_walkthrough_as_written(cluster, wheel_venv, tmp_path):
    work = tmp_path / "work"
    inputs = tmp_path / "inputs"
    work.mkdir()
    inputs.mkdir()
    corpus = inputs / "corpus.jsonl"
    with open(corpus, "w") as f:
        for _, text in default_corpus_documents(("topics",)):
            f.write(json.dumps({"text": text}) + "\n")
    tokenizer = str(inputs / "tokenizer")
    train_bpe_tokenizer([str(corpus)], 1024, tokenizer)
    block = walkthrough_block()
    assert "760M" in block
    script = "set -euo pipefail\n" + block.replace("760M", "ladder1")  # the only edit: CPU-sized recipes
    env = cluster.env(_clean_env(PATH=f"{os.path.dirname(wheel_venv)}:{os.environ['PATH']}", MSAT_GPUS="0",
                                 MSAT_CPUS_PER_TASK="1", CORPUS=str(corpus), TOKENIZER=tokenizer,
                                 TASKS=os.path.join(ROOT, "tests", "data", "eval", "tiny_mc.yaml")))
    proc = _run(["bash", "-c", script], str(work), env, timeout=1200, ok=False)
    logs = "\n".join(open(os.path.join(work, "logs", n)).read()[-3000:] for n in sorted(os.listdir(work / "logs"))) \
        if (work / "logs").is_dir() else "(no logs)"
    assert proc.returncode == 0, f"walkthrough failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-4000:]}\n--- job logs ---\n{logs}"
    # 2. data, 4.-6. a complete sweep of two runs collected, 7. scores in the run folder, 8. an HF folder
    assert (work / "data" / "corpus.bin").is_file() and (work / "data" / "corpus.idx").is_file()
    assert (work / "site.sh").is_file()
    runs = sorted(p.name for p in (work / "runs").iterdir() if not p.name.startswith("_"))
    assert [r.split("_lr")[0] for r in runs] == ["satformer_ladder1", "transformer_ladder1"], runs
    with open(work / "results" / "first" / "grid.csv") as f:
        rows = f.read()
    assert rows.count(",complete,") == 2, rows
    for run in runs:
        config = json.load(open(work / "runs" / run / "config.json"))
        assert os.path.abspath(config["data_path"][0] if isinstance(config["data_path"], list)
                               else config["data_path"]).startswith(str(work / "data")), config.get("data_path")
    satformer = work / "runs" / runs[0]
    scores = json.load(open(satformer / "eval" / "tasks" / "results.json"))
    assert "megatron_sat_tiny_mc" in json.dumps(scores["results"])
    assert json.load(open(work / "hf" / "satformer_ladder1" / "config.json"))["model_type"] == "SATFormer"
    assert re.search(r"^run .* ETA ", proc.stdout, flags=re.M), proc.stdout[-3000:]  # 5. the status table


def test_install_and_sweep_tools_refuse_bad_input(tmp_path, capsys):
    """One line, exit 2: install.sh without torch, a missing site file, --wait without a sweep or its record."""
    env = _clean_env(PYTHON="/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else "python3")
    proc = _run(["bash", os.path.join(ROOT, "docker", "install.sh")], str(tmp_path), env, ok=False)
    assert proc.returncode == 2 and "install torch first" in proc.stderr, proc.stderr
    proc = _run([sys.executable, os.path.join(ROOT, "tools", "submit_grid.py"), "--scales", "debug", "--submit"],
                str(tmp_path), _clean_env(MSAT_SITE=str(tmp_path / "nowhere.sh")), ok=False)
    assert proc.returncode == 2 and "set MSAT_SITE to your copy of" in proc.stderr, proc.stderr
    assert collect_grid.main([str(tmp_path), "--status", "--wait"]) == 2
    assert "--wait needs --sweep" in capsys.readouterr().err
    (tmp_path / "runs").mkdir()
    assert collect_grid.main([str(tmp_path / "runs"), "--status", "--wait", "--sweep", "nope", "-q"]) == 2
    assert "no record of sweep 'nope'" in capsys.readouterr().err


def test_status_of_a_sweep_whose_jobs_have_not_started(tmp_path, capsys):
    """Right after submit_grid --submit there is a sweep record and no run folder: --status lists the entries,
    --out says that nothing has started (exit 2)."""
    runs = tmp_path / "runs"
    (runs / "_grid").mkdir(parents=True)
    entries = [dict(recipe=f"{a}_ladder1", arch=a, scale="ladder1", seed=1, run=f"{a}_ladder1_x") for a in
               ("transformer", "satformer")]
    records.record_sweep(str(runs / "_grid"), "fresh", [dict(job="424242", jobs=["424242"], manifest="m", entries=entries)])
    assert collect_grid.main([str(runs), "--sweep", "fresh", "--status", "-q"]) == 0
    out = capsys.readouterr().out
    assert "transformer_ladder1_x" in out and "satformer_ladder1_x" in out, out
    assert collect_grid.main([str(runs), "--sweep", "fresh", "--out", str(tmp_path / "out"), "-q"]) == 2
    assert "no run of sweep fresh has started yet" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
