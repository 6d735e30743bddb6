"""megatron-sat-evaluate in lm-eval's form: the command line goes to lm-eval's own CLI (lm_eval/_cli, 0.4.13), so
every lm-eval flag and form works as typed, with two additions: the `megatron_sat` backend is registered, and the
task folder shipped with megatron-sat (based_* recall tasks) is searched before any --include_path.

    megatron-sat-evaluate run --model megatron_sat --model_args checkpoint=runs/satformer --tasks based_drop \\
        -b 8 -o evals -s
    megatron-sat-evaluate --model hf --model_args pretrained=hf/satformer trust_remote_code=True -t piqa -b 8
    megatron-sat-evaluate run --checkpoint runs/satformer -t piqa -b 8     # = --model megatron_sat checkpoint=...
    megatron-sat-evaluate ls tasks

The project's own form (--checkpoint or --model DIR with --suite, --output, ...) is tools/evaluate.py's.
"""

import os
import sys
from typing import List, Sequence

from megatron_sat.analysis.evaluation import BUNDLED_TASKS
from megatron_sat.analysis.lm_eval_registration import MODEL_ARGS, NAME, register

RUNNING = False  # while run() executes lm-eval: the backend refuses a bad checkpoint in one line, not a traceback
COMMANDS = ("run", "ls", "validate")  # lm-eval 0.4.13's subcommands; without one, lm-eval inserts `run`


def is_lm_eval_form(argv: Sequence[str], own_flags: Sequence[str]) -> bool:
    """Whether a megatron-sat-evaluate command line is lm-eval's: it starts with an lm-eval subcommand, or it uses
    none of the project's own flags and names a model as lm-eval does (--model NAME of lm-eval's registry, or
    --model_args); --model DIR alone is the project's form."""
    if argv and argv[0] in COMMANDS:
        return True
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    if flags & set(own_flags) or flags & {"-h", "--help"}:
        return False
    if flags & {"--model_args", "-a"}:
        return True
    model = _value(argv, ("--model", "-M"))
    if model is None or os.path.isdir(model):
        return False
    try:
        from lm_eval.api.registry import model_registry  # light (no torch); optional: the eval extra
    except ImportError:  # no lm-eval: the project's form says what is missing
        return False
    register()
    return model in model_registry


def run(argv: Sequence[str]) -> int:
    """lm-eval's CLI on argv (after the translations in the module docstring); 2 for a bad megatron_sat call."""
    from lm_eval._cli import HarnessCLI  # optional (eval extra); its parser is light, the run imports the rest
    from lm_eval.utils import setup_logging

    from megatron_sat.compat.known_warnings import quiet  # here: its package imports torch, --help does not

    quiet()  # the known harmless third-party warnings (compat/known_warnings.py)
    argv = _checkpoint_as_model_args(list(argv))
    register()
    setup_logging()  # as lm-eval's cli_evaluate
    cli = HarnessCLI()
    saved, sys.argv = sys.argv, ["megatron-sat-evaluate", *argv]
    try:
        args = cli.parse_args()  # lm-eval's parsing, its form without a subcommand included (it reads sys.argv)
    finally:
        sys.argv = saved
    if hasattr(args, "include_path"):  # TaskManager takes a list: the bundled folder first, the user's overrides it
        args.include_path = [BUNDLED_TASKS, *([args.include_path] if args.include_path else [])]
    if getattr(args, "command", None) == "run" and args.model == NAME:
        given = dict(args.model_args or {})
        unknown = sorted(set(given) - set(MODEL_ARGS))
        if unknown:
            print(f"error: --model_args {', '.join(unknown)}: not an argument of the megatron_sat backend; it takes "
                  f"{', '.join(MODEL_ARGS)}", file=sys.stderr)
            return 2
        if not given.get("checkpoint"):
            print("error: --model megatron_sat needs --model_args checkpoint=RUN (a trainer run folder or an "
                  "iter_XXXXXXX folder), or --checkpoint RUN", file=sys.stderr)
            return 2
    global RUNNING
    RUNNING = True
    try:
        cli.execute(args)
    finally:
        RUNNING = False
    return 0


def _value(argv: Sequence[str], names: Sequence[str]):
    for i, a in enumerate(argv):
        if a in names and i + 1 < len(argv):
            return argv[i + 1]
        if "=" in a and a.split("=", 1)[0] in names:
            return a.split("=", 1)[1]
    return None


def _checkpoint_as_model_args(argv: List[str]) -> List[str]:
    """--checkpoint RUN (the project's) as lm-eval's --model megatron_sat --model_args checkpoint=RUN."""
    out, run_dir = [], None
    i = 0
    while i < len(argv):
        if argv[i] == "--checkpoint" and i + 1 < len(argv):
            run_dir, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--checkpoint="):
            run_dir = argv[i].split("=", 1)[1]
        else:
            out.append(argv[i])
        i += 1
    if run_dir is None:
        return argv
    return [*out, "--model", NAME, "--model_args", f"checkpoint={run_dir}"]
