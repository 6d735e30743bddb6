"""Config files of the trainer: `--config FILE` (YAML or JSON) and `--print-config`.

A config file holds the trainer's arguments under their flag names, with dashes or underscores
(`hidden-size: 2048` or `hidden_size: 2048`); `--print-config` writes one from the resolved arguments.
A run's own RUN/config.json is a config file too: its "arguments" entry (the run's resolved arguments)
is read, or, in a config.json written before that entry existed (and in the config.json of an HF import,
tools/convert_from_hf.py), the top-level keys that are flags. An import leaves the training settings it could not
choose (--lr, --train-iters, --seq-length, unless given to it) as "placeholders": a run on that file must give them
on its command line (placeholder_errors).

The values go through the flag's own argparse type and choices (argparse and PyYAML do the work; the
only code here maps a file's keys onto the parser's actions). A null is "not given", as if the key were absent.
Precedence, resolved in arguments.py: recipe < config file < command line. Nothing here imports megatron.
"""

import argparse
import copy
import os
from typing import Dict, List

import yaml  # PyYAML: YAML 1.1 reads JSON too

# dests that are not run arguments: how the arguments were given, not what they are
NOT_ARGUMENTS = ("help", "config", "print_config")


def argument_actions(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    """{dest: action} of the trainer's arguments a config file may set (hidden debug flags excluded)."""
    return {a.dest: a for a in parser._actions
            if a.dest not in NOT_ARGUMENTS and a.help != argparse.SUPPRESS and a.option_strings}


def read_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """{dest: value} of config file `path`, each value checked by its flag's type and choices (ValueError with
    one line that says what to fix)."""
    if not os.path.isfile(path):
        raise ValueError(f"--config {path} is not a file: pass a YAML or JSON file (--print-config writes one)")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--config {path} is not valid YAML or JSON: {first}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of flag names to values, not a {type(data).__name__}")
    actions = argument_actions(parser)
    run_record = _run_record_arguments(data, actions)
    if run_record is not None:
        data = run_record
    # a flag that takes a value under another name than its argument (--norm-epsilon sets layernorm_epsilon)
    spelled = {opt.lstrip("-").replace("-", "_"): a.dest for a in actions.values() if a.nargs != 0
               for opt in a.option_strings if opt.startswith("--")}
    out, unknown = {}, []
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions and dest in spelled:
            dest = spelled[dest]
        if dest not in actions:
            unknown.append(str(key))
            continue
        if value is None:  # null is "not given": the recipe's value (or the default) stands, as without the key
            continue
        out[dest] = coerce(actions[dest], value, path)
    if unknown:
        raise ValueError(f"--config {path}: unknown argument(s) {', '.join(unknown)}: use the trainer's flag names "
                         "(python -m megatron_sat.train --help; --print-config writes a complete file)")
    return out


def _run_record_arguments(data: dict, actions: dict):
    """The arguments of a run's config.json (None for a plain config file). A reproduction starts afresh: a
    --load that pointed at the run's own folder (the run resuming itself) is dropped, with its --ckpt-step."""
    if isinstance(data.get("arguments"), dict) and "world_size" in data:
        out = dict(data["arguments"])
    elif ("world_size" in data and "model" in data and "num_parameters" in data) or "imported_from" in data:
        # a run's config.json written before "arguments", or tools/convert_from_hf.py's record of an import (its
        # placeholders have no value: the command line gives them, placeholders())
        out = {k: v for k, v in data.items() if k in actions and k not in placeholders(data)}
        if out.get("mock_data") or out.get("embedded_data"):  # the top-level vocab_size is the padded one
            out["vocab_size"] = data.get("tokenizer_vocab_size", out.get("vocab_size"))
        else:
            out["vocab_size"] = None
        if out.get("train_samples"):
            out["train_iters"] = None
    else:
        return None
    if out.get("load") and out.get("save") and os.path.normpath(out["load"]) == os.path.normpath(out["save"]):
        out["load"], out["ckpt_step"] = None, None
    return out


def placeholders(data: dict) -> dict:
    """{dest: what to choose} of the training settings an HF import's config.json leaves to the command line
    (conversion/importer.py's PLACEHOLDERS; {} for any other config file)."""
    found = data.get("placeholders") if "imported_from" in data else None
    return dict(found) if isinstance(found, dict) else {}


def placeholder_errors(path: str, given: dict) -> List[str]:
    """One line if config file `path` is an HF import's record whose placeholders the command line (`given`: its
    {dest: value}) does not all give."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []  # read_config says what is wrong with it
    left = {k: why for k, why in placeholders(data if isinstance(data, dict) else {}).items()
            if k not in given and not (k == "train_iters" and "train_samples" in given)}
    if not left:
        return []
    return [f"--config {path} is an HF import's record whose training settings are placeholders: give "
            + "; ".join(f"--{k.replace('_', '-')} ({why})" for k, why in left.items())]


def coerce(action: argparse.Action, value, path: str):
    """`value` from a config file as the flag would give it (its type, nargs and choices)."""
    flag = action.option_strings[0]
    if value is None:
        return None

    def bad(why: str):
        return ValueError(f"--config {path}: {action.dest}: {why}")

    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # switches
        if not isinstance(value, bool):
            raise bad(f"give true or false, not {value!r}")
        return value
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list):
            raise bad(f"give a list (or a space-separated string), not {value!r}")
        return [_one(action, v, bad) for v in items]
    if isinstance(value, (list, dict)):
        raise bad(f"{flag} takes one value, not {value!r}")
    return _one(action, value, bad)


def _one(action: argparse.Action, value, bad):
    convert = action.type or str
    if isinstance(value, bool) and convert is not str:
        raise bad(f"give a number, not {value!r}")
    if convert is int and isinstance(value, float) and not value.is_integer():
        raise bad(f"give a whole number, not {value!r}")
    try:
        out = convert(value)  # YAML reads 1e-3 (no dot) as a string: float() takes it as argparse would
    except (TypeError, ValueError):
        raise bad(f"cannot read {value!r} as {getattr(convert, '__name__', convert)}") from None
    if action.choices is not None and out not in action.choices:
        raise bad(f"{out!r} is not one of {', '.join(map(str, action.choices))}")
    return out


def config_dict(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The run's arguments as a config file holds them: every flag's resolved value, in --help's order. Values
    that were derived from another flag are left out (null), so that the file gives each setting once:
    --train-iters from --train-samples, --data-path from --data-args-path, --lr-warmup-iters and --lr-decay-iters
    from --lr-warmup-samples and --lr-decay-samples."""
    out = {dest: _plain(getattr(args, dest, None)) for dest in argument_actions(parser)}
    if out.get("train_samples") is not None:
        out["train_iters"] = None
    for samples, steps in (("lr_warmup_samples", "lr_warmup_iters"), ("lr_decay_samples", "lr_decay_iters")):
        if out.get(samples) is not None:  # Megatron-LM's sample-based schedule (training/megatron_lm_flags.py)
            out[steps] = None
    if out.get("data_args_path"):
        out["data_path"] = None
    return out


def _plain(value):
    if isinstance(value, tuple):
        return list(value)
    return value


def dump_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """--print-config's output: YAML, readable back with --config."""
    header = ("# megatron-sat-train arguments, resolved (recipe < config file < command line).\n"
              "# Rerun with: python -m megatron_sat.train --config THIS_FILE [flags that override it]\n")
    return header + yaml.safe_dump(config_dict(args, parser), sort_keys=False, default_flow_style=None, width=120)


def explicit_dests(parser: argparse.ArgumentParser, argv: List[str]) -> dict:
    """{dest: value} of the flags given in argv (nothing from defaults): a copy of the parser whose every
    default is argparse.SUPPRESS parses it."""
    bare = copy.deepcopy(parser)
    for action in list(bare._actions):
        if isinstance(action, argparse._HelpAction):  # --help is answered by the real parser, with its defaults
            bare._remove_action(action)
            for option in action.option_strings:
                bare._option_string_actions.pop(option, None)
        action.default = argparse.SUPPRESS
    bare._defaults = {}
    return vars(bare.parse_known_args(argv)[0])
