"""The run's own records read back after a crash: JSON lines (metrics.jsonl) and whole JSON files (config.json,
the sweep records under runs/_grid/), any of which a node failure or a full disk can leave cut short.

A record that does not read back is never dropped silently nor allowed to stop a resume: the good lines are
kept, the torn one is set aside next to the file (`set_aside`: appended to NAME.torn, or the whole file renamed
to NAME.torn-YYYYmmdd-HHMMSS) with a warning that names where it went, and the run goes on. Rewrites are
durable (`write_durably`: a temporary file, fsync, rename, fsync of the folder), so that the file that
replaces a good one is complete on disk before the old one goes.
"""

import json
import os
import time
from typing import Callable, List, Optional, Tuple


def parse_lines(text: str) -> Tuple[List[Tuple[str, dict]], List[Tuple[int, str]]]:
    """([(line, record)] of the lines that are JSON objects with an integer 'step', [(line number, line)] of the
    others); blank lines are skipped. Every kept line ends with a newline."""
    good, bad = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            good.append((line + "\n", record))
        else:
            bad.append((number, line))
    return good, bad


def read_lines(path: str) -> Tuple[List[Tuple[str, dict]], List[Tuple[int, str]]]:
    """parse_lines of a file (([], []) when it does not exist); bytes that are not UTF-8 (a zero-filled or
    garbled tail) are read as replacement characters, so that the lines around them still count."""
    if not os.path.isfile(path):
        return [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_lines(f.read())


METRICS = "metrics.jsonl"  # a run folder's metrics, one JSON object per line with an integer "step"


def read_metrics(run_dir: str) -> List[dict]:
    """The records of RUN_DIR/metrics.jsonl ([] when there is none), in order; a line that does not read back (cut
    short by a crash, garbled) is left out: the one reader of metrics for tools, the model card and the sweep table
    (the trainer's Monitor sets such lines aside with read_lines when it resumes; analysis/grid.py says where they
    are with parse_lines)."""
    return [record for _, record in read_lines(os.path.join(run_dir, METRICS))[0]]


def set_aside(path: str, bad: List[Tuple[int, str]], log: Callable[[str], None] = print) -> Optional[str]:
    """Append the torn lines of `path` to PATH.torn (earlier ones stay there) and say so; returns that path."""
    if not bad:
        return None
    aside = path + ".torn"
    with open(aside, "a") as f:
        f.write(f"# {len(bad)} line(s) of {os.path.basename(path)} set aside on "
                f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} (line numbers as they were):\n")
        for number, line in bad:
            f.write(f"{number}\t{line}\n")
        f.flush()
        os.fsync(f.fileno())
    numbers = ", ".join(str(n) for n, _ in bad[:5]) + (" ..." if len(bad) > 5 else "")
    log(f"warning: {path}: line(s) {numbers} did not read back (cut short by a crash or a full disk?): set aside "
        f"in {aside}; the other lines are kept and the run goes on")
    return aside


def read_json_file(path: str, log: Callable[[str], None] = print, what: str = "") -> Optional[dict]:
    """A JSON object file; None when there is none. One that does not read back (cut short) is renamed to
    PATH.torn-YYYYmmdd-HHMMSS with a warning (`what` says what is lost with it), and None is returned."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
        if isinstance(record, dict):
            return record
    except ValueError:
        pass
    aside = path + time.strftime(".torn-%Y%m%d-%H%M%S")
    os.replace(path, aside)
    log(f"warning: {path} did not read back ({len(text)} bytes; cut short by a crash or a full disk?): set aside as "
        f"{aside}{'; ' + what if what else ''}")
    return None


def write_durably(path: str, text: str) -> None:
    """Replace `path` by `text` atomically and durably: no reader and no crash ever sees a part of it."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems do not sync folders
        pass
    finally:
        os.close(fd)
