"""Downstream lm-eval tasks on the model being trained (the trainer's --eval-tasks), in the training processes.

    python -m megatron_sat.train --recipe debug_satformer --eval-tasks megatron_sat_tiny_mc,megatron_sat_tiny_gen \\
        --eval-tasks-include-path tests/data/eval --eval-tasks-interval 100 --eval-tasks-limit 50 \\
        --tokenizer-model TOKENIZER          # mock data has no tokenizer: name the one the tasks are read with

megatron_sat/train.py hands TaskRunner to the trainer (training may not import analysis); the trainer
calls it every --eval-tasks-interval steps and at the end, and writes what it returns to metrics.jsonl
and wandb. Each task runs on its own, so a failing one (bad YAML, missing data, unknown name) is
reported as one line and the others, and the training, go on. The model is scored where it is, at its
layout, with the megatron_sat backend (lm_eval_backend.py): TP gathers its logits, every data-parallel
replica scores every request (the same numbers; rank 0 records them), PP > 1 and CP > 1 are refused by
the trainer's argument checks. The random states of python, numpy and torch are restored afterwards,
so a run's losses do not depend on whether it evaluates tasks.
"""

import logging
import random
from typing import Dict, Tuple

import lm_eval
import numpy as np
import torch
from megatron.core.utils import get_attr_wrapped_model

from megatron_sat.analysis.evaluation import resolve_tasks, results_table
from megatron_sat.analysis.lm_eval_backend import MegatronLM
from megatron_sat.data.tokenizer import load_tokenizer


class TaskRunner:
    """run(iteration) -> ({'task/metric': value}, {task: error}) on the trainer's model chunks."""

    def __init__(self, args, chunks, tokenizer, log=print):
        if len(chunks) != 1:
            raise ValueError("--eval-tasks needs one model chunk per rank (no virtual pipeline stages)")
        hf = getattr(tokenizer, "hf", None)
        if hf is None:  # mock data: the tokenizer the tasks are read with (the argument checks ask for it)
            hf = load_tokenizer(args.tokenizer_model).hf
        self.tasks = [t.strip() for t in args.eval_tasks.split(",") if t.strip()]
        self.include_paths = list(args.eval_tasks_include_path or [])
        self.limit = args.eval_tasks_limit
        self.log = log
        self.lm = MegatronLM(model=chunks[0], tokenizer=hf, max_length=args.seq_length,
                             batch_size=args.eval_tasks_batch_size or args.micro_batch_size)
        vocab = self._vocab_size(chunks[0])
        self.vocab_error = (f"the tokenizer has {len(hf)} tokens but the model only {vocab}" if vocab is not None
                            and len(hf) > vocab else None)
        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on task defaults, at every evaluation

    @staticmethod
    def _vocab_size(model):
        try:
            return get_attr_wrapped_model(model, "vocab_size")  # through DDP / Float16Module wrappers
        except RuntimeError:
            return None

    def __call__(self, iteration: int) -> Tuple[Dict[str, float], Dict[str, str]]:
        scores, failures = {}, {}
        states = _random_states()
        try:
            for task in self.tasks:
                try:
                    if self.vocab_error:
                        raise ValueError(self.vocab_error)
                    specs, manager, _ = resolve_tasks([task], self.include_paths, skip_missing=False, log=self.log)
                    out = lm_eval.simple_evaluate(model=self.lm, tasks=specs, limit=self.limit, task_manager=manager,
                                                  log_samples=False, bootstrap_iters=0)
                    if out is None:  # lm-eval reports on global rank 0 only; the trainer records rank 0's
                        continue
                    rows = results_table(dict(out["results"]))
                    if not rows:
                        raise ValueError("lm-eval returned no scores")
                    for r in rows:
                        scores[f"{r['task']}/{r['metric']}"] = r["value"]
                except Exception as e:  # any task error is reported and training goes on
                    failures[task] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        finally:
            _restore_random_states(states)
        return scores, failures


def _random_states():
    return (random.getstate(), np.random.get_state(), torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _restore_random_states(states) -> None:
    py, npy, cpu, cuda = states
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
