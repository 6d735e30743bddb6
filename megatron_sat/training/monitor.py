"""What a run reports: metrics.jsonl, the console line, a progress bar, and wandb (global rank 0 only).

metrics.jsonl holds one JSON object per logged step:
    {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "consumed_samples",
     "gate_mean": [per layer], "gate_zero_frac": [per layer]}   (gates: SATFormer only)
and {"step", "val_loss", "val_ppl"} lines when evaluated. On resume the lines after the loaded
iteration are dropped, so the file always describes the run that produced the checkpoint; a line that does
not read back (cut short by a crash or a full disk) is set aside in metrics.jsonl.torn with a warning, and
an unreadable config.json is renamed to config.json.torn-<time> (training/records.py).

For the sweep tables (megatron_sat/analysis/grid.py) every line also carries "wall_time_s" (since the run's
first start, over all its restarts; each attempt counted from its process start), training lines the peak
memory so far (`memory()`: "mem_cpu_peak_rss_gib", "mem_cpu_rss_gib", and with CUDA "mem_gpu_allocated_gib"
and "mem_gpu_reserved_gib"; global rank 0's process, the first pipeline stage), and close() ends each attempt
with {"step", "event": "end", "status": complete | stopped | failed, "reason", "wall_time_s", "restarts",
memory}. config.json gets "scale" (scale_name: read from the "sources" and "recipe_values" the trainer records),
"sweep" ($MSAT_SWEEP), "non_embedding_parameters", "data_identity" (data path or blend, tokenizer, its
vocabulary, the validation set's id from training/data.py) and "attempts" (one
entry per start: time, step, host, pid, Slurm job; "restarts" = attempts - 1). wandb: the runs of a sweep
form one group ($MSAT_SWEEP, else $WANDB_RUN_GROUP) with arch, scale and seed in their config. Online or offline:
--wandb-mode, else $WANDB_MODE, else online through wandb's own settings; offline with one warning when wandb
cannot start online and no mode was asked for (start_wandb).

One wandb run per run folder: config.json keeps "wandb": {"id", "name", "group"} from the first start, and every
resumed start passes that id (resume="allow"), the same name (--wandb-exp-name, else the folder's name) and
group, so a run requeued five times is one wandb run whose steps continue (offline: one offline-run-* folder per
attempt, all with the same id, which `wandb sync` uploads to). wandb keeps a step once: steps that an
earlier attempt logged after its last checkpoint are not logged again (metrics.jsonl and TensorBoard hold the
resumed values). A run that starts over (no checkpoint to resume) gets a new id.

--tensorboard-dir DIR (Megatron-LM's flag and layout: event files directly in DIR; global rank 0 writes them):
the numeric scalars of every metrics.jsonl line under the same names as in wandb (loss, lr, grad_norm,
tokens_per_s, mfu, val_loss, val_ppl, eval_tasks/<task>, gate_mean/layerNN, ...), at the training step. A
resumed start opens its writer with purge_step = the loaded iteration + 1, so TensorBoard drops what earlier
attempts logged after that checkpoint and every step appears once.
"""

import glob
import json
import math
import os
import random
import re
import resource
import socket
import string
import sys
import time
from typing import Optional, Tuple

import psutil

from megatron_sat.model import args as model_args  # no torch
from megatron_sat.training import records

GIB = 2.0 ** 30


def _say(text: str) -> None:
    print(text, flush=True)


def _fmt_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def start_wandb(wandb, mode: Optional[str], say, **init):
    """(wandb run, mode): wandb.init in `mode` (--wandb-mode, else $WANDB_MODE; None: wandb's own default, online),
    reaching the server through wandb's own settings ($WANDB_BASE_URL, $HTTPS_PROXY, $WANDB_INIT_TIMEOUT, ...). When
    the user did not ask for a mode and wandb fails to start (no server answer within init_timeout, no API key, ...),
    one warning naming the failure and the run logs offline instead, for `wandb sync` later. An explicit online
    mode that fails stops the run with wandb's error."""
    try:
        return wandb.init(mode=mode, **init), mode or "online"
    except Exception as e:  # wandb's errors (CommError, UsageError, a timeout) have no common base we can rely on
        if mode is not None:
            raise
        failure = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    wandb.teardown()  # the failed online run still holds its id in wandb's service; the offline run reuses the id
    say(f"WARNING: wandb did not start online ({failure}); logging offline to {init['dir']}/wandb, upload later "
        f"with `wandb sync {init['dir']}/wandb/offline-run-*` (or set WANDB_MODE=offline to skip the attempt)")
    return wandb.init(mode="offline", **init), "offline"


SHAPE_KEYS = model_args.SHAPE  # the model's size (model/args.py)


def scale_name(config: dict) -> str:
    """The scale of a run: its recipe's size (satformer_760M -> 760M, debug_satformer -> debug, ladder recipes
    -> ladder1 ...) when the run kept the recipe's shape, else the shape itself ('<layers>x<d_model>').

    Kept or not is read from what the resolver recorded (config.json's "sources" and "recipe_values":
    arguments.Resolution.record): the shape is changed when a config file or a flag gave a shape value other than
    the recipe's own (a value the recipe left at the built-in default counts as changed when a higher layer gives
    it). A record without "sources" (a config.json written before they were recorded) is named by its recipe."""
    recipe, arch = config.get("recipe"), config.get("arch")
    shape = f"{config.get('num_layers')}x{config.get('hidden_size')}"
    if not recipe:
        return shape
    name = recipe
    if arch and recipe.startswith(arch + "_"):
        name = recipe[len(arch) + 1:]
    elif arch and recipe.endswith("_" + arch):
        name = recipe[:-len(arch) - 1]
    sources, said = config.get("sources"), config.get("recipe_values") or {}
    if sources is None:
        return name
    if any(sources.get(k) in ("config", "flag") and config.get(k) != said.get(k) for k in SHAPE_KEYS if k in config):
        return shape
    return name


def memory() -> dict:
    """Peak memory of this process so far (GiB): CPU peak RSS (getrusage) and current RSS (psutil); with CUDA the
    peak allocated and reserved bytes of its device (torch.cuda.max_memory_*)."""
    out = {"mem_cpu_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    out["mem_cpu_rss_gib"] = psutil.Process().memory_info().rss / GIB
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["mem_gpu_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["mem_gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return out


def device_memory() -> dict:
    """This rank's accelerator memory now (GiB): allocated, reserved and the peak allocated since the start
    (torch.cuda.memory_allocated / memory_reserved / max_memory_allocated); {} without CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"mem_device_allocated_gib": torch.cuda.memory_allocated() / GIB,
            "mem_device_reserved_gib": torch.cuda.memory_reserved() / GIB,
            "mem_device_peak_gib": torch.cuda.max_memory_allocated() / GIB}


def throughput_text(record: dict) -> str:
    """The step line's throughput: tokens/s of the whole job and per device, the model TFLOP/s per device."""
    text = f"{record['tokens_per_s']:,.0f} tok/s job"
    if record.get("tokens_per_s_per_device") is not None:
        text += f", {record['tokens_per_s_per_device']:,.0f} tok/s/device | {record['tflops_per_device']:.3g} TFLOP/s/device"
    return text


def memory_text(record: dict) -> str:
    """The step line's device memory (rank 0's device), when there is one: allocated / reserved (peak)."""
    if "mem_device_allocated_gib" not in record:
        return ""
    return (f" | mem {record['mem_device_allocated_gib']:.1f}/{record['mem_device_reserved_gib']:.1f} GiB "
            f"(peak {record['mem_device_peak_gib']:.1f})")


def _process_start() -> float:
    return psutil.Process().create_time()


def _slurm_job() -> Optional[str]:
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def new_wandb_id() -> str:
    """A wandb run id (8 lowercase letters and digits, as wandb.util.generate_id makes them)."""
    return "".join(random.SystemRandom().choice(string.ascii_lowercase + string.digits) for _ in range(8))


_WANDB_RUN_DIR = re.compile(r"^(?:offline-)?run-(\d{8}_\d{6})-([a-z0-9]+)$")
_WANDB_ID_IN_TEXT = re.compile(r'"wandb"\s*:\s*\{[^{}]*?"id"\s*:\s*"([a-z0-9]+)"')


def recover_wandb_id(save: str) -> Optional[Tuple[str, str]]:
    """(id, where it was found) of the wandb run of a run folder whose config.json was torn and set aside: the newest
    run folder wandb wrote (RUN/wandb/[offline-]run-DATE_TIME-ID), else the set-aside text's "wandb" entry."""
    found = sorted((m.group(1), m.group(2), d) for d in glob.glob(os.path.join(save, "wandb", "*run-*"))
                   for m in [_WANDB_RUN_DIR.match(os.path.basename(d))] if m)
    if found:
        return found[-1][1], found[-1][2]
    for aside in sorted(glob.glob(os.path.join(save, "config.json.torn-*")), reverse=True):
        try:
            with open(aside, encoding="utf-8", errors="replace") as f:
                m = _WANDB_ID_IN_TEXT.search(f.read())
        except OSError:
            continue
        if m:
            return m.group(1), aside
    return None


def numeric_scalars(record: dict) -> dict:
    """The numbers of a metrics.jsonl line, flat, under the names wandb and TensorBoard show (module docstring)."""
    flat = {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    flat.update({f"eval_tasks/{k}": v for k, v in (record.get("eval_tasks") or {}).items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)})
    for key in ("gate_mean", "gate_zero_frac"):
        for layer, v in enumerate(record.get(key) or [], start=1):
            if v is not None:
                flat[f"{key}/layer{layer:02d}"] = v
    return flat


class Monitor:
    def __init__(self, args, run_config: dict, start_iteration: int, resumed: bool, is_logger: bool):
        self.args = args
        self.enabled = is_logger
        self.bar = self.wandb = self.tensorboard = self._bar_from = None
        self.mfu_said = False  # why the step line has no MFU: said once
        self.metrics_path = os.path.join(args.save, "metrics.jsonl")
        self.last_step, self.closed = start_iteration, False
        self.wandb_logged_to = 0  # steps up to here were logged to this wandb run by earlier attempts
        self._tb_step = (None, set())  # (step, scalars written at it)
        if not self.enabled:
            return
        os.makedirs(args.save, exist_ok=True)
        self.t_process = _process_start()
        run_config = self._run_record(args, run_config, start_iteration, resumed)
        kept = []
        if resumed and os.path.exists(self.metrics_path):
            good, torn = records.read_lines(self.metrics_path)
            records.set_aside(self.metrics_path, torn, _say)  # a line cut short by a crash stops nothing
            kept = [line for line, record in good if record["step"] <= start_iteration]
            self.wandb_logged_to = max((record.get("step") or 0 for _, record in good), default=0)
        elif os.path.getsize(self.metrics_path) if os.path.exists(self.metrics_path) else 0:
            # a run that died before its first checkpoint: starting over, but its log is kept aside
            aside = os.path.join(args.save, time.strftime("metrics.before-%Y%m%d-%H%M%S.jsonl"))
            os.replace(self.metrics_path, aside)
            print(f"metrics of an earlier attempt (no checkpoint) moved to {aside}", flush=True)
        records.write_durably(self.metrics_path, "".join(kept))
        records.write_durably(os.path.join(args.save, "config.json"),
                              json.dumps(run_config, indent=1, sort_keys=True, default=str))
        if args.wandb_project:
            self._init_wandb(run_config)
        if getattr(args, "tensorboard_dir", None):
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (the train extra)

            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir,
                                             purge_step=start_iteration + 1 if resumed else None)
            self.print(f"tensorboard: event files in {args.tensorboard_dir}")
        self._bar_from = start_iteration if args.progress_bar and sys.stdout.isatty() else None

    def start_bar(self) -> None:
        """The progress bar, drawn from here on (after the run's banner, on its own line); it carries the loss."""
        if self.enabled and self._bar_from is not None and self.bar is None:
            from tqdm import tqdm  # optional (the train extra)

            self.bar = tqdm(total=self.args.train_iters, initial=self._bar_from, unit="step", dynamic_ncols=True)

    def _run_record(self, args, run_config: dict, start_iteration: int, resumed: bool) -> dict:
        """run_config plus what a sweep's tables need (module docstring); reads the previous attempts' records."""
        before = records.read_json_file(
            os.path.join(args.save, "config.json"), _say,
            what="the earlier starts it listed are not counted, and the wall time comes from metrics.jsonl") or {}
        # wall time of the earlier attempts: the last wall_time_s any of them wrote (lines dropped on resume too)
        times = [r.get("wall_time_s") for _, r in records.read_lines(self.metrics_path)[0]] + \
            [before.get("wall_time_before_s")]
        self.wall_before = max([t for t in times if isinstance(t, (int, float))], default=0.0)
        attempts = list(before.get("attempts") or []) + [dict(
            started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), start_step=start_iteration, host=socket.gethostname(),
            pid=os.getpid(), process_start=self.t_process, slurm_job=_slurm_job(),
            slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0))]
        self.restarts = len(attempts) - 1
        vocab = run_config.get("vocab_size")
        params = run_config.get("num_parameters")
        validation = getattr(args, "validation_set", None) or {}
        extra = dict(
            scale=scale_name(run_config), sweep=os.environ.get("MSAT_SWEEP") or None,
            non_embedding_parameters=None if params is None or vocab is None else params - vocab * args.hidden_size,
            data_identity=dict(data=run_config.get("data") or ("mock" if args.mock_data else None),
                               tokenizer=run_config.get("tokenizer"),
                               tokenizer_vocab_size=run_config.get("tokenizer_vocab_size"), split=args.split,
                               validation_set_id=validation.get("id"), validation_samples=validation.get("samples"),
                               validation_seed=validation.get("seed")),
            attempts=attempts, restarts=self.restarts, wall_time_before_s=self.wall_before)
        # one wandb run per run folder: the first start's id, name and group, kept while the run resumes
        old = before.get("wandb") if resumed else None
        extra["wandb"] = dict(old) if isinstance(old, dict) and old.get("id") else dict(
            id=new_wandb_id(), name=args.wandb_exp_name or os.path.basename(os.path.abspath(args.save)),
            group=extra["sweep"] or os.environ.get("WANDB_RUN_GROUP") or None)
        if resumed and not before:  # config.json torn (set aside above) or gone: find the run's wandb id elsewhere
            found = recover_wandb_id(args.save)
            if found:
                extra["wandb"]["id"] = found[0]
                _say(f"warning: config.json held this run's wandb id: kept {found[0]} (found in {found[1]}), so "
                     "wandb goes on in the same run")
            elif args.wandb_project:
                _say(f"warning: config.json held this run's wandb id and none was found in {args.save}/wandb or a "
                     f"set-aside config.json: this start logs to a new wandb run {extra['wandb']['id']}")
        return dict(run_config, **extra)

    def wall_time(self) -> float:
        """Seconds since the run's first start: earlier attempts + this process's life so far."""
        return self.wall_before + time.time() - self.t_process

    def _init_wandb(self, run_config: dict) -> None:
        import wandb  # optional (the train extra), seconds to import

        mode = self.args.wandb_mode or os.environ.get("WANDB_MODE")
        if mode == "disabled":
            return
        ident = run_config["wandb"]
        config = dict(run_config, arch=run_config.get("arch"), scale=run_config.get("scale"),
                      seed=run_config.get("seed"))
        folder = getattr(self.args, "wandb_save_dir", None) or self.args.save  # --wandb-save-dir, else the run's
        self.wandb, mode = start_wandb(wandb, mode, self.print, project=self.args.wandb_project, id=ident["id"],
                                       name=ident["name"], dir=folder, config=config, group=ident["group"],
                                       resume="allow")
        again = f", resumed after step {self.wandb_logged_to}" if self.wandb_logged_to else ""
        self.print(f"wandb: {mode} run {ident['id']} in {folder}/wandb{again}")

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.last_step = max(self.last_step, record["step"])
        record = dict(record, wall_time_s=self.wall_time())
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if record.get("event") == "end":  # an attempt's end: the run's summary, not a scalar of its last step
            if self.wandb is not None:
                self.wandb.summary.update({k: record.get(k) for k in ("status", "reason", "restarts")})
            return
        step, flat = record["step"], numeric_scalars(record)
        if self.wandb is not None and step > self.wandb_logged_to:
            self.wandb.log(flat, step=step)
        if self.tensorboard is not None:
            if self._tb_step[0] != step:
                self._tb_step = (step, set())
            for key, value in flat.items():
                if key not in self._tb_step[1]:  # wall_time_s is in the train and validation lines of a step
                    self._tb_step[1].add(key)
                    self.tensorboard.add_scalar(key, value, global_step=step)

    def log_train(self, record: dict, eta_s: float) -> None:
        if self.enabled:
            record = dict(record, **memory(), **device_memory())
        self.write(record)
        if record.get("mfu") is None and not self.mfu_said:  # once, not "MFU n/a" on every line
            self.mfu_said = True
            self.print("no MFU on the step lines: MFU needs the device's peak FLOP/s, which a CPU (or a GPU missing "
                       "from the datasheet table) does not have; --peak-tflops N gives it")
        mfu = "" if record.get("mfu") is None else f" | MFU {100 * record['mfu']:.1f}%"
        grad = "n/a" if record["grad_norm"] is None else f"{record['grad_norm']:.3f}"  # fp16: every step skipped
        line = (f"step {record['step']:>{len(str(self.args.train_iters))}}/{self.args.train_iters} | "
                f"loss {record['loss']:.4f} | lr {record['lr']:.3e} | grad norm {grad} | "
                f"{throughput_text(record)}{mfu}{memory_text(record)} | ETA {_fmt_time(eta_s)}")
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if "loss_scale" in record:
            line += f" | loss scale {record['loss_scale']:.6g} | skipped {record['skipped_iters']}"
        if record.get("gate_mean"):
            gates = [g for g in record["gate_mean"] if g is not None]
            zeros = [z for z in record["gate_zero_frac"] if z is not None]
            line += f" | gate mean {sum(gates) / len(gates):.3f} zero {sum(zeros) / len(zeros):.2f}"
        self.print(line)

    def log_eval(self, step: int, val_loss: float) -> None:
        ppl = math.exp(min(val_loss, 50.0))
        self.write({"step": step, "val_loss": val_loss, "val_ppl": ppl})
        self.print(f"validation at step {step}: loss {val_loss:.4f} | ppl {ppl:.2f}")

    def log_test(self, step: int, test_loss: float) -> None:
        """The test split's loss at the end of training (Megatron-LM scores it there): test_loss, test_ppl."""
        ppl = math.exp(min(test_loss, 50.0))
        self.write({"step": step, "test_loss": test_loss, "test_ppl": ppl})
        self.print(f"test at step {step}: loss {test_loss:.4f} | ppl {ppl:.2f}")

    def log_tasks(self, step: int, scores: dict, failures: dict) -> None:
        """--eval-tasks: {'task/metric': value} as one metrics.jsonl row (key eval_tasks; wandb: eval_tasks/...),
        each failed task named there (eval_tasks_failed) and in one line."""
        record = {"step": step, "eval_tasks": scores}
        if failures:
            record["eval_tasks_failed"] = failures
        self.write(record)
        if scores:
            self.print(f"tasks at step {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in scores.items()))
        for task, error in failures.items():
            self.print(f"task {task} failed at step {step}: {error}")

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self, status: Optional[str] = None, reason: Optional[str] = None) -> None:
        """End this attempt: the "end" line of metrics.jsonl, then the progress bar and wandb.

        status: complete / stopped / failed. By default "failed" when called while an exception is being handled
        (the trainer's NaN and save-failure paths), else "complete" at --train-iters and "stopped" before."""
        if self.enabled and not self.closed:
            self.closed = True
            error = sys.exc_info()[1]
            if status is None:
                status = ("failed" if error is not None else
                          "complete" if self.last_step >= self.args.train_iters else "stopped")
            if reason is None and error is not None:
                reason = f"{type(error).__name__}: {error}"
            self.write(dict(step=self.last_step, event="end", status=status, reason=reason, restarts=self.restarts,
                            **memory()))
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
