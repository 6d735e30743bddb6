"""One rank of a job under the hang watchdog, without a trainer (tests/test_faults_signals.py times the watchdog).

    python tests/workers/watchdog_rank.py RUN RANK WORLD TIMEOUT_S

Every rank runs megatron_sat.training.watchdog.Watchdog with TIMEOUT_S and its default heartbeat, and makes
progress (a beat) every 20 ms. Rank 0 stops making progress once RUN/stop exists, as a rank blocked in a collective
whose peer stopped; the test SIGSTOPs the other rank at that moment. The watchdog of rank 0 then fires.
"""

import os
import sys
import time

from megatron_sat.training.watchdog import Watchdog

run, rank, world, timeout_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
dog = Watchdog(run, rank, world, timeout_s).start()
step = 0
while True:
    if rank == 0 and os.path.exists(os.path.join(run, "stop")):
        time.sleep(3600)  # blocked: no more progress (the watchdog's thread ends the process)
    step += 1
    dog.beat(f"step {step}")
    time.sleep(0.02)
