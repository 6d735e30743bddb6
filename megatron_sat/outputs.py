"""Where a tool may write: never over what it reads.

    check_output("--output", out, {"--load": run_dir})   ValueError naming both when the output folder
                                                         equals, lies inside, or contains an input

`convert_to_hf --load RUN --output RUN --overwrite` once replaced the run folder with the export; every
tool that writes a folder or files checks its outputs against its inputs with this before it starts.
"""

import os
from typing import Dict, Optional


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_output(flag: str, output: Optional[str], inputs: Dict[str, Optional[str]]) -> None:
    """Raise ValueError if `output` is, lies inside, or contains one of the inputs (flag -> path)."""
    if not output:
        return
    out = _real(output)
    for name, path in inputs.items():
        if not path:
            continue
        src = _real(path)
        if _inside(out, src) or _inside(src, out):
            where = "is" if out == src else "lies inside" if _inside(out, src) else "contains"
            raise ValueError(f"{flag} {output} {where} {name} {path}: write to a folder apart from the input")
