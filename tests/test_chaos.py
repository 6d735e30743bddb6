"""The chaos run at test size: tests/chaos/chaos.py with 10 faults (every kind once) over a two-run sweep on the private
two-node Slurm cluster (tests/slurm_cluster.py), as its command line runs it.

    .venv/bin/python -m pytest -q -ra tests/test_chaos.py        # 280-370 s on 2 shared cores

What the tool checks, and this test reads back from its chaos.json: every run COMPLETED; its final checkpoint's
tensors (weights, optimizer state) equal a fault-free run's bit for bit (the same DP2 layout, so the same reduction
order); its logged losses equal the fault-free ones step for step; every fault named in the run's Slurm log (a
node loss: or by Slurm's job state; an export or evaluation: by its exit status, 0 with a complete folder or 2
with one line); collect_grid's restarts equal the restarts the faults caused; a suspension and the readers cost no
step. The 30-fault run is documented in docs/reliability_signals.md.
"""

import json
import os
import subprocess
import sys

import pytest
from slurm_cluster import SlurmUnavailable, check_installed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "chaos"))
import chaos_faults  # noqa: E402  (tests/chaos/chaos_faults.py: the kinds of fault)
import chaos_sweep  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def test_ten_faults_over_a_sweep_end_bit_identical_to_a_fault_free_run(tmp_path):
    try:
        check_installed()
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm: {e}")
    if os.geteuid() != 0:
        pytest.skip("the chaos run mounts a tmpfs per run folder (the full-disk fault): needs root")
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "chaos", "chaos.py"), "--faults", "10", "--seed", "3",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    report = out / "chaos.json"
    assert report.is_file(), proc.stdout[-5000:] + proc.stderr[-5000:]
    result = json.loads(report.read_text())
    assert proc.returncode == 0 and not result["problems"], "\n".join(result["problems"]) + "\n" + proc.stdout[-5000:]
    faults = result["faults"]
    assert sorted(f["kind"] for f in faults) == sorted(chaos_faults.KINDS)  # every kind once
    assert all(f["named"] for f in faults)
    for f in faults:
        assert f["recovery_s"] is not None, f
        if f["kind"] in ("suspend", "export", "evaluate"):
            assert f["redone"] == 0, f
        if f["kind"] in ("export", "evaluate"):  # the runs record a tokenizer: the evaluation scores, not refuses
            assert f["detail"] == "exit 0, complete output", f
        if f["kind"] == "disk_full":  # the save at step 5k fails after step 5k: resumed from 5(k - 1)
            assert f["redone"] == chaos_sweep.SAVE_INTERVAL, f
    for name, run in result["runs"].items():
        assert run["state"] == "COMPLETED" and run["differ"] == 0 and run["optimizer_tensors"] > 0, (name, run)
        assert run["collect_grid_restarts"] == run["expected_restarts"], (name, run)
    assert sum(r["expected_restarts"] for r in result["runs"].values()) >= 7  # 7 of the 10 kinds restart
    table = proc.stdout
    for kind in chaos_faults.KINDS:
        assert f"| {kind}" in table, table


def test_bit_identical_means_every_bit_of_two_real_checkpoints(tmp_path):
    """verify_chaos's "bit-identical" on two torch distributed checkpoints (what the trainer writes), read back as
    chaos.py reads them: equal ones pass; a float32 weight one ulp apart, a bf16 moment one ulp apart, 0.0 against
    -0.0, a dtype changed, a key missing each fail, naming that tensor; NaN against the same NaN passes."""
    import torch
    import torch.distributed.checkpoint as dcp
    import verify_chaos  # tests/chaos/verify_chaos.py

    base = {"model.w": torch.linspace(-1, 1, 12).reshape(3, 4), "model.z": torch.tensor([0.0, 1.0]),
            "optimizer.m": torch.full((5,), 0.3, dtype=torch.bfloat16), "optimizer.step": torch.tensor([7]),
            "model.nan": torch.tensor([float("nan"), 1.0])}

    def read(name, **changed):
        state = {k: v.clone() for k, v in dict(base, **changed).items() if v is not None}
        dcp.save(state, checkpoint_id=str(tmp_path / name))
        return verify_chaos._tensors(str(tmp_path / name))

    ref = read("ref")
    assert verify_chaos.differing(read("same"), ref) == []
    w = base["model.w"].clone()
    w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(2.0))
    m = base["optimizer.m"].clone()
    m[0] = (m[0].view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 value
    for name, changed, want in (("ulp", {"model.w": w}, ["model.w"]),
                                ("bf16", {"optimizer.m": m}, ["optimizer.m"]),
                                ("zero", {"model.z": torch.tensor([-0.0, 1.0])}, ["model.z"]),
                                ("dtype", {"optimizer.step": torch.tensor([7], dtype=torch.int32)}, ["optimizer.step"]),
                                ("missing", {"optimizer.m": None}, ["optimizer.m"])):
        assert verify_chaos.differing(read(name, **changed), ref) == want, name
