"""Checkpoint manifests (megatron_sat/training/integrity.py; docs/reliability_files.md, docs/training.md), called
directly on real files in tmp_path, in one process without a process group: the manifest each file's size and
checksum (xxh3_128, or BLAKE2b), every way a folder can differ from it named in one line (missing, resized,
changed bytes, a shard it does not list), and verify()'s one refusal naming the first. A fraction of a second;
mutation testing's selection (docs/development.md); and, in two processes of a real gloo group (a few seconds), the
same split over two ranks. tests/test_faults_files.py and tests/test_faults.py check real
trainer checkpoints through every reader (slow).
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import xxhash
from train_cli import ROOT, env, free_port
from venv_without import run as run_in
from venv_without import venv_without

from megatron_sat.training import integrity
from megatron_sat.training.integrity import CorruptCheckpoint

SHARDS = {"__0_0.distcp": b"\x00weights" * 100, "__1_0.distcp": b"\x01weights" * 100, "common.pt": b"common",
          ".metadata": b"metadata", "empty.bin": b""}


def checkpoint(folder) -> str:
    """A checkpoint folder of SHARDS, a subfolder (not a file: not covered) and its manifest."""
    os.makedirs(folder)
    for name, data in SHARDS.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(folder, "sub"))
    integrity.write_manifest(str(folder))
    return str(folder)


@pytest.mark.parametrize("algorithm, new", [("xxh3_128", xxhash.xxh3_128),
                                            ("blake2b", lambda: hashlib.blake2b(digest_size=16))])
def test_a_files_size_and_digest(tmp_path, algorithm, new):
    """(size, hex digest) of the whole file, the empty file and one past the 8 MiB read size included."""
    for n in (0, 1, 8 << 20, (8 << 20) + 1, (16 << 20) + 3):
        data = bytes(i % 251 for i in range(n)) if n < 100 else os.urandom(n)
        (tmp_path / "f").write_bytes(data)
        h = new()
        h.update(data)
        assert integrity.file_digest(str(tmp_path / "f"), algorithm) == (n, h.hexdigest()), n


WITHOUT_XXHASH = """
import sys
from megatron_sat.training import integrity
from megatron_sat.training.integrity import CorruptCheckpoint
try:
    integrity.file_digest(sys.argv[1], "xxh3_128")
    line = None
except CorruptCheckpoint as e:
    line = str(e)
print(integrity.default_algorithm())
print(line)
"""


def test_an_algorithm_the_install_cannot_check_is_refused(tmp_path):
    """A manifest of an unknown checksum (a newer megatron-sat); xxh3 on an install without xxhash (pip install
    --no-deps), here a real environment without it (tests/venv_without.py), which writes BLAKE2b manifests itself."""
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(CorruptCheckpoint) as refused:
        integrity.file_digest(str(tmp_path / "f"), "md5")
    assert str(refused.value) == "unknown manifest checksum 'md5' (a newer megatron-sat wrote it?)"
    assert integrity.default_algorithm() == "xxh3_128"
    proc = run_in(venv_without(tmp_path / "venv", "xxhash"), WITHOUT_XXHASH, str(tmp_path / "f"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["blake2b", "this checkpoint's manifest uses xxh3: `pip install xxhash` to "
                                        "verify it, or pass --no-verify-checkpoint"], proc.stdout


def test_the_manifest_lists_every_file_of_the_folder(tmp_path, monkeypatch):
    """Every regular file but the manifest, sorted, [size, digest] each, written atomically (no .tmp left; the
    temporary file in the folder itself, as os.replace moves a file within one file system only, whatever the working
    folder holds); written again, the old manifest is not a file of it. Rank r of W hashes sorted files r, r + W, ..."""
    (tmp_path / "cwd" / "manifest.json.tmp").mkdir(parents=True)  # not a file one could write
    monkeypatch.chdir(tmp_path / "cwd")
    folder = checkpoint(tmp_path / "iter_0000004")
    manifest = json.loads((tmp_path / "iter_0000004" / "manifest.json").read_text())
    assert manifest == dict(version=1, algorithm="xxh3_128", files={
        name: list(integrity.file_digest(os.path.join(folder, name), "xxh3_128")) for name in sorted(SHARDS)})
    assert list(manifest["files"]) == sorted(SHARDS) and manifest["files"]["empty.bin"][0] == 0
    assert sorted(os.listdir(folder)) == sorted([*SHARDS, "manifest.json", "sub"])
    assert integrity.checkpoint_files(folder) == sorted(SHARDS)
    assert integrity.write_manifest(folder, "blake2b") == integrity.read_manifest(folder)
    assert integrity.read_manifest(folder)["algorithm"] == "blake2b" and list(manifest["files"]) == sorted(SHARDS)
    names = ["a", "b", "c", "d", "e"]
    assert [integrity._my_share(names, r, 2) for r in (0, 1)] == [["a", "c", "e"], ["b", "d"]]
    assert [integrity._my_share(names, r, 3) for r in (0, 1, 2)] == [["a", "d"], ["b", "e"], ["c"]]
    assert integrity._my_share(names, 0, 1) == names


SHAPE = '"files" is not a mapping of file name to [size, digest]'


def test_a_folder_without_a_manifest_is_not_verified_and_an_unreadable_one_is_refused(tmp_path):
    """No manifest.json (a checkpoint from before manifests): None, verify() False. One that does not parse, or
    lacks "files" or "algorithm", or is not an object, or whose "files" is not a mapping of name to [size, digest]
    (edited by hand): CorruptCheckpoint naming it, never a TypeError from the check."""
    (tmp_path / "a").mkdir()
    assert integrity.read_manifest(str(tmp_path / "a")) is None and integrity.verify(str(tmp_path / "a")) is False
    (tmp_path / "a" / "manifest.json").mkdir()  # not a file: not a manifest
    assert integrity.read_manifest(str(tmp_path / "a")) is None
    path = tmp_path / "b" / "manifest.json"
    path.parent.mkdir()
    for text, why in (("{", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
                      ('{"algorithm": "xxh3_128"}', "'files'"), ('{"files": {}}', "'algorithm'"),
                      ("[]", "list indices must be integers or slices, not str"),
                      ('{"files": [], "algorithm": "blake2b"}', SHAPE), ('{"files": {"a": 1}, "algorithm": "blake2b"}', SHAPE),
                      ('{"files": {"a": [1]}, "algorithm": "blake2b"}', SHAPE),
                      ('{"files": {"a": [1, "d", 2]}, "algorithm": "blake2b"}', SHAPE),
                      ('{"files": {"a": ["1", "d"]}, "algorithm": "blake2b"}', SHAPE),
                      ('{"files": {"a": [true, "d"]}, "algorithm": "blake2b"}', SHAPE),
                      ('{"files": {"a": [1, 2]}, "algorithm": "blake2b"}', SHAPE)):
        path.write_text(text)
        with pytest.raises(CorruptCheckpoint) as refused:
            integrity.verify(str(path.parent))
        assert str(refused.value) == f"{path} is unreadable ({why}); the checkpoint cannot be verified", text


def _changed(folder, how):
    def flip(name):  # one byte changed, the size kept
        data = bytearray(SHARDS[name])
        data[5] ^= 1
        with open(os.path.join(folder, name), "wb") as f:
            f.write(bytes(data))

    for what, name in how:
        path = os.path.join(folder, name)
        if what == "remove":
            os.remove(path)
        elif what == "truncate":
            os.truncate(path, len(SHARDS[name]) - 1)
        elif what == "append":
            with open(path, "ab") as f:
                f.write(b"x")
        elif what == "flip":
            flip(name)
        else:  # "add": a file the manifest does not list
            with open(path, "wb") as f:
                f.write(b"other save")


# name: what is done to the folder -> find_problems' lines (F: the folder); verify() raises the first, with
# " (and N more)" for N more
PROBLEMS = [
    ("as written", [], []),
    ("a shard removed", [("remove", "__1_0.distcp")], ["F/__1_0.distcp is missing"]),
    ("an empty file removed", [("remove", "empty.bin")], ["F/empty.bin is missing"]),
    ("a shard one byte short", [("truncate", "__0_0.distcp")],
     ["F/__0_0.distcp has 799 bytes, the manifest says 800 (truncated or replaced)"]),
    ("a byte appended", [("append", "common.pt")], ["F/common.pt has 7 bytes, the manifest says 6 (truncated or replaced)"]),
    ("an empty file written to", [("append", "empty.bin")],
     ["F/empty.bin has 1 bytes, the manifest says 0 (truncated or replaced)"]),
    ("one byte changed", [("flip", "__1_0.distcp")],
     ["F/__1_0.distcp does not match its checksum (corrupted: bytes changed since it was written)"]),
    ("another save's shard", [("add", "__9_0.distcp")], ["F/__9_0.distcp is not in the manifest"]),
    ("another file the manifest does not list (not a shard): ignored", [("add", "notes.txt")], []),
    ("two at once", [("remove", "common.pt"), ("append", "__0_0.distcp")],
     ["F/__0_0.distcp has 801 bytes, the manifest says 800 (truncated or replaced)", "F/common.pt is missing"]),
    ("four at once, sorted by name", [("flip", "common.pt"), ("remove", ".metadata"), ("add", "__2_0.distcp"),
                                      ("truncate", "__1_0.distcp")],
     ["F/.metadata is missing", "F/__1_0.distcp has 799 bytes, the manifest says 800 (truncated or replaced)",
      "F/__2_0.distcp is not in the manifest",
      "F/common.pt does not match its checksum (corrupted: bytes changed since it was written)"]),
]


@pytest.mark.parametrize("name, how, lines", PROBLEMS, ids=[row[0] for row in PROBLEMS])
@pytest.mark.parametrize("algorithm", ["xxh3_128", "blake2b"])
def test_every_difference_from_the_manifest_is_named(tmp_path, name, how, lines, algorithm):
    folder = checkpoint(tmp_path / "iter_0000008")
    integrity.write_manifest(folder, algorithm)
    _changed(folder, how)
    lines = [line.replace("F/", folder + "/") for line in lines]
    manifest = integrity.read_manifest(folder)
    assert integrity.find_problems(folder, manifest) == lines  # collective without a process group: this rank all
    assert integrity.find_problems(folder, manifest, collective=False) == lines
    if not lines:
        assert integrity.verify(folder) is True and integrity.verify(folder, collective=False) is True
        return
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    for collective in (True, False):
        with pytest.raises(CorruptCheckpoint) as refused:
            integrity.verify(folder, collective)
        assert str(refused.value) == lines[0] + more


def test_two_ranks_hash_their_shares_and_report_every_problem(tmp_path):
    """Two ranks of a gloo group (tests/workers/manifest_rank.py): the manifest they write together is the one a
    single process writes; with one changed byte in a file of each rank's share, find_problems and verify name both
    on both ranks, with the group and without it, and rank 0 alone verifies without asking anything of rank 1."""
    folder = checkpoint(tmp_path / "iter_0000002")
    os.remove(os.path.join(folder, "manifest.json"))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "workers", "manifest_rank.py"), folder,
                               str(r), "2", port], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.splitlines()[-1]))
    expected = {name: [len(data), xxhash.xxh3_128(data).hexdigest()] for name, data in SHARDS.items()}  # as written
    lines = [f"{folder}/{name} does not match its checksum (corrupted: bytes changed since it was written)"
             for name in (".metadata", "__0_0.distcp")]  # rank 0's first file, rank 1's first
    for rank, out in enumerate(outs):
        manifest = out["manifest"]
        assert (manifest["version"], manifest["algorithm"], list(manifest["files"])) == (1, "xxh3_128", sorted(SHARDS))
        assert manifest["files"] == expected, rank
        assert (out["problems"], out["alone"]) == (lines, lines), rank
        assert out["verify"] == out["verify_alone"] == lines[0] + " (and 1 more)", rank
    assert outs[0]["verify_last"] == lines[0] + " (and 1 more)" and "verify_last" not in outs[1]
    assert integrity.find_problems(folder, integrity.read_manifest(folder)) == lines  # and in one process
    with pytest.raises(CorruptCheckpoint) as refused:
        integrity.verify(folder, collective=False)
    assert str(refused.value) == lines[0] + " (and 1 more)"
