"""What a run reports: metrics.jsonl, the console line, a progress bar, and wandb (global rank 0 only).

metrics.jsonl holds one JSON object per logged step:
    {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "consumed_samples",
     "gate_mean": [per layer], "gate_zero_frac": [per layer]}   (gates: SATFormer only)
and {"step", "val_loss", "val_ppl"} lines when evaluated. On resume the lines after the loaded
iteration are dropped, so the file always describes the run that produced the checkpoint.
"""

import json
import math
import os
import socket
import sys
import time
from typing import Optional


def _fmt_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _wandb_reachable(host: str = "api.wandb.ai", timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


class Monitor:
    def __init__(self, args, run_config: dict, start_iteration: int, resumed: bool, is_logger: bool):
        self.args = args
        self.enabled = is_logger
        self.bar = self.wandb = None
        self.metrics_path = os.path.join(args.save, "metrics.jsonl")
        if not self.enabled:
            return
        os.makedirs(args.save, exist_ok=True)
        kept = []
        if resumed and os.path.exists(self.metrics_path):
            with open(self.metrics_path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start_iteration]
        elif os.path.getsize(self.metrics_path) if os.path.exists(self.metrics_path) else 0:
            # a run that died before its first checkpoint: starting over, but its log is kept aside
            aside = os.path.join(args.save, time.strftime("metrics.before-%Y%m%d-%H%M%S.jsonl"))
            os.replace(self.metrics_path, aside)
            print(f"metrics of an earlier attempt (no checkpoint) moved to {aside}", flush=True)
        with open(self.metrics_path, "w") as f:
            f.writelines(kept)
        tmp = os.path.join(args.save, "config.json.tmp")
        with open(tmp, "w") as f:
            json.dump(run_config, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, os.path.join(args.save, "config.json"))
        if args.wandb_project:
            self._init_wandb(run_config)
        if args.progress_bar and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=args.train_iters, initial=start_iteration, unit="step", dynamic_ncols=True)

    def _init_wandb(self, run_config: dict) -> None:
        import wandb

        mode = self.args.wandb_mode or os.environ.get("WANDB_MODE")
        if mode is None:
            mode = "online" if _wandb_reachable() else "offline"
        if mode == "disabled":
            return
        self.wandb = wandb.init(project=self.args.wandb_project, name=self.args.wandb_exp_name, mode=mode,
                                dir=self.args.save, config=run_config, resume="allow")
        self.print(f"wandb: {mode} run in {self.args.save}/wandb")

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
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            flat = {k: v for k, v in record.items() if k != "step" and not isinstance(v, list)}
            for key in ("gate_mean", "gate_zero_frac"):
                for layer, v in enumerate(record.get(key) or [], start=1):
                    if v is not None:
                        flat[f"{key}/layer{layer:02d}"] = v
            self.wandb.log(flat, step=record["step"])

    def log_train(self, record: dict, eta_s: float) -> None:
        self.write(record)
        mfu = "n/a" if record.get("mfu") is None else f"{100 * record['mfu']:.1f}%"
        line = (f"step {record['step']:>{len(str(self.args.train_iters))}}/{self.args.train_iters} | "
                f"loss {record['loss']:.4f} | lr {record['lr']:.3e} | grad norm {record['grad_norm']:.3f} | "
                f"{record['tokens_per_s']:,.0f} tok/s | MFU {mfu} | ETA {_fmt_time(eta_s)}")
        if record.get("gate_mean"):
            gates = [g for g in record["gate_mean"] if g is not None]
            zeros = [z for z in record["gate_zero_frac"] if z is not None]
            line += f" | gate mean {sum(gates) / len(gates):.3f} zero {sum(zeros) / len(zeros):.2f}"
        self.print(line)

    def log_eval(self, step: int, val_loss: float) -> None:
        ppl = math.exp(min(val_loss, 50.0))
        self.write({"step": step, "val_loss": val_loss, "val_ppl": ppl})
        self.print(f"validation at step {step}: loss {val_loss:.4f} | ppl {ppl:.2f}")

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
