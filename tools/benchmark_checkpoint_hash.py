"""What a checkpoint's manifest costs: hashing speed against the write it follows, side by side.

    python tools/benchmark_checkpoint_hash.py                     # 1 GiB in the system temp folder
    python tools/benchmark_checkpoint_hash.py --gib 4 --dir /scratch/me

Writes one file of random bytes in 64 MiB chunks (with fsync, as a checkpoint shard), then hashes it the
way megatron_sat/training/integrity.py does, with xxh3_128 (the default) and BLAKE2b (the fallback without
the xxhash package). The file is read back from the page cache, as a manifest is computed right after the
save. Prints seconds per GiB and each hash's time as a share of the write's. A rank hashes only its share of
a checkpoint's files, so on N ranks per node the wall time divides by about N.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sat.training.integrity import file_digest, xxhash

CHUNK = 64 << 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="file size in GiB")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where to write the file (a checkpoint's disk)")
    args = p.parse_args(argv)
    if args.gib <= 0 or not os.path.isdir(args.dir):
        p.error("--gib must be > 0 and --dir an existing folder")
    size = int(args.gib * (1 << 30)) // CHUNK * CHUNK or CHUNK
    block = os.urandom(CHUNK)
    fd, path = tempfile.mkstemp(dir=args.dir, prefix="hash_bench_", suffix=".distcp")
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for _ in range(size // CHUNK):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
        gib = size / (1 << 30)
        print(f"file: {gib:.2f} GiB in {args.dir}")
        print(f"{'step':<22} {'s/GiB':>8} {'GiB/s':>8} {'x write':>8}")
        print(f"{'write + fsync':<22} {write_s / gib:>8.3f} {gib / write_s:>8.2f} {1.0:>8.2f}")
        for algorithm in (["xxh3_128"] if xxhash is not None else []) + ["blake2b"]:
            t0 = time.perf_counter()
            file_digest(path, algorithm)
            dt = time.perf_counter() - t0
            print(f"{'hash ' + algorithm:<22} {dt / gib:>8.3f} {gib / dt:>8.2f} {dt / write_s:>8.2f}")
        if xxhash is None:
            print("xxhash is not installed: manifests use BLAKE2b (pip install xxhash for xxh3)")
    finally:
        os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
