"""The registry of archs: name -> Arch. Built-in archs are the modules of this package (imported by
megatron_sat/archs/__init__.py); a user's arch module is named in MSAT_ARCH_MODULES (module names or .py paths,
separated by commas), imported on the first look-up of a name the package does not have."""

import importlib
import importlib.util
import os
import sys
from typing import Dict, Tuple

from megatron_sat.archs.base import Arch

ENV = "MSAT_ARCH_MODULES"
_ARCHS: Dict[str, Arch] = {}
_loaded_user_modules = False


def register(arch: Arch) -> Arch:
    """Add `arch` (an Arch instance with its name) to the registry; returns it (ARCH = register(MyArch()))."""
    if not isinstance(arch, Arch) or not arch.name:
        raise TypeError(f"register takes an Arch instance with a name, not {arch!r}")
    if arch.name in _ARCHS and type(_ARCHS[arch.name]) is not type(arch):
        raise ValueError(f"arch {arch.name!r} is registered twice ({type(_ARCHS[arch.name]).__module__} and "
                         f"{type(arch).__module__})")
    _ARCHS[arch.name] = arch
    return arch


def load_user_modules() -> None:
    """Import the modules MSAT_ARCH_MODULES names (once); ValueError saying which one failed and why."""
    global _loaded_user_modules
    if _loaded_user_modules:
        return
    _loaded_user_modules = True
    for ref in filter(None, (r.strip() for r in os.environ.get(ENV, "").split(","))):
        try:
            if ref.endswith(".py"):
                if not os.path.isfile(ref):
                    raise ValueError(f"{ENV}: arch file {ref} does not exist")
                spec = importlib.util.spec_from_file_location("megatron_sat_arch_" + os.path.basename(ref)[:-3], ref)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
            else:
                importlib.import_module(ref)
        except ValueError:
            raise
        except Exception as e:  # ImportError, or any error the module raises as it is imported
            raise ValueError(f"{ENV}: cannot import {ref}: {type(e).__name__}: {e}") from None


def names() -> Tuple[str, ...]:
    """Every registered arch, the package's first (in their order), then the user's."""
    load_user_modules()
    return tuple(_ARCHS)


def registered() -> Tuple[str, ...]:
    """The archs registered so far (without importing MSAT_ARCH_MODULES)."""
    return tuple(_ARCHS)


def known(name: str) -> bool:
    return name in names()


def get(name: str) -> Arch:
    """The Arch registered as `name`; ValueError naming the known ones otherwise."""
    if name not in _ARCHS:
        load_user_modules()
    if name not in _ARCHS:
        raise ValueError(f"unknown arch {name!r}; choose one of {', '.join(_ARCHS)} (or name your arch's module "
                         f"in {ENV}: docs/architectures.md)")
    return _ARCHS[name]
