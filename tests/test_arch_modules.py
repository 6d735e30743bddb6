"""Each arch's knowledge lives in its module (megatron_sat/archs/<arch>.py): no library file outside the arch
modules and the registry branches on an arch's name (a static read of every module; nothing is imported).

A branch is a comparison (==, !=, in, not in) with an arch's name as a string literal, or a dict literal keyed by
arch names (a per-arch table). What the arch modules hold instead: docs/architectures.md ("Bring your own arch").
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH_NAMES = ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections")
# the arch modules and the registry (megatron_sat/archs/), and the remote code an export ships (written for
# transformers, one model per file: the arch modules name its files)
ALLOWED = (os.path.join("megatron_sat", "archs") + os.sep, os.path.join("megatron_sat", "conversion", "hf_code") + os.sep)


def _library_files():
    for top in ("megatron_sat", "tools"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                path = os.path.relpath(os.path.join(folder, name), ROOT)
                if name.endswith(".py") and not path.startswith(ALLOWED):
                    yield path


def _names(node):
    """The arch names a literal holds (a string, or a tuple/list/set of strings)."""
    if isinstance(node, ast.Constant) and node.value in ARCH_NAMES:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in ARCH_NAMES]
    return []


def arch_branches(source: str):
    """[(line, what)] of each branch on an arch name in one module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                    names = _names(right) + _names(node.left)
                    if names:
                        found.append((node.lineno, f"compares with {', '.join(names)}"))
        elif isinstance(node, ast.Dict):
            names = [n for k in node.keys if k is not None for n in _names(k)]
            if names:
                found.append((node.lineno, f"a table keyed by {', '.join(names)}"))
    return found


def test_the_check_finds_a_branch():
    """The check below could fail: it sees the forms a branch takes."""
    assert arch_branches('if cfg.arch == "muddformer":\n    pass\n') == [(1, "compares with muddformer")]
    assert arch_branches('x = a in ("resformer", "satformer")\n')[0][1] == "compares with resformer, satformer"
    assert arch_branches('C = {"denseformer": 1}\n') == [(1, "a table keyed by denseformer")]
    assert arch_branches('x = archs.get(cfg.arch).dense\n') == []


def test_no_library_file_branches_on_an_arch_name():
    bad = [f"{path}:{line}: {what}" for path in _library_files()
           for line, what in arch_branches(open(os.path.join(ROOT, path)).read())]
    assert not bad, ("per-arch knowledge outside megatron_sat/archs/ (move it into the arch's module):\n"
                     + "\n".join(bad))
