"""Make megatron-core 0.19.x run on CPU (gloo backend) when no GPU is present.

This module is the ONLY place in megatron-sat that works around megatron-core's CUDA assumptions.  Call
:func:`ensure_cpu_compat` once per process, before building megatron objects (it is idempotent and cheap).  When
``torch.cuda.is_available()`` is true it does nothing at all, so behaviour on a GPU is never changed.

Design: instead of monkeypatching ``torch`` for the whole process, the patches are scoped to megatron-core's own
modules.  Every ``megatron.core.*`` module (already imported, or imported later: an import hook on
``sys.meta_path`` covers megatron's many lazy imports) gets its module-global name ``torch`` rebound to a thin proxy
of the real ``torch`` module; the proxy differs from ``torch`` only where megatron hard-codes CUDA.  Code outside
megatron.core (torch itself, deepspeed, transformers, our own code) sees the unmodified torch.  One patch is
process-wide (P8) and it only changes a call that always raises on a CPU-only torch.  ``torch.cuda.is_available()``
stays False everywhere, so megatron code that checks it keeps taking its own CPU branches.

Patches (all applied only when CUDA is unavailable):

P1  ``torch.cuda`` as seen by megatron.core -> a CPU shim (:class:`_CudaShim`); megatron has ~400 such calls:
    ``current_device()`` returns ``torch.device('cpu')`` (megatron mostly passes it as ``device=``);
    ``synchronize``/``set_device``/``empty_cache``/``reset_peak_memory_stats``/``nvtx.*``: no-ops;
    ``current_stream``/``default_stream``/``Stream``/``stream()``/``Event``: dummy objects (CPU ops are synchronous);
    ``get_rng_state``/``set_rng_state``/``manual_seed``/``manual_seed_all``/``initial_seed``: the CPU default
    generator, which on CPU plays the part of the CUDA generator (dropout, weight init, activation recompute);
    ``memory_allocated`` & co.: 0.  Everything else falls through to the real ``torch.cuda``.
P2  ``device='cuda'`` / ``'cuda:N'`` / an int ordinal / ``torch.device('cuda', N)`` in megatron.core -> CPU: the
    proxy's tensor factories (``torch.zeros``, ``torch.tensor``, ``torch.empty_like`` ...) rewrite a CUDA
    ``device`` argument (and drop ``pin_memory=True``, which needs an accelerator); the proxy's ``torch.device``
    maps CUDA to CPU while ``isinstance(x, torch.device)`` keeps working.  Hit by e.g. the grad scalers,
    ``clip_grads`` and optimizer buffers, the schedules' token counters, ``get_causal_mask``, DDP's warm-up tensor
    and dist-checkpointing's exchange/validation buffers.
P3  RNG tracker (``tensor_parallel.random``): ``_get_cuda_rng_state``/``_set_cuda_rng_state`` read/write the CPU
    generator, and ``CudaRNGStatesTracker`` is replaced by a subclass whose ``fork`` does not log "CPU RNG state
    changed within GPU RNG context" on every call (on CPU the tracked state *is* the CPU state).  With P1 this
    makes ``model_parallel_cuda_manual_seed``, the forked streams (TP-rank-specific init and dropout) and
    activation recomputation (``CheckpointFunction`` replays the saved RNG states) work with the GPU semantics:
    same streams and seed offsets, held by the CPU generator.
P4  ``'torch.cuda.FloatTensor'``-style type-string checks -> CPU type strings, by recompiling the few functions
    that contain them (source text rewrite ``'torch.cuda.XTensor'`` -> ``'torch.XTensor'``, same globals, same
    closure cells): ``optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (asserted a CUDA fp32 grad: gradient
    clipping with ``clip_grad > 0`` failed), ``DistributedOptimizer._build_model_and_main_param_groups``
    (refused non-CUDA params: ``use_distributed_optimizer=True`` failed; it now works on CPU, reduce-scatter and
    all-gather run on gloo) and ``Float16OptimizerWithFloat16Params.__init__`` (bf16/fp16 params).  The rewrite
    raises if the text is not found, so a megatron upgrade that changes these functions fails loudly.
P5  ``torch.distributed.barrier(..., device_ids=[...])`` in megatron.core (parallel_state) -> ``device_ids``
    dropped (an NCCL-only argument); done through the proxy's ``torch.distributed``.
P6  ``megatron.core.jit.jit_fuser`` -> no-op decorator for modules imported after the patch, and functions that
    were already wrapped by ``torch.compile`` (modules imported before the patch) are replaced by their eager
    originals, so that megatron's fused elementwise helpers (bias-dropout-add, bias-GeLU/SwiGLU, ...) are not
    sent to inductor (a C++ build per shape on CPU: about 20 s for the first step of a tiny GPT on 2 cores).
    Numerics are unchanged (the eager function is the same function).
P7  ``transformer.torch_norm.WrappedTorchNorm`` (megatron's torch.nn.LayerNorm/RMSNorm fallback, used by
    ``get_gpt_layer_local_spec`` when Apex is absent, i.e. always on CPU) asserts ``not sequence_parallel``
    only because it does not mark its parameters.  Patched: with sequence_parallel it builds the same norm and
    sets ``param.sequence_parallel = True`` (as megatron's FusedLayerNorm does), so ``finalize_model_grads``
    all-reduces the norm gradients over the TP group.  This makes ``sequence_parallel=True`` work on CPU.
P8  ``torch.Tensor.cuda`` (process-wide, the only global patch) -> returns the tensor itself (already on the only
    device).  On a CPU-only torch this call always raises, so no working code changes behaviour.  megatron calls
    it for tied embeddings with PP>1, ``tensor_parallel.broadcast_data``, checkpoint exchange and optimizer
    state reloads.

P9-P12 serve the dry run (megatron_sat/profiling/dry_run.py) and act only inside :func:`meta_device` or under
torch's fake process group:
P9  ``meta_device()``: megatron's CUDA device is the meta device; ``.item()``/``float()``/``int()``/``bool()``/
    ``.tolist()`` of a meta tensor read 0 (megatron reads a few scalars in a step), ``Tensor.type()`` of a meta tensor
    reads as a CPU type (P4's checks), ``torch.tensor([[meta scalars]])`` in megatron gives a meta tensor.
P10 under the fake backend, megatron's gloo side groups are fake groups (gloo cannot be built on a FakeStore).
P11 Meta kernels for the four coalesced c10d collectives (torch 2.13 has none), handing them to the fake backend.
P12 ``scaled_dot_product_attention`` on meta tensors runs the kernel the CPU would pick (flash), not the math one.

(The distributed optimizer's resume with torch's Adam, a megatron-core bug rather than a CPU matter, is mended
for CPU and GPU alike in megatron_sat/training/optimizer_resume.py.)

Checked and deliberately not patched: ``torch.cuda.current_device`` & co. outside megatron.core (only megatron's
view, P1, changes); ``transformer.module._FLOAT_TYPES`` (already includes ``torch.FloatTensor``); megatron's
fallbacks when Apex/TE are absent (torch AdamW/SGD, local multi-tensor applier) work on CPU as they are.

Limits: module-level code of a megatron module runs with the real torch (the proxy is bound right after the module
body ran; no megatron module needs CUDA at import); four megatron functions do a local ``import torch`` and see
the real module (none is on the CPU paths tested); TransformerEngine and Apex code paths stay GPU-only.

Verified by tests/test_compat.py (one 2-rank gloo launch): initialize_model_parallel + RNG tracker, GPTModel
fwd/bwd, recompute with dropout, TP=2 (with and without sequence parallel) == TP=1, DDP DP=2 +
finalize_model_grads, get_megatron_optimizer with clip_grad (exact SGD check) and with the distributed
optimizer (== plain), dist_checkpointing torch_dist save/load incl. TP=2 -> TP=1, PP=2 schedule == PP=1.

Public API: :func:`ensure_cpu_compat`, :func:`device`, :func:`dist_backend`, :func:`is_cpu_mode`, FAKE_BACKEND,
:func:`forget_cached_torch_attributes`; :func:`meta_device` (P9, P11, P12) lives in compat/meta.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.abc
import inspect
import logging
import os
import re
import sys
import textwrap
import threading
import types
import warnings

import torch

__all__ = ["ensure_cpu_compat", "device", "dist_backend", "is_cpu_mode", "FAKE_BACKEND", "forget_cached_torch_attributes"]

_log = logging.getLogger(__name__)
_LOCK = threading.RLock()
_APPLIED = False
_CPU = torch.device("cpu")
_META = torch.device("meta")
# torch's fake process group for CPU and meta tensors (the dry run's world; P10, P11)
FAKE_BACKEND = "cpu:fake,meta:fake"
_TARGET = [_CPU]  # where megatron's "CUDA" tensors go: the CPU, or the meta device inside meta_device() (P9)
_MEGATRON_PREFIX = "megatron.core"


def is_cpu_mode() -> bool:
    """True when no CUDA device is usable (the compatibility layer applies)."""
    return not torch.cuda.is_available()


def device() -> torch.device:
    """The device to put tensors on: the current CUDA device on a GPU machine, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _TARGET[0]


def dist_backend() -> str:
    """The torch.distributed backend to use: 'nccl' on a GPU machine, else 'gloo'."""
    return "nccl" if torch.cuda.is_available() else "gloo"


# ---------------------------------------------------------------------------------------------------------------
# P1: the torch.cuda shim megatron.core sees
# ---------------------------------------------------------------------------------------------------------------
class _DummyStream:
    """Stands in for torch.cuda.Stream: CPU work is synchronous, so every operation is a no-op."""

    def __init__(self, *args, **kwargs):
        self.device = _CPU
        self.priority = kwargs.get("priority", 0)

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event if event is not None else _DummyEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, _DummyStream)

    def __hash__(self):
        return 0


class _DummyEvent:
    """Stands in for torch.cuda.Event."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_DUMMY_STREAM = _DummyStream()


def _noop(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


class _NvtxShim(types.ModuleType):
    def __getattr__(self, name):
        if name == "range":
            return lambda *a, **k: contextlib.nullcontext()
        return _noop


class _CudaShim(types.ModuleType):
    """megatron.core's view of ``torch.cuda`` on a CPU-only machine (see P1)."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.__dict__.update(
            current_device=lambda: _TARGET[0],
            synchronize=_noop,
            set_device=_noop,
            empty_cache=_noop,
            reset_peak_memory_stats=_noop,
            reset_max_memory_allocated=_noop,
            memory_allocated=_zero,
            max_memory_allocated=_zero,
            memory_reserved=_zero,
            max_memory_reserved=_zero,
            current_stream=lambda *a, **k: _DUMMY_STREAM,
            default_stream=lambda *a, **k: _DUMMY_STREAM,
            Stream=_DummyStream,
            Event=_DummyEvent,
            stream=lambda s=None: contextlib.nullcontext(),
            nvtx=_NvtxShim("torch.cuda.nvtx"),
            get_rng_state=lambda device="cuda": torch.get_rng_state(),
            set_rng_state=lambda new_state, device="cuda": torch.set_rng_state(new_state),
            manual_seed=lambda seed: torch.default_generator.manual_seed(int(seed)),
            manual_seed_all=lambda seed: torch.default_generator.manual_seed(int(seed)),
            initial_seed=lambda: torch.default_generator.initial_seed(),
            is_available=torch.cuda.is_available,
        )

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


# ---------------------------------------------------------------------------------------------------------------
# P2: device='cuda' -> cpu, and the torch proxy
# ---------------------------------------------------------------------------------------------------------------
def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    if isinstance(dev, int) and not isinstance(dev, bool):
        return True  # an int device is a CUDA ordinal
    return False


class _DeviceMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.device)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, torch.device)

    def __call__(cls, *args, **kwargs):
        if args and (args[0] == "cuda" or (isinstance(args[0], str) and args[0].startswith("cuda:"))):
            return _TARGET[0]
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            return _TARGET[0]
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            return _TARGET[0]
        if kwargs.get("type") == "cuda":
            return _TARGET[0]
        return torch.device(*args, **kwargs)


class _ProxyDevice(metaclass=_DeviceMeta):
    """megatron.core's ``torch.device``: CUDA devices map to CPU; isinstance checks use the real class."""


_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "linspace", "rand", "randn", "randint",
    "randperm", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "eye",
    "empty_strided", "tril_indices", "triu_indices", "scalar_tensor",
)


def _holds_meta(data) -> bool:
    if isinstance(data, torch.Tensor):
        return data.is_meta
    return isinstance(data, (list, tuple)) and any(_holds_meta(x) for x in data)


def _nested_shape(data) -> tuple:
    if isinstance(data, torch.Tensor):
        return tuple(data.shape)
    return (len(data),) + (_nested_shape(data[0]) if data else ())


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs["device"] = _TARGET[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinned memory needs an accelerator
        if _TARGET[0] is _META and fn is torch.tensor and args and _holds_meta(args[0]):
            # P9: torch.tensor([[meta scalars]]) reads their values (megatron's local L2 norm): a meta tensor of
            # that shape instead
            return torch.empty(_nested_shape(args[0]), dtype=kwargs.get("dtype") or torch.float32, device=_META)
        return fn(*args, **kwargs)

    return wrapper


def _barrier(*args, **kwargs):
    # P5: device_ids is an NCCL-only argument.
    kwargs.pop("device_ids", None)
    return torch.distributed.barrier(*args, **kwargs)


def _new_group(*args, **kwargs):
    # P10: under torch's fake backend (the dry run) megatron's gloo side groups are fake too: a gloo group cannot
    # be built over a FakeStore, and no data moves in a dry run anyway.
    if kwargs.get("backend") == "gloo" and "fake" in str(torch.distributed.get_backend()):
        kwargs["backend"] = FAKE_BACKEND
    return torch.distributed.new_group(*args, **kwargs)


class _DistProxy(types.ModuleType):
    def __init__(self):
        super().__init__("torch.distributed")
        self.__dict__["barrier"] = _barrier
        self.__dict__["new_group"] = _new_group

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


class _TorchProxy(types.ModuleType):
    """What megatron.core modules see as ``torch``: the real module except for P1, P2, P5."""

    def __init__(self):
        super().__init__("torch")
        self.__dict__["cuda"] = _CudaShim()
        self.__dict__["device"] = _ProxyDevice
        self.__dict__["distributed"] = _DistProxy()
        for name in _FACTORIES:
            if hasattr(torch, name):
                self.__dict__[name] = _wrap_factory(getattr(torch, name))

    def __getattr__(self, name):
        value = getattr(torch, name)
        # Cache so later lookups skip __getattr__ (attribute access stays as fast as on a module).
        self.__dict__[name] = value
        return value

    def __dir__(self):
        return dir(torch)


_TORCH_PROXY: _TorchProxy | None = None


def _uncompiled(obj):
    """The eager function behind a torch.compile wrapper (P6), else None."""
    orig = getattr(obj, "_torchdynamo_orig_callable", None)
    return orig if orig is not None and callable(orig) else None


def _patch_module_globals(module) -> None:
    d = getattr(module, "__dict__", None)
    if d is None:
        return
    if d.get("torch") is torch:
        d["torch"] = _TORCH_PROXY
    # P6 for modules imported before ensure_cpu_compat(): undo @jit_fuser (torch.compile) on module-level
    # functions and on methods of classes defined in this module.
    for name, value in list(d.items()):
        orig = _uncompiled(value)
        if orig is not None:
            d[name] = orig
        elif isinstance(value, type) and getattr(value, "__module__", None) == module.__name__:
            for attr, member in list(vars(value).items()):
                orig = _uncompiled(member)
                if orig is not None:
                    setattr(value, attr, orig)


class _PatchingLoader(importlib.abc.Loader):
    """Wraps the real loader of a megatron.core module; rebinds ``torch`` after the module body ran."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # Run the module body with the real torch ... then give the module the proxy.  Module-level code
        # that calls torch.cuda at import time would therefore still see the real one; megatron's does not
        # need it (it only reads attributes such as torch.cuda.FloatTensor).
        self._loader.exec_module(module)
        _patch_module_globals(module)
        _apply_module_specific(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _MegatronFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not (fullname == _MEGATRON_PREFIX or fullname.startswith(_MEGATRON_PREFIX + ".")):
            return None
        spec = None
        for finder in sys.meta_path:  # the finders after us (editable installs, zip imports, PathFinder ...)
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader)
        return spec


# ---------------------------------------------------------------------------------------------------------------
# P3: CPU RNG tracker
# ---------------------------------------------------------------------------------------------------------------
def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _patch_random(mod) -> None:
    if getattr(mod, "_megatron_sat_cpu_patched", False):
        return
    mod._get_cuda_rng_state = _cpu_get_rng_state
    mod._set_cuda_rng_state = _cpu_set_rng_state
    base = mod.CudaRNGStatesTracker
    default_name = mod._MODEL_PARALLEL_RNG_TRACKER_NAME

    class CPURNGStatesTracker(base):
        """CudaRNGStatesTracker on the CPU generator (megatron_sat.compat, P3)."""

        @contextlib.contextmanager
        def fork(self, name=default_name):
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            orig_state = _cpu_get_rng_state()
            orig_state_name = self._current_state_name
            if orig_state_name != "default-rng":
                self.states_[orig_state_name] = orig_state
            _cpu_set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(
                        f"current state name {self._current_state_name} is not the same as the desired "
                        f"state name {name}."
                    )
                self.states_[name] = _cpu_get_rng_state()
                if orig_state_name != "default-rng":
                    orig_state = self.states_[orig_state_name]
                _cpu_set_rng_state(orig_state)
                self._current_state_name = orig_state_name

    CPURNGStatesTracker.__name__ = CPURNGStatesTracker.__qualname__ = "CPURNGStatesTracker"
    mod.CudaRNGStatesTracker = CPURNGStatesTracker
    # A tracker created before the patch (e.g. by an earlier import) is replaced on next initialization.
    tracker = getattr(mod, "_CUDA_RNG_STATE_TRACKER", None)
    if tracker is not None and type(tracker) is base:
        tracker.__class__ = CPURNGStatesTracker
    mod._megatron_sat_cpu_patched = True


# ---------------------------------------------------------------------------------------------------------------
# P4: 'torch.cuda.FloatTensor' type-string checks
# ---------------------------------------------------------------------------------------------------------------
def _rewrite_cuda_type_strings(func, module_globals):
    """Recompile ``func`` with 'torch.cuda.XTensor' string literals replaced by 'torch.XTensor'."""
    src = textwrap.dedent(inspect.getsource(func))
    new_src = src.replace("'torch.cuda.", "'torch.").replace('"torch.cuda.', '"torch.')
    if new_src == src:
        raise RuntimeError(
            f"megatron_sat.compat: expected a CUDA type-string check in {func.__qualname__}; "
            "megatron-core changed: update megatron_sat/compat/cpu.py (patch P4)"
        )
    # Only @staticmethod/@classmethod decorators are expected (the caller re-wraps); drop them.
    lines = new_src.splitlines(keepends=True)
    while lines and lines[0].lstrip().startswith("@"):
        assert lines[0].strip() in ("@staticmethod", "@classmethod"), (func.__qualname__, lines[0])
        lines.pop(0)
    new_src = "".join(lines)
    freevars = func.__code__.co_freevars
    if freevars:
        # Closure (e.g. ``__class__`` for zero-argument super()): define the function inside a factory that
        # declares the free variables, then point the new cells at the original cells' contents.
        body = "".join(f"    {v} = None\n" for v in freevars)
        body += textwrap.indent(new_src, "    ") + f"    return {func.__name__}\n"
        new_src = "def __megatron_sat_factory():\n" + body
    code = compile(new_src, inspect.getsourcefile(func) or "<megatron_sat.compat>", "exec")
    ns: dict = {}
    exec(code, module_globals, ns)
    if freevars:
        new_func = ns["__megatron_sat_factory"]()
        for var, cell in zip(new_func.__code__.co_freevars, new_func.__closure__):
            cell.cell_contents = func.__closure__[freevars.index(var)].cell_contents
    else:
        new_func = ns[func.__name__]
    new_func.__qualname__ = func.__qualname__
    new_func.__module__ = func.__module__
    new_func.__defaults__ = func.__defaults__
    new_func.__kwdefaults__ = func.__kwdefaults__
    new_func._megatron_sat_cpu_patched = True
    return new_func


def _patch_clip_grads(mod) -> None:
    f = mod.clip_grad_by_total_norm_fp32
    if not getattr(f, "_megatron_sat_cpu_patched", False):
        mod.clip_grad_by_total_norm_fp32 = _rewrite_cuda_type_strings(f, mod.__dict__)


def _patch_method(cls, name, mod):
    attr = cls.__dict__[name]
    wrapper = type(attr) if isinstance(attr, (staticmethod, classmethod)) else None
    f = attr.__func__ if wrapper else attr
    if not getattr(f, "_megatron_sat_cpu_patched", False):
        new = _rewrite_cuda_type_strings(f, mod.__dict__)
        setattr(cls, name, wrapper(new) if wrapper else new)


def _patch_distrib_optimizer(mod) -> None:
    _patch_method(mod.DistributedOptimizer, "_build_model_and_main_param_groups", mod)


def _patch_optimizer(mod) -> None:
    _patch_method(mod.Float16OptimizerWithFloat16Params, "__init__", mod)


def _patch_jit(mod) -> None:
    mod.jit_fuser = mod.noop_decorator


def _patch_torch_norm(mod) -> None:
    """P7: let megatron's torch LayerNorm/RMSNorm fallback run with sequence_parallel."""
    cls = mod.WrappedTorchNorm
    orig_new = cls.__dict__["__new__"]
    orig_new = getattr(orig_new, "__func__", orig_new)
    if getattr(orig_new, "_megatron_sat_cpu_patched", False):
        return

    def __new__(cls_, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return orig_new(cls_, config, *args, **kwargs)
        cfg = copy.copy(config)
        object.__setattr__(cfg, "sequence_parallel", False)
        norm = orig_new(cls_, cfg, *args, **kwargs)
        # Same marking as megatron's FusedLayerNorm: finalize_model_grads all-reduces these grads over TP.
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    __new__._megatron_sat_cpu_patched = True
    cls.__new__ = staticmethod(__new__)


_MODULE_PATCHES = {
    "megatron.core.jit": _patch_jit,
    "megatron.core.transformer.torch_norm": _patch_torch_norm,
    "megatron.core.tensor_parallel.random": _patch_random,
    "megatron.core.optimizer.clip_grads": _patch_clip_grads,
    "megatron.core.optimizer.distrib_optimizer": _patch_distrib_optimizer,
    "megatron.core.optimizer.optimizer": _patch_optimizer,
}


def _apply_module_specific(module) -> None:
    patch = _MODULE_PATCHES.get(getattr(module, "__name__", ""))
    if patch is not None:
        patch(module)
        # Other modules may hold the original functions imported by name: refresh them.
        _refresh_imported_names(module)


def _refresh_imported_names(patched) -> None:
    """After patching module M, rebind ``from M import f`` copies of replaced functions in megatron modules."""
    name = patched.__name__
    replacements = {}
    if name == "megatron.core.optimizer.clip_grads":
        replacements["clip_grad_by_total_norm_fp32"] = patched.clip_grad_by_total_norm_fp32
    elif name == "megatron.core.tensor_parallel.random":
        replacements["_get_cuda_rng_state"] = patched._get_cuda_rng_state
        replacements["_set_cuda_rng_state"] = patched._set_cuda_rng_state
    if not replacements:
        return
    for mname, m in list(sys.modules.items()):
        if m is None or m is patched or not mname.startswith(_MEGATRON_PREFIX):
            continue
        d = getattr(m, "__dict__", {})
        for attr, new in replacements.items():
            old = d.get(attr)
            if old is not None and old is not new and getattr(old, "__name__", None) == attr:
                d[attr] = new


# ---------------------------------------------------------------------------------------------------------------
# P8: Tensor.cuda
# ---------------------------------------------------------------------------------------------------------------
def _tensor_cuda_cpu(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    if memory_format is not torch.preserve_format:
        return self.contiguous(memory_format=memory_format)
    return self


WRITTEN_FOR = "0.19."  # the megatron-core versions (prefix) these patches were written and tested against


def _check_version() -> None:
    """Warn once when megatron-core is not a version the patches were written for (P4 fails loudly on its own)."""
    from importlib.metadata import PackageNotFoundError, version  # only when the patches are applied

    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        return
    if not found.startswith(WRITTEN_FOR):
        warnings.warn(f"megatron_sat.compat was written for megatron-core {WRITTEN_FOR}x; megatron-core {found} is "
                      "installed: run tests/test_compat.py before trusting CPU runs", stacklevel=3)


def ensure_cpu_compat() -> bool:
    """Apply the CPU compatibility patches (see module docstring).  Idempotent.

    Returns True when running in CPU mode (patches applied), False on a GPU machine (nothing done).
    """
    global _APPLIED, _TORCH_PROXY
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _APPLIED:
            return True
        _check_version()
        # a GPU stream setting megatron-core recommends for its async gradient all-reduce: nothing to set on CPU
        if not os.environ.get("MEGATRON_SAT_VERBOSE"):  # known_warnings.py lists it
            warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core\.tensor_parallel\.layers\Z",
                                    message=re.escape("When using async grad allreduce it is recommended to set the "
                                                      "environment variable CUDA_DEVICE_MAX_CONNECTIONS"))
        _TORCH_PROXY = _TorchProxy()
        # Import hook first, so that megatron modules imported from here on are patched as they load.
        sys.meta_path.insert(0, _MegatronFinder())
        torch.Tensor.cuda = _tensor_cuda_cpu  # P8
        for name, module in list(sys.modules.items()):
            if module is not None and (name == _MEGATRON_PREFIX or name.startswith(_MEGATRON_PREFIX + ".")):
                _patch_module_globals(module)
        for name in _MODULE_PATCHES:
            if name in sys.modules and sys.modules[name] is not None:
                _apply_module_specific(sys.modules[name])
        _APPLIED = True
        _log.debug("megatron_sat.compat: CPU compatibility patches applied")
        return True


def forget_cached_torch_attributes() -> None:
    """Let megatron modules see torch functions patched after they were first used (CPU mode; a no-op otherwise).
    megatron.core modules see `torch` through the proxy of P2, which caches every attribute on first use, so a
    function patched later (DeepSpeed's FLOPs profiler patches torch.matmul) would stay invisible: drop the cached
    entries that are plain copies of torch's current attributes, and the next lookup fetches what torch holds now."""
    proxy = _TORCH_PROXY
    if proxy is None:
        return
    for name, value in list(proxy.__dict__.items()):
        if not name.startswith("__") and getattr(torch, name, None) is value:
            del proxy.__dict__[name]
