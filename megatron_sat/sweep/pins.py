"""A Slurm job keeps the run it started: the run folder's name fixed at the job's first start, whatever is edited
before its requeue.

A run's name hashes its resolved configuration (plan.resolve), so a config file (--config exp.yaml) or a recipe
edited while a job waits in the queue would give the requeued job another name, and it would start a new run at
step 0 beside the half-trained one. slurm/launch.sh therefore asks for the name with a pin file
(`submit_grid --resolve RECIPE --pin FILE -- FLAGS`), one per sweep entry: an array task of a manifest
(<manifest>.pins/task_<N>.json: its requeues and a resubmission of that task share it) or a plain job
(<runs>/_grid/pins/job_<id>.json). The first start writes the pin (the name and the values that name it); every
later start resolves again and

  same name      continues the pinned run;
  another name   refuses, exit 2, one line naming each value that changed (the config or recipe was edited) and
                 the two ways on: restore it to continue the run, or remove the pin to start the edited
                 configuration as a new run (the half-trained run stays where it is).
"""

import json
import os
import time
from typing import Optional

from megatron_sat.training.records import write_durably


class PinMismatch(ValueError):
    """The resolved configuration names another run than the one the job started (the message says what changed)."""


def _plain(value):
    """A JSON value that compares as the resolved one does (tuples as lists, anything else exotic by repr)."""
    return json.loads(json.dumps(value, default=repr))


def named_values(args, unnamed: set) -> dict:
    """The resolved values that name a run (every dest but the names_run=False ones), JSON-plain."""
    return {k: _plain(v) for k, v in sorted(vars(args).items()) if k not in unnamed}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_pin(path: str, name: str, values: dict, job: Optional[str] = None) -> str:
    """The run name this job continues: the pinned one (written now, at the job's first start, when `path` does not
    exist). PinMismatch when `name` differs from the pinned name; ValueError for a pin that cannot be read."""
    try:
        with open(path) as f:
            pin = json.load(f)
        if not isinstance(pin, dict):  # JSON, but not a pin (edited by hand): refused as unreadable, not a traceback
            raise ValueError(f"not a JSON object but {type(pin).__name__}")
    except FileNotFoundError:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_durably(path, json.dumps(dict(run=name, job=job, pinned=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                            values=values), indent=1))
        return name
    except (OSError, ValueError) as e:
        raise ValueError(f"the run pin {path} is unreadable ({e}): remove it to let this job start the run its "
                         "configuration names now") from None
    if pin.get("run") == name:
        return name
    old = pin.get("values") or {}
    changed = [f"{_flag(k)} {values.get(k)!r} (the run's: {old.get(k)!r})"
               for k in sorted(set(old) | set(values)) if old.get(k) != values.get(k)]
    what = ", ".join(changed) if changed else f"its name {name}"
    raise PinMismatch(f"the configuration of run {pin.get('run')} changed since job {pin.get('job') or '?'} started "
                      f"it: {what}. Restore the config file or recipe to continue that run, or remove {path} to start "
                      f"the edited configuration as a new run (the half-trained one stays)")
