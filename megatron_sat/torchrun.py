"""torchrun for preemptible jobs: a signal to the launcher or its process group ends in one save on every rank,
and the launcher exits 0 once every rank has.

    python -m megatron_sat.torchrun --nproc-per-node 4 -m megatron_sat.train --recipe debug_satformer \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    kill -USR1 -- -PGID        # or SIGTERM, or Ctrl-C: every rank saves at its next step, exit 0

(also installed as `megatron-sat-torchrun`). It is torch's own torchrun (torch.distributed.run: the same flags,
rendezvous and restarts) with three defaults changed, because plain torchrun loses preempted work:

  * SIGUSR1 and SIGUSR2 (what Slurm and most schedulers send before a preemption or the time limit) are among
    the signals it forwards to the workers (`--signals-to-handle`, default SIGTERM,SIGINT,SIGHUP,SIGQUIT:
    plain torchrun dies of USR1 at once, and its workers, each in a session of its own, never see it);
  * the workers get `--shutdown-timeout` 600 s (torch's default is 30) to finish their save before SIGKILL;
  * torchrun raises on any forwarded signal and exits 1, even when every rank saved and exited 0: here that
    case exits 0 with one line, so that a requeue script tells a clean stop from a failure. If a rank failed
    or had to be killed, the exit code is 1, as torchrun's; if the hang watchdog (--hang-timeout-minutes)
    stopped a rank, it is that rank's code, 75 (torchrun would say 1).

The trainer's ranks also ask Linux for SIGTERM when torchrun dies (PR_SET_PDEATHSIG, megatron_sat.training.
signals.bind_to_launcher): under plain torchrun, or when the launcher is killed with SIGKILL, they save at their
next step and exit instead of training on unsupervised. No library offers this; the exit-code check wraps one
method of torch's LocalElasticAgent (checked by tests/test_faults_signals.py).
"""

import os
import signal
import sys
from typing import List, Optional

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.run import parse_args, run

from megatron_sat.training.watchdog import HANG_EXIT

PREEMPTION_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
SHUTDOWN_TIMEOUT_S = 600

_exit_codes: List[Optional[int]] = []


def _given(argv: List[str], *flags: str) -> bool:
    launcher_part = argv[:next((i for i, a in enumerate(argv) if a == "-m" or not a.startswith("-")), len(argv))]
    return any(a == f or a.startswith(f + "=") for a in launcher_part for f in flags)


def with_defaults(argv: List[str]) -> List[str]:
    """torchrun's arguments with this launcher's defaults put in front (a flag the user gave wins)."""
    extra = []
    if not _given(argv, "--signals-to-handle", "--signals_to_handle") and "PET_SIGNALS_TO_HANDLE" not in os.environ:
        extra.append(f"--signals-to-handle={PREEMPTION_SIGNALS}")
    if not _given(argv, "--shutdown-timeout", "--shutdown_timeout") and "PET_SHUTDOWN_TIMEOUT" not in os.environ \
            and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        extra.append(f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}")
    return extra + list(argv)


def _record_exit_codes() -> None:
    """After the agent shuts its workers down, keep their exit codes (torch does not return them on a signal)."""
    if getattr(LocalElasticAgent, "_megatron_sat_exit_codes", False):
        return
    original = LocalElasticAgent._shutdown

    def _shutdown(self, *args, **kwargs):
        original(self, *args, **kwargs)
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        _exit_codes[:] = [h.proc.poll() for h in handlers.values()]

    LocalElasticAgent._shutdown = _shutdown
    LocalElasticAgent._megatron_sat_exit_codes = True


def main(argv: Optional[List[str]] = None) -> int:
    argv = with_defaults(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    _record_exit_codes()
    try:
        record(run)(args)  # as torchrun's main: a failed rank's error is summarised, exit 1
    except ChildFailedError as e:
        codes = {f.exitcode for fails in [e.failures] for f in fails.values()}
        if HANG_EXIT in codes:  # the hang watchdog stopped the job: the code a requeue script retries on
            print(f"megatron-sat-torchrun: the hang watchdog stopped the job (exit {HANG_EXIT}: retry it)",
                  file=sys.stderr, flush=True)
            return HANG_EXIT
        return 1
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        if _exit_codes and all(code == 0 for code in _exit_codes):
            print(f"megatron-sat-torchrun: {name}: every rank ({len(_exit_codes)} here) stopped cleanly (exit 0)",
                  flush=True)
            return 0
        print(f"megatron-sat-torchrun: {name}: ranks exited {_exit_codes or 'unknown'}; not a clean stop",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
