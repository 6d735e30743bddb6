"""The LR schedule of a resumed run (megatron_sat/training/schedule.py; docs/reliability_signals.md, "Changing the
learning rate of a run on resume"), called directly: which schedule choose() follows for each pair of flags, the
exact line it says or refuses with, each schedule value at both sides of the comparison's tolerance, and
align_param_groups giving the saved and the current parameter groups the chosen max/min LR and nothing else.

The checkpoint's side is a real one: Megatron-Core's OptimizerParamScheduler state dict, built by the trainer's own
training/setup.scheduler and stepped to iteration 8, and a real torch optimizer's state dict. A fraction of a second;
mutation testing's selection (docs/development.md). tests/test_faults_signals.py resumes real runs under the same
rules (seconds to minutes each).
"""

import argparse

import pytest
import torch

from megatron_sat.training import schedule
from megatron_sat.training.arguments import parse_args
from megatron_sat.training.setup import scheduler

TINY = ["--arch", "satformer", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--global-batch-size", "2", "--mock-data", "--vocab-size", "64", "--train-iters", "16", "--lr", "3e-3",
        "--min-lr", "3e-4", "--lr-warmup-iters", "2"]
BASE = parse_args([*TINY, "--save", "/nonexistent/r"])  # cosine, --weight-decay 0.1; parsed once: a fraction of a s


DROP = object()  # a value that removes the attribute (a namespace written before the flag existed)


def command(**values) -> argparse.Namespace:
    """BASE with `values` (dest=value), as the resuming command resolves them."""
    return argparse.Namespace(**{k: v for k, v in dict(vars(BASE), **values).items() if v is not DROP})


def saved(iterations: int = 8, **values) -> dict:
    """The opt_param_scheduler a checkpoint of BASE (with `values`) records after `iterations` steps."""
    sched = scheduler(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.0), command(**values))
    for _ in range(iterations):
        sched.step(increment=1)
    return sched.state_dict()


def test_the_command_asks_for_its_flags_values():
    """wanted(): the scheduler's fields from the flags; the decay length --lr-decay-iters, else --train-iters; the
    warm-up --lr-warmup-iters, or --lr-warmup-fraction x the decay length (unrounded)."""
    assert schedule.wanted(BASE) == dict(max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2, lr_decay_steps=16,
                                         lr_decay_style="cosine", start_wd=0.1)
    assert schedule.wanted(command(lr_decay_iters=12))["lr_decay_steps"] == 12
    assert schedule.wanted(command(lr_warmup_fraction=0.3))["lr_warmup_steps"] == pytest.approx(4.8, rel=1e-12)
    assert schedule.wanted(command(lr_warmup_fraction=0.3, lr_decay_iters=10))["lr_warmup_steps"] == \
        pytest.approx(3.0, rel=1e-12)
    assert schedule.wanted(command(lr_warmup_fraction=0.0))["lr_warmup_steps"] == 0  # a fraction of 0 is given
    assert {type(v) for k, v in schedule.wanted(command(lr=1, min_lr=0, weight_decay=0)).items()
            if k in ("max_lr", "min_lr", "start_wd")} == {float}  # compared and said as numbers of the scheduler's type
    assert schedule.wanted(command(lr_warmup_fraction=DROP))["lr_warmup_steps"] == 2  # a namespace from before the flag


AT_8 = "the LR schedule differs from the checkpoint's at iteration 8: "
WAYS_ON = (". Pass --override-opt_param-scheduler to follow the new one from iteration 8 (optimizer state kept), or "
           "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
# name: the checkpoint's values (BASE with these), the command's (BASE with these), iteration -> what choose() does:
# (the schedule it follows, the line it says) or ScheduleChanged's line
SCHEDULE_EDGES = [
    ("no checkpoint schedule (a fresh start)", None, dict(lr=1e-2), 8, (schedule.OVERRIDE, None)),
    ("the same values", {}, {}, 8, (schedule.CHECKPOINT, None)),
    ("a recipe's 0.1 x 3e-3 matches a typed 3e-4", {}, dict(min_lr=0.1 * 3e-3), 8, (schedule.CHECKPOINT, None)),
    ("within the tolerance: 1e-10 relative", {}, dict(lr=3e-3 * (1 + 1e-10), weight_decay=0.1 * (1 - 1e-10)), 8,
     (schedule.CHECKPOINT, None)),
    ("past it: 1e-8 relative, in full", {}, dict(lr=3e-3 * (1 + 1e-8)), 8,
     AT_8 + "--lr 0.00300000003 (checkpoint: 0.003)" + WAYS_ON),
    ("--lr and --min-lr, no flag", {}, dict(lr=1e-2, min_lr=1e-3), 8,
     AT_8 + "--lr 0.01 (checkpoint: 0.003), --min-lr 0.001 (checkpoint: 0.0003)" + WAYS_ON),
    ("every value, in the flags' order", {},
     dict(weight_decay=0.0, lr_decay_style="linear", lr_decay_iters=12, lr_warmup_iters=3, min_lr=0.0, lr=1e-2), 8,
     AT_8 + "--lr 0.01 (checkpoint: 0.003), --min-lr 0 (checkpoint: 0.0003), --lr-warmup-iters 3 (checkpoint: 2), "
     "--lr-decay-iters 12 (checkpoint: 16), --lr-decay-style linear (checkpoint: cosine), --weight-decay 0 "
     "(checkpoint: 0.1)" + WAYS_ON),
    ("a warm-up fraction against iterations", {}, dict(lr_warmup_fraction=0.25), 8,
     AT_8 + "--lr-warmup-iters 4 (checkpoint: 2)" + WAYS_ON),
    ("--override-opt_param-scheduler", {}, dict(lr=1e-2, override_opt_param_scheduler=True), 8,
     (schedule.OVERRIDE, "LR schedule: this command's from iteration 8 on (--override-opt_param-scheduler: --lr 0.01 "
                         "(checkpoint: 0.003)); the optimizer state is kept")),
    ("--override-opt_param-scheduler, the decay length", {}, dict(train_iters=30, override_opt_param_scheduler=True), 8,
     (schedule.OVERRIDE, "LR schedule: this command's from iteration 8 on (--override-opt_param-scheduler: decay "
                         "length (--train-iters) 30 (checkpoint: 16)); the optimizer state is kept")),
    ("--override-opt_param-scheduler, nothing changed", {}, dict(override_opt_param_scheduler=True), 8,
     (schedule.OVERRIDE, None)),
    ("--use-checkpoint-opt_param-scheduler", {}, dict(lr=1e-2, use_checkpoint_opt_param_scheduler=True), 8,
     (schedule.CHECKPOINT, "LR schedule: the checkpoint's (--use-checkpoint-opt_param-scheduler; ignored: --lr 0.01 "
                           "(checkpoint: 0.003))")),
    ("--use-checkpoint-opt_param-scheduler, the decay length", {},
     dict(train_iters=30, use_checkpoint_opt_param_scheduler=True), 8,
     (schedule.CHECKPOINT, "LR schedule: the checkpoint's (--use-checkpoint-opt_param-scheduler; ignored: decay length "
                           "(--train-iters) 30 (checkpoint: 16))")),
    ("--use-checkpoint-opt_param-scheduler, nothing changed", {}, dict(use_checkpoint_opt_param_scheduler=True), 8,
     (schedule.CHECKPOINT, None)),
    ("an import: iteration 0", {}, dict(lr=1e-2), 0,
     (schedule.OVERRIDE, "LR schedule: this command's (--lr 0.01 (checkpoint: 0.003)): the checkpoint at iteration 0 "
                         "(an import) has trained on none")),
    ("an import, the decay length", {}, dict(train_iters=30), 0,
     (schedule.OVERRIDE, "LR schedule: this command's (decay length (--train-iters) 30 (checkpoint: 16)): the "
                         "checkpoint at iteration 0 (an import) has trained on none")),
    ("a scheduler that took no step, at iteration 1", dict(iterations=0), dict(lr=1e-2), 1,
     (schedule.OVERRIDE, "LR schedule: this command's (--lr 0.01 (checkpoint: 0.003)): the checkpoint at iteration 0 "
                         "(an import) has trained on none")),
    ("one step trained, at iteration 1", dict(iterations=1), dict(lr=1e-2), 1,
     "the LR schedule differs from the checkpoint's at iteration 1: --lr 0.01 (checkpoint: 0.003). Pass "
     "--override-opt_param-scheduler to follow the new one from iteration 1 (optimizer state kept), or "
     "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"),
    ("a longer --train-iters only: the decay kept, the LR at --min-lr after it", {}, dict(train_iters=30), 8,
     (schedule.CHECKPOINT, "LR schedule: the checkpoint's decay over 16 iterations is kept (--train-iters 30 does not "
                           "change it; from iteration 16 on the LR stays at --min-lr 0.0003). To decay over 30 "
                           "instead, pass --override-opt_param-scheduler (or --lr-decay-iters N with it)")),
    ("a shorter --train-iters only", {}, dict(train_iters=12), 8,
     (schedule.CHECKPOINT, "LR schedule: the checkpoint's decay over 16 iterations is kept (--train-iters 12 does not "
                           "change it; the LR reaches --min-lr at iteration 16). To decay over 12 instead, pass "
                           "--override-opt_param-scheduler (or --lr-decay-iters N with it)")),
    ("--train-iters and --lr", {}, dict(train_iters=30, lr=1e-2), 8,
     AT_8 + "--lr 0.01 (checkpoint: 0.003), decay length (--train-iters) 30 (checkpoint: 16)" + WAYS_ON),
    ("--train-iters, its warm-up fraction moving with it", dict(lr_warmup_fraction=0.25),
     dict(train_iters=32, lr_warmup_fraction=0.25), 8,
     AT_8 + "--lr-warmup-iters 8 (checkpoint: 4), decay length (--train-iters) 32 (checkpoint: 16)" + WAYS_ON),
    ("a namespace without the two flags (made before they existed): as neither", {},
     dict(lr=1e-2, override_opt_param_scheduler=DROP, use_checkpoint_opt_param_scheduler=DROP), 8,
     AT_8 + "--lr 0.01 (checkpoint: 0.003)" + WAYS_ON),
    ("--lr-decay-iters given and changed", dict(lr_decay_iters=16), dict(lr_decay_iters=20), 8,
     AT_8 + "--lr-decay-iters 20 (checkpoint: 16)" + WAYS_ON),
]


@pytest.mark.parametrize("name, before, now, iteration, outcome", SCHEDULE_EDGES,
                         ids=[row[0] for row in SCHEDULE_EDGES])
def test_the_schedule_a_resume_follows(name, before, now, iteration, outcome):
    state = None if before is None else saved(**before)
    lines = []
    if isinstance(outcome, str):
        with pytest.raises(schedule.ScheduleChanged) as refused:
            schedule.choose(state, command(**now), iteration, lines.append)
        assert (str(refused.value), lines) == (outcome, [])
        assert isinstance(refused.value, ValueError)
    else:
        mode, line = outcome
        assert schedule.choose(state, command(**now), iteration, lines.append) == mode
        assert lines == ([line] if line else [])


def test_a_value_the_checkpoint_did_not_record_is_not_compared():
    """An older checkpoint's scheduler without a field (here start_wd): that field is not compared; the others are.
    A value recorded as another type than the command's (None for a number) is a difference, not a crash."""
    state = {k: v for k, v in saved().items() if k != "start_wd"}
    assert schedule.differences(state, command(weight_decay=0.0)) == []
    assert schedule.differences(state, command(weight_decay=0.0, lr=1e-2)) == [("max_lr", "--lr", 3e-3, 1e-2)]
    assert schedule.differences(dict(state, lr_warmup_steps=None), BASE) == \
        [("lr_warmup_steps", "--lr-warmup-iters", None, 2)]


def _optimizer(max_lr: float, min_lr: float) -> torch.optim.Optimizer:
    """A torch optimizer with Megatron-Core's parameter groups (its matching keys): weights with weight decay, biases
    and norms without (wd_mult 0), as megatron.core.optimizer makes them."""
    groups = [dict(params=[torch.nn.Parameter(torch.zeros(2))], wd_mult=wd_mult, lr_mult=1.0, is_expert_parallel=False,
                   is_decoupled_lr=False, max_lr=max_lr, min_lr=min_lr) for wd_mult in (1.0, 0.0)]
    return torch.optim.AdamW(groups, lr=0.0)


@pytest.mark.parametrize("mode", [schedule.OVERRIDE, schedule.CHECKPOINT])
def test_the_saved_and_the_current_groups_get_the_chosen_learning_rates(mode):
    """OVERRIDE: the saved groups take the command's max/min LR; CHECKPOINT: the current groups take the saved ones;
    matched by megatron-core's key without the LRs (wd_mult here), anywhere in the loaded state (nested dicts and
    lists, as chained and distributed optimizers save it; a group key saved with a "pre_" prefix as well); nothing
    else in any group changes, and a group of no match keeps its LRs."""
    old, now = _optimizer(3e-3, 3e-4), _optimizer(1e-2, 1e-3)
    loaded = {"optimizer": [old.state_dict(), ({"param_groups": [dict(old.state_dict()["param_groups"][0])]},)]}
    spelled = loaded["optimizer"][1][0]["param_groups"][0]
    spelled["pre_wd_mult"] = spelled.pop("wd_mult")  # the key's "pre_" spelling
    lonely = dict(old.state_dict()["param_groups"][0], wd_mult=0.5)  # a group with no match on the other side
    loaded["other"] = {"param_groups": [lonely, "not a group"], "param_group": {"param_groups": []}}
    loaded["param_groups"] = [dict(old.state_dict()["param_groups"][1])]  # beside the groups found above it
    groups = (loaded["optimizer"][0]["param_groups"] + loaded["optimizer"][1][0]["param_groups"] +
              loaded["param_groups"])
    before = [dict(g) for g in groups], [dict(g) for g in now.param_groups], dict(lonely)

    schedule.align_param_groups(loaded, now, mode)
    lrs = (1e-2, 1e-3) if mode == schedule.OVERRIDE else (3e-3, 3e-4)
    assert [(g["max_lr"], g["min_lr"]) for g in groups + now.param_groups] == [lrs] * 6
    assert lonely == before[2]
    for group, was in zip(groups + now.param_groups, before[0] + before[1]):
        assert {k: v for k, v in group.items() if k not in schedule.LR_KEYS} == \
            {k: v for k, v in was.items() if k not in schedule.LR_KEYS}


def test_the_first_of_two_groups_with_one_key_gives_the_learning_rates():
    """Two current groups of one key (megatron-core makes one per key; a second would be ambiguous): the first's."""
    now = _optimizer(1e-2, 1e-3)
    now.param_groups[1].update(wd_mult=1.0, max_lr=5e-2)
    loaded = {"param_groups": [dict(now.param_groups[0], max_lr=3e-3, min_lr=3e-4, params=[0])]}
    schedule.align_param_groups(loaded, now, schedule.OVERRIDE)
    assert (loaded["param_groups"][0]["max_lr"], loaded["param_groups"][0]["min_lr"]) == (1e-2, 1e-3)
