"""Read back what a wandb offline run wrote: the records of its run-<id>.wandb file.

wandb 0.31 ships no Python reader of its .wandb files (the Go core writes them; `wandb sync` uploads them), so the
file format is read here by hand: a 7-byte header (":W&B", magic, version), then LevelDB-log blocks of 32 KiB, each
record a 7-byte header (crc32, length, type FULL/FIRST/MIDDLE/LAST) and its bytes; a record is a wandb Record
protobuf (wandb.proto.wandb_internal_pb2, shipped with wandb).
"""

import glob
import json
import os
import struct

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str):
    from wandb.proto import wandb_internal_pb2 as pb  # wandb: optional (the train extra), seconds to import

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb transaction log (header {data[:7]!r})")
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the tail of a block too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FIRST, FULL):
            buf = chunk
        else:
            buf += chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def offline_runs(folder: str) -> list:
    """[{"id", "name", "group", "history": [{key: value}]}] of every offline-run-* folder below folder/wandb, in
    the order they were made."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "wandb", "offline-run-*", "run-*.wandb"))):
        run = dict(path=path, history=[])
        for r in records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run.update(id=r.run.run_id, name=r.run.display_name, group=r.run.run_group)
            elif kind == "history":
                run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in r.history.item})
        out.append(run)
    return out
