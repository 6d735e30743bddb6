"""The paths a run was given, recorded so that they hold from any folder, and its tokenizer found again.

The trainer writes into config.json (trainer.py, through record_paths):
    "launch_dir": the folder it was started in (absolute),
    "paths": {"tokenizer_model": {"typed": "tok/", "resolved": "/abs/tok"}, "data_path": {"typed": [...],
              "resolved": [...]}, ...}: each path flag as typed and made absolute (blend weights kept as they are; a
              --tokenizer-model that is no local path at launch, a hub name, resolves to None).

find_tokenizer (tools/convert_to_hf.py, evaluate --checkpoint) reads the tokenizer from any working folder, for
run folders written before that record too: a relative path is tried from the run's launch folder (recorded, or
read off a relative --save the run recorded: runs/x saved in /work/runs/x was launched in /work), then from the
current folder. Light: no torch.
"""

import os
import re
from typing import List, Optional

# the path flags a run records (args names); data_path and the per-split paths are blends: "w1 p1 w2 p2" or prefixes
PATH_ARGS = ("tokenizer_model", "data_path", "train_data_path", "valid_data_path", "test_data_path", "data_args_path",
             "embedded_data", "data_cache_path")
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # "gpt2", "org/name" (a Hugging Face hub id)


class TokenizerNotFound(FileNotFoundError):
    """The tokenizer a run recorded exists nowhere this process looks (the message names the paths tried)."""


def record_paths(args, cwd: Optional[str] = None) -> dict:
    """{"launch_dir", "paths"} for config.json (module docstring)."""
    cwd = os.path.abspath(cwd or os.getcwd())
    paths = {}
    for name in PATH_ARGS:
        typed = getattr(args, name, None)
        if not typed or typed is True:
            continue
        if isinstance(typed, (list, tuple)):  # a blend: weights stay numbers
            resolved = [x if _NUMBER.match(str(x)) else _absolute(x, cwd) for x in typed]
        elif name == "tokenizer_model":
            resolved = _absolute(typed, cwd)
            resolved = resolved if os.path.exists(resolved) else None  # a hub name, loaded from the cache
        else:
            resolved = _absolute(typed, cwd)
        paths[name] = dict(typed=typed, resolved=resolved)
    return dict(launch_dir=cwd, paths=paths)


def _absolute(path: str, cwd: str) -> str:
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(str(path))))


def launch_dirs(args: dict, run_config: dict, run_dir: Optional[str]) -> List[str]:
    """The folders a relative path of the run may be relative to, most likely first, then the current folder."""
    found = [run_config.get("launch_dir")]
    save = args.get("save") or run_config.get("save")
    if run_dir and save and not os.path.isabs(os.path.expanduser(str(save))):  # runs/x recorded, found at /w/runs/x
        run = os.path.normpath(os.path.abspath(run_dir))
        tail = os.path.normpath(str(save))
        if run.endswith(os.sep + tail):
            found.append(run[:-len(tail) - 1])
    found.append(os.getcwd())
    return list(dict.fromkeys(d for d in found if d))


def find_tokenizer(args: dict, run_config: dict, run_dir: Optional[str]) -> Optional[str]:
    """The run's tokenizer as a local path (or a hub name the run was trained with), or None where the run recorded
    no tokenizer at all (mock data without --tokenizer-model). TokenizerNotFound when it recorded one that exists
    nowhere this looks, with the paths tried."""
    recorded = (run_config.get("paths") or {})
    dirs = launch_dirs(args, run_config, run_dir)
    wanted = []  # (path as typed, already absolute candidates)
    typed = args.get("tokenizer_model")
    if typed:
        entry = recorded.get("tokenizer_model") or {}
        if entry.get("typed") == typed and "resolved" in entry and entry["resolved"] is None:
            return typed  # not a local path when the run started: a hub name (transformers' cache)
        wanted.append((typed, [entry.get("resolved")] if entry.get("typed") == typed else []))
    if args.get("embedded_data"):
        entry = recorded.get("embedded_data") or {}
        wanted.append((os.path.join(args["embedded_data"], "tokenizer"),
                       [os.path.join(entry["resolved"], "tokenizer")] if entry.get("resolved") else []))
    name = run_config.get("tokenizer")
    if name and not str(name).startswith("NullTokenizer"):  # the name the trainer loaded it by (mock data: none)
        wanted.append((str(name), []))
    if not wanted:
        return None
    tried = []
    for path, absolute in wanted:
        path = os.path.expanduser(str(path))
        candidates = absolute + ([path] if os.path.isabs(path) else [os.path.join(d, path) for d in dirs])
        for c in candidates:
            if c and os.path.exists(c):
                return os.path.normpath(c)
            tried.extend([os.path.normpath(c)] if c else [])
    first = str(wanted[0][0])
    if "paths" not in run_config and not os.path.isabs(first) and _HUB_NAME.match(first) and \
            not first.endswith(".json") and not first.startswith("."):
        return first  # a run from before the record: a hub name is as likely as a moved folder (the load will tell)
    raise TokenizerNotFound(f"the run's tokenizer {first} is not found (tried {', '.join(dict.fromkeys(tried))})")
