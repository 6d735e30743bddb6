"""One rank of two that write and check a checkpoint's manifest together (tests/test_checkpoint_manifest.py).

    python tests/workers/manifest_rank.py FOLDER RANK WORLD PORT

The ranks form a real gloo process group on 127.0.0.1:PORT and call integrity.py as the trainer's saver and loader
do: write_manifest (each rank hashes its share of the sorted files, rank 0 writes the union); then, once rank 0 has
changed one byte of a file of each rank's share, find_problems and verify with the group (the default) and without
it; last, rank 0 alone (rank 1 gone) verifies without the group, as the checkpoint readers do. Prints one JSON line
of what each returned.
"""

import json
import sys
from datetime import timedelta

import torch

from megatron_sat.training import integrity

folder, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                     timeout=timedelta(seconds=60))


def refusal(collective=None):
    try:
        integrity.verify(folder) if collective is None else integrity.verify(folder, collective)
    except integrity.CorruptCheckpoint as e:
        return str(e)
    return None


out = dict(manifest=integrity.write_manifest(folder))
torch.distributed.barrier()
if rank == 0:
    for name in integrity.checkpoint_files(folder)[:2]:  # sorted: the first is rank 0's to hash, the second rank 1's
        with open(f"{folder}/{name}", "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 1]))
torch.distributed.barrier()
manifest = integrity.read_manifest(folder)
out.update(problems=integrity.find_problems(folder, manifest), alone=integrity.find_problems(folder, manifest, False),
           verify=refusal(), verify_alone=refusal(False))
torch.distributed.barrier()
if rank == 0:
    out["verify_last"] = refusal(False)  # rank 1 has left the group: nothing collective may be asked of it
print(json.dumps(out), flush=True)
torch.distributed.destroy_process_group()  # before exit: a gloo group left to interpreter shutdown can abort (SIGABRT)
