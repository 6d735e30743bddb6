"""Checkpoint manifests: every file's size and checksum, written before the tracker names the checkpoint
and checked before a load, so that a flipped byte, a truncated file or a missing shard names its file
instead of loading silently or failing deep inside torch.

    CKPT/manifest.json   {"version": 1, "algorithm": "xxh3_128", "files": {"__0_0.distcp": [size, digest], ...}}

The files are hashed once the checkpoint is written (from the page cache, so mostly at memory speed),
split over the ranks (rank r hashes sorted files r, r + world, ...). xxh3 (the xxhash package) is used when
it imports, else BLAKE2b from hashlib (slower, always there); the manifest records which. Megatron-Core's
dist checkpoints have no checksums of their own (torch.distributed.checkpoint neither), hence this module.
"""

import hashlib
import json
import os
from typing import Dict, List, Optional, Tuple

MANIFEST = "manifest.json"
VERSION = 1
_CHUNK = 8 << 20

try:
    import xxhash
except ImportError:  # an install with --no-deps: BLAKE2b from the standard library
    xxhash = None


class CorruptCheckpoint(RuntimeError):
    """A checkpoint whose files do not match its manifest (the message names the file)."""


def default_algorithm() -> str:
    return "xxh3_128" if xxhash is not None else "blake2b"


def _hasher(algorithm: str):
    if algorithm == "xxh3_128":
        if xxhash is None:
            raise CorruptCheckpoint("this checkpoint's manifest uses xxh3: `pip install xxhash` to verify it, "
                                    "or pass --no-verify-checkpoint")
        return xxhash.xxh3_128()
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=16)
    raise CorruptCheckpoint(f"unknown manifest checksum {algorithm!r} (a newer megatron-sat wrote it?)")


def file_digest(path: str, algorithm: str) -> Tuple[int, str]:
    """(size in bytes, hex digest) of one file, read in 8 MiB chunks."""
    h = _hasher(algorithm)
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def checkpoint_files(directory: str) -> List[str]:
    """The files a manifest covers: every regular file in the folder except the manifest, sorted."""
    return sorted(name for name in os.listdir(directory)
                  if name != MANIFEST and os.path.isfile(os.path.join(directory, name)))


def _my_share(names: List[str], rank: int, world: int) -> List[str]:
    return names[rank::world]


def _gather(local: dict, group_all: bool) -> dict:
    """Union of every rank's dict (all_gather_object), or the local dict alone without a process group."""
    # torch only here and in _rank_world: hashing needs none, and tools/benchmark_checkpoint_hash.py imports
    # this module before parsing its arguments
    import torch

    if not group_all or not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return local
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, local)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


def _rank_world() -> Tuple[int, int]:
    import torch  # see _gather

    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def write_manifest(directory: str, algorithm: Optional[str] = None) -> dict:
    """Hash every file of `directory` (collective: every rank calls it) and write manifest.json on rank 0."""
    algorithm = algorithm or default_algorithm()
    rank, world = _rank_world()
    names = checkpoint_files(directory)
    local = {name: list(file_digest(os.path.join(directory, name), algorithm))
             for name in _my_share(names, rank, world)}
    files = _gather(local, group_all=True)
    manifest = dict(version=VERSION, algorithm=algorithm, files=dict(sorted(files.items())))
    if rank == 0:
        tmp = os.path.join(directory, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, MANIFEST))
    return manifest


def read_manifest(directory: str) -> Optional[dict]:
    """The manifest of a checkpoint folder, None for a checkpoint written before manifests existed."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        files, _ = manifest["files"], manifest["algorithm"]
        if not isinstance(files, dict) or not all(isinstance(v, list) and len(v) == 2 and type(v[0]) is int
                                                  and isinstance(v[1], str) for v in files.values()):
            raise ValueError('"files" is not a mapping of file name to [size, digest]')  # edited by hand
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"{path} is unreadable ({e}); the checkpoint cannot be verified") from None
    return manifest


def find_problems(directory: str, manifest: dict, collective: bool = True) -> List[str]:
    """Every way the folder differs from its manifest, one line each (empty when it matches).

    Collective when a process group exists (each rank hashes its share); a missing or resized file is
    reported without reading it."""
    rank, world = _rank_world() if collective else (0, 1)
    expected: Dict[str, list] = manifest["files"]
    present = set(checkpoint_files(directory))
    problems = {}
    for name in _my_share(sorted(expected), rank, world):
        size, digest = expected[name]
        path = os.path.join(directory, name)
        if name not in present:
            problems[name] = f"{path} is missing"
            continue
        actual_size = os.path.getsize(path)
        if actual_size != size:
            problems[name] = f"{path} has {actual_size:,} bytes, the manifest says {size:,} (truncated or replaced)"
            continue
        if file_digest(path, manifest["algorithm"])[1] != digest:
            problems[name] = f"{path} does not match its checksum (corrupted: bytes changed since it was written)"
    merged = _gather(problems, group_all=collective)
    for name in sorted(present - set(expected)):
        if name.endswith(".distcp"):  # a shard nobody listed: another save wrote into this folder
            merged.setdefault(name, f"{os.path.join(directory, name)} is not in the manifest")
    return [merged[k] for k in sorted(merged)]


def verify(directory: str, collective: bool = True) -> bool:
    """Raise CorruptCheckpoint naming the first bad file; True when verified, False when there is no manifest."""
    manifest = read_manifest(directory)
    if manifest is None:
        return False
    problems = find_problems(directory, manifest, collective)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptCheckpoint(problems[0] + more)
    return True
