"""The `megatron_sat` lm-eval backend made known to lm-eval without importing it (torch, megatron-core), so that

    lm_eval --model megatron_sat --model_args checkpoint=runs/satformer --tasks piqa --batch_size 8

works wherever megatron-sat is installed (pip install, wheel or editable).

lm-eval 0.4.13 has no plugin entry-point group for models: its registry knows the models named in
lm_eval/models/__init__.py (as "module:Class" placeholders, loaded on first use) and any class whose module was
imported. So:
  register()  adds "megatron_sat" to lm-eval's model registry as such a placeholder (lm-eval's own mechanism for its
              built-in models); megatron_sat/analysis/lm_eval_backend.py is imported only when the model is built.
  install()   run at interpreter start by megatron_sat_lm_eval.pth, which the package puts into site-packages
              (setup.py): register() runs right after anything imports lm_eval.api.registry, and nothing else
              happens (no lm-eval import at start-up). Hand-written (a meta-path finder) because lm-eval offers no
              hook of its own.
This file imports nothing of megatron_sat (only importlib and sys): setup.py installs a copy of it as the top-level
module megatron_sat_lm_eval_registration, which the .pth imports, so that no interpreter start imports the
megatron_sat package (which would shadow the checkout a command runs in; tests/test_evaluate.py checks both).
megatron-sat-evaluate (tools/evaluate.py) calls register() itself before handing its command line to lm-eval.
"""

import importlib.util
import sys

NAME = "megatron_sat"
BACKEND = "megatron_sat.analysis.lm_eval_backend:MegatronLM"
REGISTRY_MODULE = "lm_eval.api.registry"
# the backend's --model_args (MegatronLM's arguments that a command line can give; any other key is refused):
#   checkpoint         trainer run folder or iter_XXXXXXX folder          batch_size, max_batch_size, device: lm-eval's
#   dtype              auto (the checkpoint's), float32, bfloat16, float16  own flags (device: megatron_sat picks it)
#   max_length         context length (default: the run's --seq-length)  max_gen_toks     generation cap (256)
#   tensor_parallel    TP N under torchrun --nproc-per-node N             verify_checkpoint False: skip the manifest
#   trust_remote_code  accepted and unused (no remote code is run)
MODEL_ARGS = ("checkpoint", "dtype", "max_length", "max_gen_toks", "tensor_parallel", "verify_checkpoint", "batch_size",
              "max_batch_size", "device", "trust_remote_code")


def register() -> None:
    """'megatron_sat' in lm-eval's model registry (a lazy placeholder unless the backend is already imported)."""
    # optional (eval extra); light: no torch, no tasks. lm-eval's get_model fills the registry with its own model
    # names only when it is empty: fill it first, or `--model hf` would be unknown once megatron_sat is in it
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=BACKEND)


class _Loader:  # a loader by duck typing: importlib.abc costs ~10 ms at every interpreter start
    """lm_eval.api.registry's own loader, then register()."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        register()

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self.loader, name)


class _AfterRegistryImport:  # a meta-path finder (duck typing, as _Loader)
    """Finds nothing itself: for lm_eval.api.registry, the spec the other finders give, with _Loader around its loader."""

    def __init__(self):
        self.busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != REGISTRY_MODULE or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Called by megatron_sat_lm_eval.pth at interpreter start (see the module docstring)."""
    if REGISTRY_MODULE in sys.modules:
        register()
    elif not any(isinstance(f, _AfterRegistryImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterRegistryImport())
