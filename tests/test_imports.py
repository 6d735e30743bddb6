"""Imports run one way, and nothing imports in a circle (a static read of every module; no import is run).

Layers, bottom to top (a module may import its own layer and those below it):
    archs, outputs, compat     facts, path checks, the CPU layer
    model                      specs, layers, V1 and the dense history on the pipeline wire, sizes, FLOPs
    parallel, data             layouts, schedules, process groups; tokenizer, corpus, datasets
    training                   step, trainer, checkpoints, arguments, planner (recipes sit beside it)
    profiling, conversion, analysis, sweep, train   tools built on training (analysis reads sweep records)
`recipes` may import archs and model only. Function-local imports count for the layers (they run too);
the circle check is over module-level imports, the ones that run at import time.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER = {"archs": 0, "outputs": 0, "compat": 0, "model": 1, "parallel": 2, "data": 2, "steptime": 2, "training": 3,
         "recipes": 3, "profiling": 4, "conversion": 4, "analysis": 4, "sweep": 4, "train": 5}


def _modules():
    out = {}
    for top in ("megatron_sat", "recipes"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    out[module] = path
    return out


def _imports(path):
    """[(imported module, at module level?)] of one file, ours only."""
    tree = ast.parse(open(path).read())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [(n, id(node) in top_level) for n in names if n.split(".")[0] in ("megatron_sat", "recipes")]
    return found


def _layer(module):
    parts = module.split(".")
    return parts[0] if parts[0] == "recipes" else (parts[1] if len(parts) > 1 else None)


def test_imports_only_go_down():
    bad = []
    for module, path in _modules().items():
        mine = _layer(module)
        for target, _ in _imports(path):
            theirs = _layer(target)
            if mine in LAYER and theirs in LAYER and LAYER[theirs] > LAYER[mine]:
                bad.append(f"{module} imports {target} ({mine} is below {theirs})")
            if mine == "recipes" and theirs not in ("recipes", "archs", "model"):
                bad.append(f"{module} imports {target} (recipes import archs and model only)")
    assert not bad, "\n".join(sorted(set(bad)))


def test_no_import_circle():
    modules = _modules()
    graph = {m: {t for t, top in _imports(p) if top and t in modules and t != m} for m, p in modules.items()}
    for m in graph:  # a package's __init__ runs before its submodules: importing a.b imports a
        graph[m] |= {".".join(t.split(".")[:i]) for t in set(graph[m]) for i in range(1, t.count(".") + 1)
                     if ".".join(t.split(".")[:i]) in modules and ".".join(t.split(".")[:i]) != m
                     and not m.startswith(".".join(t.split(".")[:i]) + ".")}
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checks_see_violations():
    """The rules above on a planted example, so that an empty result means something."""
    assert _layer("megatron_sat.model.gpt") == "model" and _layer("recipes.paper") == "recipes"
    assert LAYER[_layer("megatron_sat.training.step")] > LAYER[_layer("megatron_sat.model.gpt")]
    assert ("megatron_sat.model.config", True) in _imports(os.path.join(ROOT, "megatron_sat", "model", "gpt.py"))
