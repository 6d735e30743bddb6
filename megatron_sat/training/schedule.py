"""The learning-rate schedule of a resumed run: the checkpoint's, or the command's (Megatron-LM's flags).

    --override-opt_param-scheduler       the command's --lr, --min-lr, --lr-warmup-iters, --lr-decay-iters
                                         (default --train-iters), --lr-decay-style and --weight-decay, evaluated
                                         from the resumed step on (as if the run had used them from step 0);
                                         the optimizer's state (Adam moments, step counts) is kept exactly
    --use-checkpoint-opt_param-scheduler the checkpoint's values; the command's are ignored
    neither                              the values must agree; a difference is one line naming both flags
                                         (exit 2), with two exceptions that say which schedule is used:
                                           * a checkpoint at iteration 0 (convert_from_hf's import): nothing
                                             was trained on its schedule, so the command's is used;
                                           * only --train-iters changed (no --lr-decay-iters given): the
                                             checkpoint's decay length is kept, and a line says so and how
                                             to change it.

megatron-core matches the optimizer's saved parameter groups to the new ones by a key that includes each
group's max_lr and min_lr (megatron.core.optimizer.param_group_identifier_keys), so a changed --lr fails
there with "Could not find parameter group with key (...)". `align_param_groups` makes the two sides agree
on the schedule this module chose before the optimizer loads; nothing else in the groups changes. No library
does this for Megatron-Core's optimizers; Megatron-LM's trainer has the same two flags.
"""

import math
from typing import Callable, List, Optional, Tuple

from megatron.core.optimizer.optimizer import param_group_identifier_keys

OVERRIDE, CHECKPOINT = "override", "checkpoint"

# the scheduler's state-dict fields the command sets, and the flags that set them
FIELDS = (("max_lr", "--lr"), ("min_lr", "--min-lr"), ("lr_warmup_steps", "--lr-warmup-iters"),
          ("lr_decay_steps", "--lr-decay-iters"), ("lr_decay_style", "--lr-decay-style"),
          ("start_wd", "--weight-decay"))
LR_KEYS = ("max_lr", "min_lr")  # per parameter group, part of megatron-core's matching key


class ScheduleChanged(ValueError):
    """The command's schedule differs from the checkpoint's and no flag says which to use (exit 2)."""


def wanted(args) -> dict:
    """The scheduler values the command asks for (training/setup.py's scheduler builds them)."""
    decay = args.lr_decay_iters or args.train_iters
    # --lr-warmup-fraction: Megatron-LM's fraction x decay steps (it may fall between two iterations)
    fraction = getattr(args, "lr_warmup_fraction", None)
    warmup = args.lr_warmup_iters if fraction is None else fraction * decay
    return dict(max_lr=float(args.lr), min_lr=float(args.min_lr), lr_warmup_steps=warmup, lr_decay_steps=decay,
                lr_decay_style=args.lr_decay_style, start_wd=float(args.weight_decay))


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)  # 0.1 x 3e-3 == 0.0003
    return a == b


def differences(saved: dict, args) -> List[Tuple[str, str, object, object]]:
    """[(field, flag, checkpoint value, command value)] where they differ."""
    now = wanted(args)
    return [(k, flag, saved.get(k), now[k]) for k, flag in FIELDS if k in saved and not _same(saved.get(k), now[k])]


def _fmt(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _describe(diffs, args) -> str:
    out = []
    for field, flag, old, new in diffs:
        if field == "lr_decay_steps" and not args.lr_decay_iters:
            flag = "decay length (--train-iters)"
        shown = (_fmt(new), _fmt(old))
        if shown[0] == shown[1]:  # past the tolerance, within 6 digits: in full, or the line names no difference
            shown = (repr(new), repr(old))
        out.append(f"{flag} {shown[0]} (checkpoint: {shown[1]})")
    return ", ".join(out)


def choose(saved: Optional[dict], args, iteration: int, log: Callable[[str], None]) -> str:
    """OVERRIDE or CHECKPOINT for a resume from `saved` (the checkpoint's opt_param_scheduler) at `iteration`;
    says which in one line when they differ; ScheduleChanged when they differ and no flag decides."""
    if saved is None:
        return OVERRIDE
    diffs = differences(saved, args)
    if getattr(args, "override_opt_param_scheduler", False):
        if diffs:
            log(f"LR schedule: this command's from iteration {iteration} on (--override-opt_param-scheduler: "
                f"{_describe(diffs, args)}); the optimizer state is kept")
        return OVERRIDE
    if getattr(args, "use_checkpoint_opt_param_scheduler", False):
        if diffs:
            log(f"LR schedule: the checkpoint's (--use-checkpoint-opt_param-scheduler; ignored: {_describe(diffs, args)})")
        return CHECKPOINT
    if not diffs:
        return CHECKPOINT
    if iteration == 0 or saved.get("num_steps", 0) == 0:
        log(f"LR schedule: this command's ({_describe(diffs, args)}): the checkpoint at iteration 0 (an import) "
            "has trained on none")
        return OVERRIDE
    derived = [d for d in diffs if d[0] == "lr_decay_steps" and not args.lr_decay_iters]
    if derived and len(diffs) == 1:
        old = saved["lr_decay_steps"]
        tail = (f"from iteration {old} on the LR stays at --min-lr {_fmt(saved.get('min_lr'))}" if args.train_iters > old
                else f"the LR reaches --min-lr at iteration {old}")
        log(f"LR schedule: the checkpoint's decay over {old} iterations is kept (--train-iters {args.train_iters} "
            f"does not change it; {tail}). To decay over {args.train_iters} instead, pass "
            "--override-opt_param-scheduler (or --lr-decay-iters N with it)")
        return CHECKPOINT
    raise ScheduleChanged(
        f"the LR schedule differs from the checkpoint's at iteration {iteration}: {_describe(diffs, args)}. Pass "
        f"--override-opt_param-scheduler to follow the new one from iteration {iteration} (optimizer state kept), "
        "or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def _key(group: dict) -> tuple:
    """megatron-core's matching key of a parameter group, without its learning rates."""
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys if k not in LR_KEYS)


def _saved_groups(state) -> list:
    """Every saved parameter group in a loaded optimizer state dict (any nesting: chained, distributed)."""
    found = []
    if isinstance(state, dict):
        for k, v in state.items():
            if k == "param_groups" and isinstance(v, list):
                found += [g for g in v if isinstance(g, dict)]
            else:
                found += _saved_groups(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            found += _saved_groups(v)
    return found


def align_param_groups(loaded_optimizer_state, optimizer, mode: str) -> None:
    """Give the saved and the current parameter groups the same max_lr / min_lr (the command's with OVERRIDE,
    the checkpoint's with CHECKPOINT), so that megatron-core matches them; everything else is loaded as saved."""
    current = list(optimizer.param_groups)
    saved = _saved_groups(loaded_optimizer_state)
    source, target = (current, saved) if mode == OVERRIDE else (saved, current)
    values = {}
    for g in source:
        values.setdefault(_key(g), {k: g[k] for k in LR_KEYS if k in g})
    for g in target:
        if _key(g) in values:
            g.update(values[_key(g)])
