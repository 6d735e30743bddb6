"""A fix for Megatron-Core 0.19's DistributedOptimizer when torch's Adam/AdamW backs it (neither Apex nor
Transformer Engine installed: always on CPU, and on any GPU machine without them). It cannot resume from a
checkpoint there; three fixes, in its methods:

  (a) sharded_state_dict(is_loading=True) on a fresh optimizer: its state_dict() asserts that every (still
      empty) parameter state has a `step`. The states are made first (Megatron's own init_state_fn) with
      step 0; the loaded checkpoint then overwrites all of them.
  (b) the fully reshardable load skips the saved `step` (it is restored from the parameter groups), then
      copies every state tensor it finds, `step` included, from what it skipped (KeyError): each
      parameter's own `step` is passed along.
  (c) that restore gives every parameter the same `step` tensor, which torch's Adam then increments once
      per parameter per step, so the resumed run's bias correction is wrong (seen: a different loss at the
      first resumed step); after loading, each parameter gets its own copy.

With these a distributed-optimizer run resumes exactly (tests/test_train_run.py, DP2 -> DP1). No library
offers the fix; it is applied only to the Megatron-Core versions it was written for (WRITTEN_FOR), and
refused with a message on others, so that an upgrade is checked rather than patched blindly.
"""

import functools

import megatron.core
import torch
from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

WRITTEN_FOR = "0.19."  # megatron-core versions (prefix) whose DistributedOptimizer this module patches


def needed() -> bool:
    return not HAVE_APEX_OR_TE


def apply() -> None:
    """Patch DistributedOptimizer where torch's Adam backs it (idempotent; a no-op with Apex or TE)."""
    if not needed() or getattr(DistributedOptimizer, "_megatron_sat_resume_fix", False):
        return
    version = getattr(megatron.core, "__version__", "?")
    if not version.startswith(WRITTEN_FOR):
        raise RuntimeError(f"megatron_sat's fix for resuming the distributed optimizer with torch's AdamW was written "
                           f"for megatron-core {WRITTEN_FOR}x, not {version}: check whether {__name__} is still "
                           "needed, or install Transformer Engine or Apex (their fused Adam needs no fix)")
    _patch(DistributedOptimizer)


def _patch(cls) -> None:
    orig_sharded, orig_set, orig_load = (cls.sharded_state_dict, cls._set_main_param_and_optimizer_states,
                                         cls.load_state_dict)

    @functools.wraps(orig_sharded)
    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, **kwargs):
        if is_loading and self.init_state_fn is not None:  # (a)
            self.init_state_fn(self.optimizer, self.config)
            for state in self.optimizer.state.values():
                state.setdefault("step", torch.zeros((), dtype=torch.float32))
        return orig_sharded(self, model_sharded_state_dict, is_loading=is_loading, **kwargs)

    @functools.wraps(orig_set)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors:  # (b)
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = dict(tensors, step=step)
        return orig_set(self, model_param, tensors)

    @functools.wraps(orig_load)
    def load_state_dict(self, state_dict):
        result = orig_load(self, state_dict)
        for state in self.optimizer.state.values():  # (c)
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    cls.sharded_state_dict = sharded_state_dict
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    cls.load_state_dict = load_state_dict
    cls._megatron_sat_resume_fix = True
