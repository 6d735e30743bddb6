"""tools/evaluate.py's own command line (lm-eval's form goes to lm_eval_cli.py): its flags, lm-eval's spellings
mapped onto them, and every check of them, reported together as one line (exit 2) before lm-eval or torch is
imported. Which kind of folder a model is (a Hugging Face export or a trainer run / checkpoint) is decided here,
from the run folder's own file names (training/run_folder.py).

    args = parse(argv, world=world_from_env())       # SystemExit(2) with one line for bad input
"""

import argparse
import os
from typing import List, Optional, Sequence

from megatron_sat.analysis.evaluation import SUITES
from megatron_sat.outputs import check_output
from megatron_sat.training.argument_checks import refusal
from megatron_sat.training.arguments import Parser
from megatron_sat.training.run_folder import TRACKER

# the flags of this form that lm-eval's CLI does not have: any of them selects this form
OWN_FLAGS = ("--checkpoint", "--suite", "--include-path", "--skip-missing", "--batch-size", "--dtype", "--num-fewshot",
             "--max-length", "--output", "--tensor-model-parallel-size", "--no-verify-checkpoint")
HF_MODEL_ARGS = ("pretrained", "dtype", "max_length", "trust_remote_code")  # --model hf --model_args in this form
PROG = "megatron-sat-evaluate"


def is_checkpoint(folder: str) -> bool:
    """A trainer run folder (its tracker file) or one iter_XXXXXXX checkpoint (Megatron-Core's metadata.json)."""
    return os.path.isfile(os.path.join(folder, TRACKER)) or os.path.isfile(os.path.join(folder, "metadata.json"))


def is_hf_folder(folder: str) -> bool:
    """A Hugging Face model folder: config.json and weight files, and no run's tracker."""
    return (os.path.isdir(folder) and os.path.isfile(os.path.join(folder, "config.json"))
            and not os.path.isfile(os.path.join(folder, TRACKER))
            and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(folder)))


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="lm-eval's own command line works as typed: megatron-sat-evaluate run --help")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="HF model folder (tools/convert_to_hf.py --output)")
    which.add_argument("--checkpoint", help="Megatron run folder or iter_XXXXXXX folder (any arch, no conversion)")
    p.add_argument("--suite", action="append", default=[], choices=sorted(SUITES), help="task suite (repeatable)")
    p.add_argument("--model_args", default=None, metavar="pretrained=DIR,...",
                   help="lm-eval's form, with --model hf: pretrained= the HF folder (dtype= and max_length= are read "
                        "too)")
    p.add_argument("--tasks", nargs="*", default=[],
                   help="lm-eval task names, space- or comma-separated (lm-eval's --tasks a,b)")
    p.add_argument("--include-path", "--include_path", action="append", default=[], help="folder of extra task YAMLs")
    p.add_argument("--skip-missing", action="store_true", help="skip tasks lm-eval does not know")
    p.add_argument("--batch-size", "--batch_size", default="1")
    p.add_argument("--device", default=None, help="cuda when there is one, else cpu")
    p.add_argument("--dtype", default="auto", help="auto (the model's / checkpoint's), float32, bfloat16")
    p.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1; debugging)")
    p.add_argument("--num-fewshot", "--num_fewshot", type=int, default=None)
    p.add_argument("--seed", default="1234", metavar="S[,S,S,S]",
                   help="lm-eval's seeds (python, numpy, torch, few-shot): one integer for all four, or four "
                        "comma-separated values, None for one left unset (lm-eval's form)")
    p.add_argument("--max-length", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--output", default=None, help="folder for results.json and results.md")
    p.add_argument("--output_path", default=None, metavar="DIR",
                   help="lm-eval's output layout in DIR: DIR/<model>/results_<time>.json (+ samples with --log_samples)")
    p.add_argument("--log_samples", action="store_true",
                   help="with --output_path: every request and response, samples_<task>_<time>.jsonl (lm-eval's)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="N",
                   help="--checkpoint at TP N, launched with torchrun --nproc-per-node N (default: one process)")
    p.add_argument("--no-verify-checkpoint", dest="verify_checkpoint", action="store_false",
                   help="--checkpoint: read it without checking its files against its manifest.json (as the "
                        "trainer's flag of that name)")
    return p


def parse(argv: Sequence[str], world: int, description: str = "") -> argparse.Namespace:
    """The arguments of this form, checked (every problem at once: one line, exit 2), with args.tasks the task
    list (suites expanded, deduplicated) and lm-eval's forms mapped onto this form's flags. `world`: the processes
    of this launch (torchrun's or srun's)."""
    p = build_parser(description)
    args = p.parse_args(list(argv))
    errors = lm_eval_form_errors(args)
    args.tasks = list(dict.fromkeys([t for s in args.suite for t in SUITES[s]]
                                    + [t.strip() for x in args.tasks for t in x.split(",") if t.strip()]))
    if not args.tasks:
        errors.append("give --suite and/or --tasks")
    errors += source_errors(args, world)
    if errors:
        p.exit(2, refusal(PROG, errors) + "\n")
    return args


def source_errors(args: argparse.Namespace, world: int) -> List[str]:
    """What the model or checkpoint to evaluate, the layout and the output folders refuse."""
    errors = []
    if args.model and is_checkpoint(args.model):
        errors.append(f"--model {args.model} is a Megatron checkpoint: convert it first (python tools/convert_to_hf.py "
                      f"--load {args.model} --output HF_DIR), then --model HF_DIR; or evaluate it as it is with "
                      f"--checkpoint {args.model}")
    if args.checkpoint and not os.path.isdir(args.checkpoint):
        errors.append(f"--checkpoint {args.checkpoint} is not a folder: pass a trainer run folder or an iter_XXXXXXX "
                      "folder")
    elif args.checkpoint and is_hf_folder(args.checkpoint):
        errors.append(f"--checkpoint {args.checkpoint} is a Hugging Face folder: pass it as --model {args.checkpoint}")
    if not args.verify_checkpoint and not args.checkpoint:
        errors.append("--no-verify-checkpoint is for --checkpoint (an HF --model has no manifest)")
    if args.tensor_model_parallel_size != 1 and not args.checkpoint:
        errors.append("--tensor-model-parallel-size needs --checkpoint (an HF --model runs in one process)")
    if args.tensor_model_parallel_size < 1 or world != args.tensor_model_parallel_size:
        errors.append(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} needs exactly that many "
                      f"processes (torchrun --nproc-per-node {args.tensor_model_parallel_size}); this launch has {world}")
    source = ("--model", args.model) if args.model else ("--checkpoint", args.checkpoint)
    for flag, out in (("--output", args.output), ("--output_path", args.output_path)):
        if not (args.checkpoint and out and beside_checkpoints(out, args.checkpoint)):
            try:
                check_output(flag, out, dict([source]))
            except ValueError as e:
                errors.append(str(e))
    return errors


def lm_eval_form_errors(args: argparse.Namespace) -> List[str]:
    """lm-eval's forms onto ours (--model hf --model_args pretrained=DIR, --seed S or S,S,S,S, --log_samples);
    returns what they refuse."""
    errors = []
    if args.model_args is not None:
        fields = dict(kv.split("=", 1) for kv in args.model_args.split(",") if "=" in kv)
        unknown = sorted(set(fields) - set(HF_MODEL_ARGS))
        if args.model != "hf":
            errors.append("--model_args goes with --model hf (lm-eval's form); or pass the HF folder as --model DIR")
        elif unknown:
            errors.append(f"--model_args {', '.join(unknown)}: this form reads only {', '.join(HF_MODEL_ARGS)}; for "
                          "any argument of lm-eval's HF backend use lm-eval's form (megatron-sat-evaluate run --model "
                          "hf ...)")
        elif "pretrained" not in fields:
            errors.append("--model_args needs pretrained=DIR (the Hugging Face model folder)")
        else:
            args.model = fields["pretrained"]
            args.dtype = fields.get("dtype", args.dtype)
            if fields.get("max_length"):
                args.max_length = int(fields["max_length"])
    elif args.model == "hf":
        errors.append("--model hf needs --model_args pretrained=DIR (lm-eval's form), or pass the folder as --model DIR")
    seeds = _seeds(args.seed)
    if seeds is None:
        errors.append(f"--seed {args.seed}: give an integer or four comma-separated integers (None for one left unset)")
    elif len(seeds) not in (1, 3, 4):
        errors.append(f"--seed {args.seed}: give one value or four (python, numpy, torch, few-shot)")
    else:
        args.seed = seeds[0] if len(seeds) == 1 else tuple(seeds + [1234] * (4 - len(seeds)))  # lm-eval's 4th default
    if args.log_samples and not args.output_path:
        errors.append("--log_samples needs --output_path DIR (lm-eval's layout, where the samples are written)")
    return errors


def _seeds(text) -> Optional[list]:
    try:
        return [None if x == "None" else int(x) for x in (x.strip() for x in str(text).split(","))]
    except ValueError:
        return None


def beside_checkpoints(output: str, run: str) -> bool:
    """An output folder inside a run folder but in none of its iter_XXXXXXX checkpoints (run/eval/retrieval,
    where tools/collect_grid.py reads the scores): allowed, it touches no file of the run."""
    out, run = os.path.realpath(output), os.path.realpath(run)
    if os.path.basename(run).startswith("iter_") or not out.startswith(run + os.sep):
        return False
    return not os.path.relpath(out, run).split(os.sep)[0].startswith(("iter_", TRACKER.split(".")[0]))
