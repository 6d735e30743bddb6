"""One rank of a job under the hang watchdog, without a trainer (tests/test_faults_signals.py times the watchdog).

    python tests/workers/watchdog_rank.py RUN RANK WORLD TIMEOUT_S [GROUP_TIMEOUT_S PORT]

Every rank runs megatron_sat.training.watchdog.Watchdog with TIMEOUT_S and its default heartbeat, and makes
progress (a beat) every 20 ms. Rank 0 stops making progress once RUN/stop exists, as a rank blocked in a collective
whose peer stopped; the test SIGSTOPs the other rank at that moment. The watchdog of rank 0 then fires.

With GROUP_TIMEOUT_S and PORT, the ranks form a real gloo process group of that timeout on 127.0.0.1:PORT and
every step is an all-reduce: once the test SIGSTOPs rank 1, rank 0's all-reduce times out (before the watchdog,
when GROUP_TIMEOUT_S < TIMEOUT_S) and is handed to Watchdog.collective_failed, as the trainer's loop does.
"""

import os
import sys
import time
from datetime import timedelta

from megatron_sat.training.watchdog import Watchdog, is_collective_timeout

run, rank, world, timeout_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
collective = len(sys.argv) > 5
if collective:
    import torch  # only in this mode: the watchdog-only mode starts in a fraction of a second

    group_s, port = float(sys.argv[5]), sys.argv[6]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, timeout=timedelta(seconds=group_s))
dog = Watchdog(run, rank, world, timeout_s).start()
step = 0
while True:
    if collective:
        try:
            torch.distributed.all_reduce(torch.ones(4))
        except RuntimeError as e:
            if is_collective_timeout(e):
                dog.collective_failed(e, group_s / 60)
            raise
    elif rank == 0 and os.path.exists(os.path.join(run, "stop")):
        time.sleep(3600)  # blocked: no more progress (the watchdog's thread ends the process)
    step += 1
    dog.beat(f"step {step}")
    time.sleep(0.02)
