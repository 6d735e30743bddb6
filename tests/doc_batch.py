"""Run the docs' Python commands one after another in this one interpreter (tests/test_docs_commands.py), as bash
would run them from the current folder: `python -m MODULE ARGS`, `python tools/X.py ARGS` (tools/ of the
repository) and the console scripts (`megatron-sat-X ARGS`, from the package's entry points), with `> FILE` taken
as bash takes it. One interpreter saves each command's start (torch and megatron-core imported once).

    python tests/doc_batch.py COMMANDS.json RESULTS.json

COMMANDS.json: a list of command strings; RESULTS.json: a list of {"command", "code", "stdout", "stderr",
"seconds"} in the same order.
"""

import contextlib
import importlib.metadata
import io
import json
import os
import runpy
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _entry(name: str):
    (point,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == name]
    return point.load()


def run(command: str) -> dict:
    words = shlex.split(command)
    target = None
    if ">" in words:  # `... > FILE`: stdout to that file, as bash does
        i = words.index(">")
        words, target = words[:i], words[i + 1]
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved_argv = sys.argv
    start = time.time()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if words[0] == "python" and words[1] == "-m":
                sys.argv = [words[2], *words[3:]]
                runpy.run_module(words[2], run_name="__main__", alter_sys=True)
            elif words[0] == "python":
                path = words[1] if os.path.isabs(words[1]) else os.path.join(ROOT, words[1])
                sys.argv = [path, *words[2:]]
                runpy.run_path(path, run_name="__main__")
            else:
                sys.argv = [words[0], *words[1:]]
                result = _entry(words[0])()
                code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            err.write(e.code + "\n")
    except Exception as e:  # noqa: BLE001 - reported as the command's failure, with its type
        code, _ = 1, err.write(f"{type(e).__name__}: {e}\n")
    finally:
        sys.argv = saved_argv
    if target is not None:
        with open(target, "w") as f:
            f.write(out.getvalue())
    return dict(command=command, code=code, stdout=out.getvalue(), stderr=err.getvalue(),
                seconds=round(time.time() - start, 1))


def main(argv) -> int:
    commands_file, results_file = argv
    results = [run(c) for c in json.load(open(commands_file))]
    with open(results_file, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
