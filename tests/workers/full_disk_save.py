"""Two ranks save onto a nearly full disk, one write failing at a time (tests/test_faults_files.py, through
tests/dist_utils.run_distributed: a real gloo group, TP=2).

    run_distributed("tests/workers/full_disk_save.py:main", 2, MOUNT, timeout=...)

MOUNT is a small tmpfs of the test's own. The ranks build a tiny SATFormer, take one step and save iteration 2
with room to spare; the sizes of its files (pages) give the levels. Then, for each file a save writes, in the order
it writes them, rank 0 fills the disk so that exactly the files before it fit, and both ranks save iteration 4:

    shard          half the shards fit (a write of either rank fails: Megatron-Core reports it to every rank)
    .metadata      the shards fit; Megatron-Core's .metadata, written by rank 0 alone, does not
    metadata.json  ... Megatron-Core's metadata.json, written by rank 0 alone, does not
    manifest.json  ... ours (integrity.py), written by rank 0 alone after both ranks hashed their share
    tracker        the checkpoint fits, renamed; the tracker (rank 0) does not
    room           one page more: the save succeeds

Every save but the last must fail on every rank with the same one line naming the full disk, leave the run folder as
it was (iteration 2 complete and named by the tracker, nothing of iteration 4) and the group in step (the next
collectives agree). Synchronous saves, then --async-save's (the failure shows at finalize). Returns what each
level did, for the test to check; a rank stuck in a collective the other left fails the run by its timeout.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conversion import _args, _build, _step, _wrap  # (tests/workers/conversion.py)

LEVELS = ("shard", ".metadata", "metadata.json", "manifest.json", "tracker", "room")
LATER = {".metadata": "metadata.json", "metadata.json": "manifest.json", "manifest.json": "tracker"}


def _pages(path: str) -> int:
    return os.stat(path).st_blocks * 512  # what the file takes on the tmpfs (whole pages)


def _leave_free(mount: str, nbytes: int) -> int:
    """Rank 0: grow or shrink the filler so that `nbytes` (whole pages) are free; returns what is free."""
    filler = os.path.join(mount, "filler")
    if os.path.exists(filler):
        os.remove(filler)
    st = os.statvfs(mount)
    left = st.f_bavail * st.f_frsize - nbytes
    assert left >= 0, f"the tmpfs is too small: {left} bytes short"
    with open(filler, "wb") as f:
        while left > 0:
            left -= f.write(b"\0" * min(left, 1 << 20))
    st = os.statvfs(mount)
    return st.f_bavail * st.f_frsize


def main(mount: str) -> dict:
    from megatron_sat.training import checkpointing as ckpt
    from megatron_sat.training import integrity, run_folder

    rank = torch.distributed.get_rank()
    args = _args("satformer", tp=2)  # each rank writes a shard of its own
    config, chunks = _build(args)
    chunks, opt, sched = _wrap(config, chunks, args)
    _step(chunks, opt, config, num_micro=2)
    run = os.path.join(mount, "run")
    first = ckpt.Saver(run, chunks, opt, sched, log=lambda line: None)
    first.save(2, consumed_samples=4)
    done = ckpt.checkpoint_dir(run, 2)
    files = {name: _pages(os.path.join(done, name)) for name in os.listdir(done)}
    page = os.statvfs(mount).f_frsize
    shards = sum(size for name, size in files.items() if name not in (".metadata", "metadata.json", "manifest.json"))
    free = {"shard": shards // 2 // page * page, ".metadata": shards}
    for name, after in LATER.items():
        free[after] = free[name] + files[name]
    free["room"] = free["tracker"] + page
    out = dict(files=files, levels={})
    for mode in ("sync", "async"):
        saver = ckpt.Saver(run, chunks, opt, sched, async_save=mode == "async", log=lambda line: None)
        for level in LEVELS:
            if rank == 0:
                got = _leave_free(mount, free[level])
                assert got == free[level], (level, got, free[level])
            torch.distributed.barrier()
            try:
                saver.save(4, consumed_samples=8)
                saver.finalize()
                outcome = "saved"
            except ckpt.SaveFailed as e:
                outcome = str(e)
            outcomes = [None, None]
            torch.distributed.all_gather_object(outcomes, outcome)  # the group is in step, and what each rank said
            total = torch.tensor([rank + 1.0])
            torch.distributed.all_reduce(total)
            seen = dict(outcomes=outcomes, sum=total.item())
            if rank == 0:
                seen.update(listing=sorted(os.listdir(run)), tracker=run_folder.read_tracker(run))
                for it in sorted(run_folder.complete_iterations(run)):
                    integrity.verify(ckpt.checkpoint_dir(run, it), collective=False)  # CorruptCheckpoint if not
                if outcome == "saved":  # back to iteration 2 alone for the next mode
                    run_folder.delete_checkpoint(run, 4)
                    run_folder.write_tracker(run, 2)
            torch.distributed.barrier()
            out["levels"][f"{mode} {level}"] = seen
    return out
