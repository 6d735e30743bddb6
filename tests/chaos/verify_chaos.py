"""tests/chaos/chaos.py's end checks: runs COMPLETED, final checkpoints bit-identical to the fault-free runs, every fault
named, collect_grid's restarts equal to the restarts the faults caused. Returns chaos.json's content."""

import os
import tempfile
import time

import chaos_sweep as cs


def _tensors(iter_dir: str) -> dict:
    """Every tensor of a checkpoint (model and optimizer state), read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.pt")
        dcp_to_torch_save(iter_dir, path)
        return {k: v for k, v in torch.load(path, weights_only=False).items() if torch.is_tensor(v)}


def differing(a: dict, b: dict) -> list:
    """The tensors of checkpoint `b` that `a` lacks or holds with another dtype, shape or any other bit (NaNs equal
    where both hold one at the same place: torch.equal would call a NaN unequal to itself)."""
    import torch

    def same(x, y) -> bool:
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.is_floating_point():  # bit patterns: one ulp apart differs, -0.0 differs from 0.0, NaN equals NaN
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
            return torch.equal(x.contiguous().view(bits), y.contiguous().view(bits))
        return torch.equal(x, y)

    return sorted(k for k in b if k not in a or not same(a[k], b[k]))


def verify(sweep) -> dict:

    from megatron_sat.analysis import grid

    problems = list()
    for name, proc in sweep.refs.items():
        try:
            rc = proc.wait(timeout=1800)
        except Exception:  # noqa: BLE001
            rc = None
        if rc != 0:
            problems.append(f"the fault-free run {name} exited {rc} (logs/reference-{name}.log)")
    runs = {}
    for run in sweep.runs:
        state = sweep._state(run)[0]
        info = dict(job=run.job, state=state, resubmissions=run.resubmissions, expected_restarts=run.expected_restarts)
        if state != "COMPLETED" or cs._tracker(run.folder) != sweep.iters:
            problems.append(f"{run.name}: job {run.job} {state}, tracker {cs._tracker(run.folder)}/{sweep.iters}")
        ref = os.path.join(sweep.out, "reference", run.name, f"iter_{sweep.iters:07d}")
        got = os.path.join(run.folder, f"iter_{sweep.iters:07d}")
        if os.path.isdir(ref) and os.path.isdir(got):
            a, b = _tensors(got), _tensors(ref)
            differ = differing(a, b)
            info.update(tensors=len(b), differ=len(differ),
                        optimizer_tensors=sum(k.startswith("optimizer.") for k in b))
            if differ or sorted(a) != sorted(b) or not info["optimizer_tensors"]:
                problems.append(f"{run.name}: the final checkpoint differs from the fault-free run's in {len(differ)}"
                                f" of {len(b)} tensors (first: {differ[:3]}; keys equal: {sorted(a) == sorted(b)})")
            final = {r["step"]: r["loss"] for r in cs._rows(run.folder)}  # the last logged loss of every step
            straight = {r["step"]: r["loss"] for r in cs._rows(os.path.dirname(ref))}
            if final != straight:
                problems.append(f"{run.name}: logged losses differ from the fault-free run's at steps "
                                f"{[s for s in straight if final.get(s) != straight[s]][:5]}")
        else:
            problems.append(f"{run.name}: final checkpoint missing ({got} or {ref})")
        runs[run.name] = info
    rows, _, _ = grid.read_runs([sweep.runs_dir], sweep.name, log=lambda *a: None)
    counted = {r["run"]: r.get("restarts") for r in rows}
    for run in sweep.runs:
        runs[run.name]["collect_grid_restarts"] = counted.get(run.name)
        if counted.get(run.name) != run.expected_restarts:
            problems.append(f"{run.name}: collect_grid counts {counted.get(run.name)} restarts, the faults caused "
                            f"{run.expected_restarts}")
    faults = []
    by_name = {r.name: r for r in sweep.runs}
    for f in sweep.faults:
        f["named"] = cs.named(by_name[f["run"]], f)
        if not f["named"]:
            problems.append(f"fault {f['kind']} on {f['run']} at step {f['step']} is named nowhere"
                            f"{': ' + f['detail'] if f['kind'] in ('export', 'evaluate') else ''}")
        if f["kind"] in ("suspend", "export", "evaluate") and f.get("redone"):
            problems.append(f"{f['kind']} on {f['run']} cost {f['redone']} steps (it must cost none)")
        faults.append({k: v for k, v in f.items() if k in ("kind", "run", "t", "step", "detected_by", "detail",
                                                            "named", "recovery_s", "redone", "job", "state_seen")})
    return dict(faults=faults, runs=runs, iters=sweep.iters, problems=problems + [
        n for n in sweep.notes if "not injected" in n], notes=sweep.notes, wall_s=time.time() - sweep.t0,
        sweep=sweep.name)
