"""The watchdog's two rules (docs/reliability_signals.md, "one outcome, whichever timeout ends the wait"), called
directly: timeouts() chooses the watchdog's timeout below the process groups' so that it fires first, and
is_collective_timeout() tells a collective that timed out (a hang: the watchdog's report, exit 75) from a peer that
died (an error). The errors are real ones where a CPU makes them: a two-rank gloo group of this process (one thread
per rank) whose collective times out or whose peer closes; NCCL's, which need two GPUs, are constructed with the
text and type torch raises them with. A fraction of a second; mutation testing's selection (docs/development.md).
tests/test_faults_signals.py runs both rules in real processes.
"""

import datetime
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_sat.training.watchdog import Watchdog, is_collective_timeout, timeouts


def test_the_watchdog_fires_before_a_collective_times_out_whichever_timeout_is_given():
    """docs/reliability_signals.md, "one outcome": neither timeout given -> T 10, M 30; M given -> T = 0.8 M; T given
    -> M = max(30, T / 0.8); both given -> as given. With the defaults the watchdog fires (T plus one heartbeat,
    at most 0.88 M) before a collective that began after the last progress times out (M); 0.88 M exactly at M 2.5 s
    and below (T 2 s, the heartbeat's 0.2 s floor), past it below."""
    assert timeouts(None, None) == (10.0, 30.0)
    assert timeouts(None, 5.0) == (4.0, 5.0) and timeouts(None, 60.0) == (48.0, 60.0)
    assert timeouts(0.25, None) == (0.25, 30.0) and timeouts(40.0, None) == (40.0, 50.0)
    assert timeouts(24.0, None) == (24.0, 30.0) and timeouts(24.1, None)[1] == pytest.approx(30.125)
    assert timeouts(7.0, 5.0) == (7.0, 5.0) and timeouts(0, None) == (0, 30.0) and timeouts(0, 2.0) == (0, 2.0)
    for hang, group in ((None, None), (None, 2.5 / 60), (None, 0.1), (None, 0.25), (None, 5.0), (None, 600.0),
                        (0.1, None), (40.0, None), (600.0, None)):
        t, m = timeouts(hang, group)
        heartbeat = Watchdog("/nonexistent", 0, 1, 60 * t).interval_s
        assert 60 * t + heartbeat <= 60 * m * 0.88 * (1 + 1e-12), (hang, group, t, m)  # 0.12 M to spare
    t, m = timeouts(None, 2.4 / 60)  # below M 2.5 s the heartbeat's floor (0.2 s) is more than 0.08 M
    assert 60 * t + Watchdog("/nonexistent", 0, 1, 60 * t).interval_s > 60 * m * 0.88, (t, m)


def _gloo_pair() -> dict:
    """{rank: group} of a real two-rank gloo group on 127.0.0.1, both ranks in this process (made in two threads, as
    each waits for the other; 60 s to connect on a loaded machine)."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    groups = {}

    def make(rank):
        rank_store = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, 2, False)
        groups[rank] = dist.ProcessGroupGloo(rank_store, rank, 2, datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def _error_of(work) -> BaseException:
    with pytest.raises(Exception) as raised:
        work.wait()
    return raised.value


def test_a_collective_that_timed_out_is_a_hang_and_a_peer_that_died_is_not():
    """Rank 0's all-reduce alone: after the group's timeout, gloo's "Timed out waiting 1000ms for recv operation"
    (a hang: the watchdog reports it); rank 1's group closed during it: "Connection closed by peer" or "reset by
    peer" (an error). The NCCL texts (torch's ProcessGroupNCCL, as DistBackendError) are hangs; a timeout that is no
    collective's (a socket's TimeoutError) is not."""
    # rank 1's group held (alive), never joining the all-reduce, whose own timeout is 1 s (the group's is for connecting)
    groups = _gloo_pair()
    within = dist.AllreduceOptions()
    within.timeout = datetime.timedelta(milliseconds=1000)
    timed_out = _error_of(groups[0].allreduce([torch.ones(4)], within))
    assert "Timed out waiting 1000ms for recv operation" in str(timed_out) and is_collective_timeout(timed_out)
    groups = _gloo_pair()
    work = groups[0].allreduce([torch.ones(4)])
    del groups[1]  # its sockets close: rank 1 died
    closed = _error_of(work)  # which of the two gloo says depends on which socket event it sees first
    assert "Connection closed by peer" in str(closed) or "Connection reset by peer" in str(closed), closed
    assert isinstance(closed, RuntimeError)
    assert not is_collective_timeout(closed)
    nccl = [dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
                                  "OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=600000) ran for 600081 "
                                  "milliseconds before timing out."),
            dist.DistBackendError("Some NCCL operations have failed or timed out. Due to the asynchronous nature of "
                                  "CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.")]
    assert all(is_collective_timeout(e) for e in nccl)
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(0.01)
        with pytest.raises(TimeoutError) as socket_timeout:
            a.recv(1)
    assert str(socket_timeout.value) == "timed out" and not is_collective_timeout(socket_timeout.value)
