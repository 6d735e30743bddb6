"""lm-eval on a Hugging Face export (tools/convert_to_hf.py) or straight on a Megatron checkpoint (any arch,
lm_eval_backend.py), with a results table in Markdown and JSON.

    python tools/evaluate.py --model hf/satformer --suite retrieval --output evals/satformer
    python tools/evaluate.py --checkpoint runs/denseformer --suite retrieval --output evals/denseformer
    python tools/evaluate.py --model hf/satformer --suite zeroshot --batch-size 8 --device cuda
    python tools/evaluate.py --model hf/satformer --tasks my_task --include-path my_tasks/ --output evals/x

Suites:
  retrieval  the paper's: swde, fda, squad_completion, based_triviaqa, based_nq_2048, based_drop
             (contains-match on a generated continuation; the closed-book triviaqa / nq_open / drop
             tasks are not comparable). lm-eval 0.4.13 ships swde, fda and squad_completion; the three
             based_* tasks are defined in lm_eval_tasks/ beside this file, which is always searched.
  zeroshot   lambada_openai, piqa, hellaswag, winogrande, arc_easy, arc_challenge (0-shot).

Tasks download their data sets from the Hugging Face hub (on an offline machine, fill the hub cache
first and set HF_DATASETS_OFFLINE=1). Local task YAMLs come with --include-path DIR; they are read
with lm-eval's own loader (`include:` and `!function` work), and relative `dataset_kwargs.data_files`
are resolved against the YAML's folder (lm-eval alone would resolve them against the working
directory), e.g. tests/data/eval/. A based_* task runs on a local copy of its data with a YAML
that includes the bundled one and sets `dataset_path: json` and `data_files`.

Outputs (--output DIR): results.json (lm-eval's results, configs and versions, plus the table and
suite averages) and results.md; the table is printed either way. --output_path P writes lm-eval's own
layout instead or as well, by lm-eval's EvaluationTracker: P/<model name, sanitized>/results_<time>.json
and, with --log_samples, samples_<task>_<time>.jsonl per task (as `lm_eval --output_path P --log_samples`).
Needs `pip install lm-eval[hf]==0.4.13`.
"""

import functools
import glob
import json
import os
from typing import Dict, List, Optional, Sequence

BUNDLED_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
RETRIEVAL = ["swde", "fda", "squad_completion", "based_triviaqa", "based_nq_2048", "based_drop"]
ZERO_SHOT = ["lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge"]
SUITES = {"retrieval": RETRIEVAL, "zeroshot": ZERO_SHOT}
# the metric that stands for a task in a suite average (first one found)
MAIN_METRICS = ("contains", "acc_norm", "acc", "exact_match", "em", "f1")


class EvaluationError(RuntimeError):
    pass


def local_task_configs(include_paths: Sequence[str]) -> Dict[str, dict]:
    """{task name: config} of the task YAMLs in include_paths, relative data_files made absolute."""
    # lm-eval's loader (its own CLI uses it; pinned 0.4.13). lm-eval is imported in the functions of this module:
    # an optional dependency (eval extra), seconds to import, while evaluate's --help and the grid's tables read
    # the constants above without it
    from lm_eval.tasks._yaml_loader import load_yaml

    configs = {}
    for folder in include_paths:
        for path in sorted(glob.glob(os.path.join(folder, "**", "*.yaml"), recursive=True)):
            try:
                cfg = load_yaml(path, resolve_func=True)
            except Exception as e:  # a YAML error, a bad !function, an include that is not there
                raise EvaluationError(f"cannot read task file {path}: {e}") from e
            if "task" not in cfg or not isinstance(cfg["task"], str):
                continue  # a group or a template, left to lm-eval's index
            files = (cfg.get("dataset_kwargs") or {}).get("data_files")
            if files is not None:
                base = os.path.dirname(os.path.abspath(path))
                fix = lambda p, base=base: p if os.path.isabs(p) or "://" in p else os.path.join(base, p)  # noqa: E731
                if isinstance(files, str):
                    files = fix(files)
                elif isinstance(files, list):
                    files = [fix(p) for p in files]
                else:
                    files = {k: fix(v) if isinstance(v, str) else [fix(p) for p in v] for k, v in files.items()}
                cfg["dataset_kwargs"] = dict(cfg["dataset_kwargs"], data_files=files)
            configs[cfg["task"]] = cfg
    return configs


@functools.lru_cache(maxsize=4)
def task_manager(include_paths: tuple, defaults: bool = True):
    """lm-eval's TaskManager (indexing lm-eval's own task YAMLs takes 5-20 s: built once per include paths, and
    only when a task is not in `include_paths`)."""
    from lm_eval.tasks import TaskManager  # optional, slow (see local_task_configs)

    return TaskManager(include_path=list(include_paths) or None, include_defaults=defaults)


def task_files(tasks: Sequence[str], include_paths: Sequence[str]):
    """(task names, include paths) with every task given as a path to a task YAML file (as lm-eval's own --tasks
    takes it) replaced by its task name, its folder added to the include paths."""
    names, paths = [], list(include_paths)
    for task in tasks:
        if task.endswith((".yaml", ".yml")) and os.path.isfile(task):
            from lm_eval.tasks._yaml_loader import load_yaml  # optional, slow (see local_task_configs)

            try:
                name = load_yaml(task, resolve_func=False).get("task")
            except Exception as e:
                raise EvaluationError(f"cannot read task file {task}: {e}") from e
            if not isinstance(name, str):
                raise EvaluationError(f"{task} defines no task (it needs a `task: NAME` line)")
            folder = os.path.dirname(os.path.abspath(task))
            names.append(name)
            paths += [folder] if folder not in paths else []
        else:
            names.append(task)
    return names, paths


def resolve_tasks(tasks: Sequence[str], include_paths: Sequence[str], skip_missing: bool, log=print):
    """(lm-eval task specs, TaskManager, skipped task names)."""
    local = local_task_configs(include_paths)
    bundled = local_task_configs([BUNDLED_TASKS])
    every_one_local = all(t in local or t in bundled for t in tasks)
    manager = task_manager((BUNDLED_TASKS, *include_paths), defaults=not every_one_local)
    known = set(manager.all_tasks) if hasattr(manager, "all_tasks") else set()
    specs, missing = [], []
    for name in tasks:
        if name in local:
            specs.append(local[name])
        elif not known or name in known:
            specs.append(name)
        else:
            missing.append(name)
    if missing:
        hint = "check the name (python -m lm_eval ls tasks) or add its YAML with --include-path"
        if not skip_missing:
            raise EvaluationError(f"unknown lm-eval task(s): {', '.join(missing)}; {hint}; or pass --skip-missing")
        log(f"skipping unknown task(s) {', '.join(missing)} ({hint})")
    return specs, manager, missing


def evaluate(model_dir: Optional[str], tasks: Sequence[str], *, checkpoint: Optional[str] = None,
             include_paths: Sequence[str] = (), batch_size=1, device: str = "cpu", dtype: str = "auto",
             limit: Optional[float] = None, num_fewshot: Optional[int] = None, max_length: Optional[int] = None,
             skip_missing: bool = False, seed=1234, tensor_parallel: int = 1, verify_checkpoint: bool = True,
             output_path: Optional[str] = None, log_samples: bool = False, log=print) -> dict:
    """Run lm-eval on `model_dir` (its HF backend) or on a Megatron `checkpoint` (the megatron_sat backend,
    lm_eval_backend.py: any arch, no export; it runs on megatron_sat's device, the GPU when there is one);
    tensor_parallel: the checkpoint's model at that TP, under torchrun with as many processes (each runs every
    request; rank 0 reports); verify_checkpoint=False reads a checkpoint without checking it against its manifest.
    seed: one int for lm-eval's four seeds (python, numpy, torch, few-shot) or four (None leaves one unset).
    output_path: lm-eval's output layout there (EvaluationTracker), with per-task samples when log_samples.
    Returns {'results', 'table', 'averages', 'skipped', ...}, None on other ranks."""
    # optional, slow (see local_task_configs); the known harmless warnings filtered first (their module imports torch)
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    from megatron_sat.compat.known_warnings import quiet

    quiet()
    if (model_dir is None) == (checkpoint is None):
        raise EvaluationError("give a Hugging Face model folder or a Megatron checkpoint, not both")
    if model_dir is not None and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise EvaluationError(f"{model_dir} is not a Hugging Face model folder (no config.json)")
    tasks, include_paths = task_files(tasks, include_paths)
    specs, manager, skipped = resolve_tasks(tasks, include_paths, skip_missing, log)
    if not specs:
        raise EvaluationError("no task left to run")
    if checkpoint is not None:
        # registers "megatron_sat" with lm-eval on import, and imports lm-eval and torch (as mapping does torch):
        # only for a checkpoint
        from megatron_sat.analysis import lm_eval_backend
        from megatron_sat.conversion.mapping import ConversionError

        try:
            model = lm_eval_backend.MegatronLM(checkpoint=checkpoint, batch_size=batch_size, dtype=dtype,
                                               max_length=max_length, tensor_parallel=tensor_parallel,
                                               verify_checkpoint=verify_checkpoint)
        except ConversionError as e:
            raise EvaluationError(str(e)) from None
        source, model_args = os.path.abspath(checkpoint), None
    else:
        model, source = "hf", os.path.abspath(model_dir)
        model_args = dict(pretrained=source, trust_remote_code=True, dtype=dtype)
        if max_length:
            model_args["max_length"] = max_length
    seeds = tuple(seed) if isinstance(seed, (list, tuple)) else (seed,) * 4
    tracker = EvaluationTracker(output_path=output_path) if output_path else None
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=specs, num_fewshot=num_fewshot, batch_size=batch_size,
        device=device, limit=limit, task_manager=manager, log_samples=log_samples, random_seed=seeds[0],
        numpy_random_seed=seeds[1], torch_random_seed=seeds[2], fewshot_random_seed=seeds[3],
        evaluation_tracker=tracker,
    )
    if out is None:  # lm-eval reports on global rank 0 only (a tensor-parallel launch)
        return None
    samples = out.pop("samples", None)
    if tracker is not None:
        _save_lm_eval_layout(tracker, out, samples, source, log)
    results = dict(out["results"])
    table = results_table(results)
    summary = dict(model=source, tasks=list(tasks), skipped=skipped, table=table,
                   averages=suite_averages(table, tasks), results=results,
                   versions=_jsonable(out.get("versions", {})), n_samples=_jsonable(out.get("n-samples", {})),
                   configs=_jsonable(out.get("configs", {})), config=_jsonable(out.get("config", {})))
    return summary


def _save_lm_eval_layout(tracker, out: dict, samples: Optional[dict], source: str, log) -> None:
    """lm-eval's files, written by its EvaluationTracker as its CLI does (results_<time>.json, samples_<task>_
    <time>.jsonl) under the model's sanitized name (a Megatron checkpoint is named by its path, not by lm-eval's
    random name for a model object)."""
    from lm_eval.utils import sanitize_model_name  # optional, slow (see local_task_configs)

    general = tracker.general_config_tracker
    if general.model_source == "CUSTOM":
        general.model_name, general.model_name_sanitized = source, sanitize_model_name(source)
    tracker.save_results_aggregated(results=out, samples=samples)
    for task in (out.get("configs") or {}) if samples is not None else ():
        tracker.save_results_samples(task_name=task, samples=samples[task])
    log(f"wrote lm-eval's results{' and samples' if samples is not None else ''} under "
        f"{os.path.join(tracker.output_path, general.model_name_sanitized)}")


def results_table(results: dict) -> List[dict]:
    """One row per (task, metric): {'task', 'metric', 'filter', 'value', 'stderr'}."""
    rows = []
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append(dict(task=task, metric=metric, filter=filt, value=float(value),
                             stderr=float(stderr) if isinstance(stderr, (int, float)) else None))
    return rows


def suite_averages(table: List[dict], tasks: Sequence[str]) -> Dict[str, dict]:
    """Mean of each task's main metric over the tasks of each suite that ran (and over all tasks)."""
    main = {}
    for task in dict.fromkeys(r["task"] for r in table):
        rows = {r["metric"]: r["value"] for r in table if r["task"] == task}
        metric = next((m for m in MAIN_METRICS if m in rows), next(iter(rows), None))
        if metric is not None:
            main[task] = (metric, rows[metric])
    groups = dict(SUITES, all=list(tasks))
    out = {}
    for name, members in groups.items():
        ran = [t for t in members if t in main]
        if ran:
            out[name] = dict(mean=sum(main[t][1] for t in ran) / len(ran), tasks={t: main[t] for t in ran},
                             complete=len(ran) == len(members))
    return out


def to_markdown(summary: dict) -> str:
    lines = [f"# lm-eval results: {summary['model']}", "", "| task | metric | filter | value | stderr |",
             "|---|---|---|---:|---:|"]
    for r in summary["table"]:
        stderr = "" if r["stderr"] is None else f"{r['stderr']:.4f}"
        lines.append(f"| {r['task']} | {r['metric']} | {r['filter']} | {r['value']:.4f} | {stderr} |")
    if summary["averages"]:
        lines += ["", "| average | tasks | mean | complete |", "|---|---|---:|---|"]
        for name, avg in summary["averages"].items():
            lines.append(f"| {name} | {len(avg['tasks'])} | {avg['mean']:.4f} | {'yes' if avg['complete'] else 'no'} |")
    if summary["skipped"]:
        lines += ["", f"Skipped (unknown to lm-eval): {', '.join(summary['skipped'])}"]
    return "\n".join(lines) + "\n"


def write_results(summary: dict, output: str) -> None:
    """results.json and results.md in `output`, each written aside and renamed."""
    os.makedirs(output, exist_ok=True)
    for name, text in (("results.json", json.dumps(summary, indent=1, default=str)),
                       ("results.md", to_markdown(summary))):
        tmp = os.path.join(output, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(output, name))


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))
