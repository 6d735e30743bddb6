"""Each arch's knowledge lives in its module (megatron_sat/archs/<arch>.py): no library file outside the arch
modules and the registry branches on an arch's name (a static read of every module; nothing is imported).

A branch is a comparison (==, !=, in, not in) with an arch's name as a string literal, a dict literal keyed by
arch names (a per-arch table), or a look-up by one (table["muddformer"], table.get("satformer")). What the arch
modules hold instead: docs/architectures.md ("Bring your own arch").
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
        elif isinstance(node, ast.Subscript) and _names(node.slice):
            found.append((node.lineno, f"looks up {', '.join(_names(node.slice))}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and _names(node.args[0])):
            found.append((node.lineno, f"looks up {', '.join(_names(node.args[0]))}"))
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
    assert arch_branches('x = rows.get("satformer")\ny = t["hyperconnections"]\n') == [
        (1, "looks up satformer"), (2, "looks up hyperconnections")]
    assert arch_branches('x = archs.get(cfg.arch).dense\n') == []


def test_no_library_file_branches_on_an_arch_name():
    bad = [f"{path}:{line}: {what}" for path in _library_files()
           for line, what in arch_branches(open(os.path.join(ROOT, path)).read())]
    assert not bad, ("per-arch knowledge outside megatron_sat/archs/ (move it into the arch's module):\n"
                     + "\n".join(bad))


def test_registry_names_each_arch_once_with_its_words():
    """The six archs in the paper's order, each with its own title and figure colour, and an HF format."""
    from megatron_sat import archs

    assert archs.ARCHS[:6] == ARCH_NAMES
    got = [archs.get(a) for a in ARCH_NAMES]
    assert [a.name for a in got] == list(ARCH_NAMES)
    assert len({a.title for a in got}) == len({a.colour for a in got}) == len({a.hf_model_type for a in got}) == 6
    assert archs.VALUE_RESIDUAL == ("resformer", "satformer") and archs.DENSE == ("denseformer", "muddformer")
    assert archs.BASELINES == ("denseformer", "muddformer", "hyperconnections")


USER_ARCH = '''
from megatron_sat.archs.registry import register
from megatron_sat.archs.resformer import ResFormer


class Mine(ResFormer):
    name = "mine"


register(Mine())
'''


def test_a_users_arch_module_from_the_environment(tmp_path):
    """MSAT_ARCH_MODULES names a user's file: the registry imports it on the first look-up of its name (and not
    into ARCHS, the package's); a file that does not exist is one line naming the variable."""
    import subprocess
    import sys

    (tmp_path / "mine.py").write_text(USER_ARCH)
    probe = ("from megatron_sat import archs; print(archs.get('mine').learned_lambdas(type('M', (), "
             "{'resformer_lambdas': 'learned'})()), 'mine' in archs.ARCHS, archs.arch_errors('mine'))")
    env = dict(os.environ, MSAT_ARCH_MODULES=str(tmp_path / "mine.py"))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False", "[]"], out.stdout + out.stderr
    env["MSAT_ARCH_MODULES"] = str(tmp_path / "absent.py")
    out = subprocess.run([sys.executable, "-c", "from megatron_sat import archs; archs.get('mine')"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"MSAT_ARCH_MODULES: arch file {tmp_path / 'absent.py'} does not exist" in out.stderr
