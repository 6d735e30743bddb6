"""Named training recipes: a registry of functions that return trainer argument defaults.

A recipe is a function returning {argument dest: value} (dest names as in
megatron_sat.training.arguments, e.g. "num_layers", "lr", "global_batch_size"). The trainer
applies it as parser defaults, so every command-line flag still overrides it:

    python -m megatron_sat.train --recipe debug_satformer --train-iters 20

Building blocks, meant to be combined by later recipes (e.g. the paper's scaling grid):
    base()          the paper's optimisation settings (AdamW 0.9/0.95, wd 0.1, clip 1.0, cosine to 0.1 lr)
    SIZES[name]     model shapes: tiny/demo (CPU) and the paper's small/medium/large/xl
    model(arch, size, **overrides)   arch + shape
"""

import importlib
import importlib.util
import os
import pkgutil
import sys
from functools import partial
from typing import Callable, Dict

from megatron_sat.archs import ARCHS  # import-free: no megatron
from megatron_sat.model.sizes import PAPER_SCALES

RECIPES: Dict[str, Callable[[], dict]] = {}

# name -> model shape: CPU sizes, and the paper's grid (megatron_sat.model.sizes, the one size table)
SIZES = {
    "tiny": dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128),
    "demo": dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=384),
    **{name: PAPER_SCALES[scale] for name, scale in
       (("small", "130M"), ("medium", "340M"), ("large", "760M"), ("xl", "1.3B"))},
}

def register(name: str = None):
    """Decorator: add a recipe function to RECIPES under `name` (default: the function's name)."""

    def wrap(fn):
        RECIPES[name or fn.__name__] = fn
        return fn

    return wrap


def get(name: str) -> dict:
    """The argument defaults of recipe `name`; ValueError naming the known recipes otherwise.

    `module:function` (or `path/to/file.py:function`) names a recipe outside this repository: a function of an
    importable module (the working directory is on the path) that returns {argument dest: value}."""
    if ":" in name:
        return _external(name)
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(sorted(RECIPES))}, or "
                         "module:function for a recipe of your own")
    return dict(RECIPES[name]())


def _external(name: str) -> dict:
    """The defaults of recipe `module:function` (ValueError with what went wrong)."""
    module_name, _, function = name.rpartition(":")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise ValueError(f"recipe file {module_name} does not exist")
            spec = importlib.util.spec_from_file_location(
                "megatron_sat_recipe_" + os.path.basename(module_name)[:-3], module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` would: modules of the cwd
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ValueError:
        raise
    except Exception as e:  # ImportError, or any error the module raises as it is imported
        raise ValueError(f"recipe {name!r}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ValueError(f"recipe {name!r}: {module_name} has no function {function!r}")
    out = fn()
    if not isinstance(out, dict):
        raise ValueError(f"recipe {name!r} returned {type(out).__name__}, not a dict of trainer arguments")
    return dict(out)


def base(lr: float = 1e-3, **overrides) -> dict:
    """The paper's optimisation settings (AdamW b=(0.9, 0.95), wd 0.1, clip 1.0, cosine to 0.1 lr)."""
    out = dict(lr=lr, min_lr=0.1 * lr, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.1, clip_grad=1.0,
               lr_decay_style="cosine", seed=1234)
    out.update(overrides)
    return out


def model(arch: str, size: str, **overrides) -> dict:
    """Architecture + the shape SIZES[size]."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; known: {', '.join(SIZES)}")
    out = dict(arch=arch, **SIZES[size])
    out.update(overrides)
    return out


def _debug(arch: str) -> dict:
    """A few seconds on a CPU: tiny model, mock data, 20 steps."""
    return dict(**base(lr=3e-3), **model(arch, "tiny"), mock_data=True, vocab_size=256, seq_length=32,
                micro_batch_size=2, global_batch_size=8, train_iters=20, lr_warmup_iters=2,
                log_interval=5, eval_interval=10, eval_iters=2, save_interval=10,
                save=f"runs/debug_{arch}")


for _arch in ARCHS:  # debug_transformer, debug_satformer, ... debug_hyperconnections
    register(f"debug_{_arch}")(partial(_debug, _arch))


@register()
def demo() -> dict:
    """`make demo`: a small SATFormer on the embedded corpus (Python's own docs), BPE vocabulary 4096,
    a few minutes on 2 CPU cores. Data and tokenizer are cached in runs/demo/data."""
    return dict(**base(lr=3e-3), **model("satformer", "demo"), embedded_data="runs/demo/data",
                vocab_size=4096, seq_length=128, micro_batch_size=8, global_batch_size=32,
                train_iters=400, lr_warmup_iters=40, log_interval=10, eval_interval=100, eval_iters=4,
                save_interval=200, save="runs/demo", load="runs/demo")  # a rerun resumes, or says it is done


def _register_submodules() -> None:
    """Import every module of this package (e.g. recipes/paper.py, the paper's grid) so that their
    @register calls run and `--recipe NAME` finds them."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_register_submodules()
