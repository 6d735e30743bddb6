"""A private single-node Slurm cluster for tests: Debian's munge, slurmctld and slurmd under a temp folder.

    from slurm_cluster import SlurmCluster
    with SlurmCluster() as cluster:                 # SlurmUnavailable when absent: `make slurm` installs it
        job = cluster.sbatch(["--ntasks=2", "--wrap", "srun hostname"], cwd="/tmp")
        assert cluster.wait(job) == "COMPLETED"

Several compute nodes on this one machine: SlurmCluster(nodes=2) names them n1, n2 (NodeAddr=127.0.0.1, a port
each, spool/log/pid files per node through %n) and runs one `slurmd -N nX` per node; `srun -N2` then runs a task
on each, with SLURM_NODEID 0 and 1 and SLURM_JOB_NODELIST n[1-2] (names no resolver knows: slurm/launch.sh
takes the rendezvous address from the first node's NodeAddr).

Standalone (start, print how to use it, stop on Enter):
    .venv/bin/python tests/slurm_cluster.py

What it does (Slurm 22.05 from Debian, set up by hand without systemd):
  * installs nothing: `make slurm` (idempotent, root, apt-get; .ci/run calls it before `make test`) installs
    slurmctld, slurmd, slurm-client, munge and, for accounting, slurmdbd, mariadb-server and mariadb-client. When
    a binary is missing, start() raises SlurmUnavailable naming it and `make slurm` (the Slurm tests skip with
    that reason), or, with MSAT_REQUIRE_SLURM=1 (set by .ci/run: in CI they must run), a RuntimeError.
  * munged runs as the munge user with its own key, socket, pid, log and seed files in ROOT/munge; Slurm
    is pointed at that socket (AuthInfo=socket=...), so a system munged (if any) is neither used nor touched.
  * slurmctld and slurmd run in the foreground (-D) as our children with SLURM_CONF=ROOT/slurm.conf, on free
    ports, with state/spool/log/pid folders under ROOT; ProctrackType=proctrack/linuxproc,
    TaskPlugin=task/none, SelectType=select/cons_tres + CR_Core, the node line from `slurmd -C`, one
    partition `debug`; cred_expire=10 and sched_interval=2 so that a requeued job starts again after ~10 s
    (Slurm's default holds it 120 s). By default no accounting (no sacct): job states come from `scontrol show job`.
  * SlurmCluster(accounting=True): `sacct` works. Slurm 22.05 keeps accounting only through slurmdbd and a
    MySQL/MariaDB server (its text-file accounting plugin is gone), so the harness also starts (Debian's
    slurmdbd and mariadb-server, from `make slurm`), as our children on free 127.0.0.1 ports, a private
    mariadbd (empty data folder under ROOT, --skip-grant-tables: no users or passwords, reachable only from this
    machine, about 1 s to start) and slurmdbd (it creates its tables), registers the cluster with sacctmgr and
    points slurmctld at it (AccountingStorageType=accounting_storage/slurmdbd). About 5-10 s more start-up.
  * stop(): cancels every job, waits for the job steps to go, kills any slurmstepd still serving this
    cluster, then stops slurmd, slurmctld and munged (the processes it started, by pid) and removes ROOT
    unless keep=True. It runs from __exit__ and from an atexit hook, so daemons never outlive the tests.
"""

import atexit
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

from megatron_sat.parallel.world import free_port

PACKAGES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge"}
ACCOUNTING_PACKAGES = {"slurmdbd": "slurmdbd", "mariadbd": "mariadb-server", "mariadb": "mariadb-client"}
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}
STUCK = {"PartitionConfig", "BadConstraints", "PartitionTimeLimit", "PartitionNodeLimit", "InvalidAccount",
         "InvalidQOS", "ReqNodeNotAvail", "JobHeldAdmin", "JobHeldUser", "DependencyNeverSatisfied"}


class SlurmUnavailable(RuntimeError):
    """Slurm (or, for accounting, slurmdbd and MariaDB) is not installed here: `make slurm` installs it."""


def _which(name: str) -> Optional[str]:
    found = shutil.which(name)
    if found:
        return found
    for folder in SBIN:
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path
    return None


def check_installed(accounting: bool = False) -> None:
    """SlurmUnavailable naming the missing binaries and `make slurm` (a RuntimeError instead when
    MSAT_REQUIRE_SLURM=1, as in CI, where the Slurm tests must run, not skip)."""
    packages = dict(PACKAGES, **(ACCOUNTING_PACKAGES if accounting else {}))
    missing = sorted(binary for binary in packages if _which(binary) is None)
    if not missing:
        return
    message = (f"{', '.join(missing)} not installed (Debian packages "
               f"{' '.join(sorted({packages[b] for b in missing}))}): run `make slurm` (root, apt-get)")
    if os.environ.get("MSAT_REQUIRE_SLURM") == "1":
        raise RuntimeError(f"MSAT_REQUIRE_SLURM=1 but {message}")
    raise SlurmUnavailable(message)


def _node_line() -> str:
    """`slurmd -C`'s NodeName line (real CPUs, sockets, cores, threads, memory)."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=60).stdout
    line = next(x for x in out.splitlines() if x.startswith("NodeName="))
    return line.strip()


class SlurmCluster:
    """One controller + one compute node on this machine. Use as a context manager (or start()/stop())."""

    def __init__(self, root: Optional[str] = None, keep: bool = False, log=print, nodes: int = 1,
                 accounting: bool = False):
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.num_nodes = nodes
        self.accounting = accounting
        self.nodes: List[str] = []
        self.root = root
        self.keep = keep
        self.log = log
        self.procs: Dict[str, subprocess.Popen] = {}
        self.node = None
        self.partition = "debug"
        self._stepd_before = set()
        self._started = False

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    @property
    def conf(self) -> str:
        return os.path.join(self.root, "slurm.conf")

    def env(self, base: Optional[dict] = None) -> dict:
        """Environment for Slurm commands against this cluster (sbatch, squeue, scontrol, scancel)."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        for key in [k for k in env if k.startswith(("SBATCH_", "SRUN_", "SALLOC_"))
                    or k in ("SLURM_JOB_ID", "SLURM_JOBID")]:
            env.pop(key)  # an outer allocation's settings must not leak into this cluster's jobs
        return env

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        check_installed(accounting=self.accounting)
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="megatron-sat-slurm-")
        os.chmod(self.root, 0o755)  # the munge user must reach ROOT/munge
        for sub in ("state", "spool", "log", "run"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        self._stepd_before = set(self._stepd_pids())
        atexit.register(self.stop)
        self._started = True
        try:
            self._start_munge()
            if self.accounting:
                self._start_accounting(timeout)
            self._write_conf()
            env = self.env()
            self.procs["slurmctld"] = subprocess.Popen(
                [_which("slurmctld"), "-D", "-i", "-f", self.conf], env=env,
                stdout=open(os.path.join(self.root, "log", "slurmctld.stdout"), "w"), stderr=subprocess.STDOUT,
                start_new_session=True)
            self._wait_for(lambda: self._ok(["scontrol", "ping"], "UP"), timeout, "slurmctld to answer")
            for node in self.nodes:
                self.start_node(node)
            self._wait_for(self._node_idle, timeout, f"node(s) {', '.join(self.nodes)} to become idle")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
                subprocess.run(["scancel", "--full", "--quiet", "--user", "root"] if os.geteuid() == 0
                               else ["scancel", "--full", "--quiet", "--me"], env=self.env(),
                               capture_output=True, timeout=30)
                deadline = time.time() + 40
                while time.time() < deadline and self._squeue_ids():
                    time.sleep(0.5)
        except Exception:  # noqa: BLE001 - teardown must go on
            pass
        for pid in set(self._stepd_pids()) - self._stepd_before:  # job steps still serving this cluster
            _kill_tree(pid)
        deadline = time.time() + 10
        while time.time() < deadline and set(self._stepd_pids()) - self._stepd_before:
            time.sleep(0.2)
        for name in [n for n in self.procs if n.startswith("slurmd-") or n == "slurmd"] + [
                "slurmctld", "slurmdbd", "mariadbd", "munged"]:
            proc = self.procs.pop(name, None)
            if proc is not None:
                _stop_process(proc)
        try:
            atexit.unregister(self.stop)
        except Exception:  # noqa: BLE001
            pass
        if not self.keep and self.root and os.path.isdir(self.root):
            shutil.rmtree(self.root, ignore_errors=True)

    # ---------------------------------------------------------------- set-up details
    def _start_munge(self) -> None:
        mdir = os.path.join(self.root, "munge")
        os.makedirs(mdir, exist_ok=True)
        key = os.path.join(mdir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        import pwd

        pw = pwd.getpwnam("munge")
        for path in (mdir, key):
            os.chown(path, pw.pw_uid, pw.pw_gid)
        os.chmod(mdir, 0o755)  # munged wants its socket folder executable by all; the key stays 0600
        os.chmod(key, 0o600)
        self.munge_socket = os.path.join(mdir, "munge.socket")
        cmd = [_which("munged"), "--foreground", f"--key-file={key}", f"--socket={self.munge_socket}",
               f"--pid-file={mdir}/munged.pid", f"--log-file={mdir}/munged.log", f"--seed-file={mdir}/munged.seed"]
        if os.geteuid() == 0:  # munged refuses to run as root: drop to the munge user (setpriv execs, no fork)
            cmd = [_which("setpriv"), f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", *cmd]
        self.procs["munged"] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                start_new_session=True)
        self._wait_for(lambda: os.path.exists(self.munge_socket) or self.procs["munged"].poll() is not None,
                       20, "munged's socket")
        if self.procs["munged"].poll() is not None:
            raise RuntimeError(f"munged exited: {self.procs['munged'].stderr.read().decode()[-2000:]}")

    def _start_accounting(self, timeout: float) -> None:
        """A private mariadbd and slurmdbd (module docstring); returns once sacctmgr knows the cluster."""
        r = self.root
        db = os.path.join(r, "mysql")
        os.makedirs(os.path.join(db, "data"), exist_ok=True)
        self.db_port, self.dbd_port = free_port(), free_port()
        self.procs["mariadbd"] = subprocess.Popen(
            [_which("mariadbd"), "--no-defaults", f"--datadir={db}/data", "--user=root", "--skip-grant-tables",
             "--bind-address=127.0.0.1", f"--port={self.db_port}", f"--socket={db}/mysqld.sock",
             f"--pid-file={db}/mysqld.pid", f"--log-error={r}/log/mariadbd.log", "--skip-log-bin",
             "--performance-schema=0", "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=8M",
             "--innodb-data-file-path=ibdata1:4M:autoextend"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        client = [_which("mariadb"), "--no-defaults", "-h", "127.0.0.1", "-P", str(self.db_port), "-u", "root",
                  "-e", "select 1"]
        self._wait_for(lambda: subprocess.run(client, capture_output=True, timeout=10).returncode == 0, timeout,
                       "mariadbd to answer")
        conf = os.path.join(r, "slurmdbd.conf")
        with open(conf, "w") as f:
            f.write("\n".join([
                "AuthType=auth/munge", f"AuthInfo=socket={self.munge_socket}", "DbdHost=localhost",
                "DbdAddr=127.0.0.1", f"DbdPort={self.dbd_port}", "SlurmUser=root", "DebugLevel=info",
                f"LogFile={r}/log/slurmdbd.log", f"PidFile={r}/run/slurmdbd.pid",
                "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1", f"StoragePort={self.db_port}",
                "StorageUser=root", "StorageLoc=slurm_acct_db"]) + "\n")
        os.chmod(conf, 0o600)  # slurmdbd refuses a config that others can read (it may hold a password)
        self.procs["slurmdbd"] = subprocess.Popen(
            [_which("slurmdbd"), "-D"], env=self.env(),  # it reads slurmdbd.conf beside $SLURM_CONF
            stdout=open(os.path.join(r, "log", "slurmdbd.stdout"), "w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self._write_conf()  # sacctmgr reads slurm.conf for the slurmdbd's address (rewritten before slurmctld starts)

        def registered() -> bool:
            self._ok(["sacctmgr", "-i", "add", "cluster", "msat"], "")
            return self._ok(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"], "msat")

        self._wait_for(registered, timeout, "slurmdbd to take the cluster")

    def start_node(self, node: str) -> None:
        """Start (or restart) the slurmd of one compute node."""
        name = "slurmd" if self.num_nodes == 1 else f"slurmd-{node}"
        self.procs[name] = subprocess.Popen(
            [_which("slurmd"), "-D", "-f", self.conf, "-N", node], env=self.env(),
            stdout=open(os.path.join(self.root, "log", f"{name}.stdout"), "a"), stderr=subprocess.STDOUT,
            start_new_session=True)

    def kill_node(self, node: str) -> None:
        """A node dies: its slurmd and every process of a job step running on it (and, on a one-node cluster, the
        slurmstepd processes) get SIGKILL. Slurm notices after SlurmdTimeout (60 s) unless told at once with
        `scontrol update nodename=NODE state=down`."""
        if self.num_nodes == 1:  # every slurmstepd of this cluster runs on its one node: they die with it
            for pid in self._stepd_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        proc = self.procs.pop("slurmd" if self.num_nodes == 1 else f"slurmd-{node}")
        proc.kill()
        proc.wait()
        for pid, env in _proc_fields("environ"):
            if f"SLURM_CONF={self.conf}".encode() in env and f"SLURMD_NODENAME={node}".encode() in env:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def node_addr(self, node: str) -> str:
        out = self.run(["scontrol", "show", "node", node]).stdout
        return re.search(r"NodeAddr=(\S+)", out).group(1)

    def _write_conf(self) -> None:
        node = _node_line()
        fields = dict(re.findall(r"(\w+)=(\S+)", node))
        self.node = fields["NodeName"]  # this machine's name: the controller's host, and the node of a 1-node cluster
        self.cpus = int(fields.get("CPUs", "1"))
        threads = int(fields.get("ThreadsPerCore", "1"))
        r = self.root
        lines = [
            "ClusterName=msat",
            # job ids from a random start: slurm/launch.sh derives MASTER_PORT from the job id, so two clusters on
            # one machine (two test sessions at once) would otherwise give their first jobs the same port
            f"FirstJobId={random.randrange(1, 15000)}",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",  # a multi-node cluster gives each node a Port= of its own
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire is also how long a requeued job waits before it may start again (default 120 s)
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool" + ("/%n" if self.num_nodes > 1 else ""),
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd" + ("-%n" if self.num_nodes > 1 else "") + ".pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd" + ("-%n" if self.num_nodes > 1 else "") + ".log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            f"SelectTypeParameters={'CR_Core' if threads == 1 else 'CR_CPU'}",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,bf_interval=2",  # pick up requeued jobs within seconds
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            *(["AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=localhost",
               f"AccountingStoragePort={self.dbd_port}",
               # the munge socket for talking to slurmdbd (Slurm reads it from here, not from AuthInfo)
               f"AccountingStoragePass={self.munge_socket}"] if self.accounting
              else ["AccountingStorageType=accounting_storage/none"]),
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MinJobAge=600",  # finished jobs stay visible to scontrol for 10 minutes
            "KillWait=10",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "MessageTimeout=20",
        ]
        if self.num_nodes == 1:
            self.nodes = [self.node]
            lines.append(f"{node} NodeAddr=127.0.0.1 State=UNKNOWN")
        else:  # the same hardware line for every simulated node, each its own name and port
            self.nodes = [f"n{i}" for i in range(1, self.num_nodes + 1)]
            hardware = re.sub(r"^NodeName=\S+\s*", "", node)
            for name in self.nodes:
                os.makedirs(os.path.join(r, "spool", name), exist_ok=True)
                lines.append(f"NodeName={name} NodeAddr=127.0.0.1 Port={free_port()} {hardware} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
                     "State=UP")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _ok(self, cmd: List[str], needle: str) -> bool:
        try:
            out = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return out.returncode == 0 and needle in out.stdout

    def _node_idle(self) -> bool:
        try:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True,
                                 text=True, timeout=10).stdout
        except subprocess.TimeoutExpired:
            return False
        states = out.split()
        return len(states) == len(self.nodes) and all(s.startswith("idle") for s in states)

    def _wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}; "
                                       f"logs in {self.root}/log:\n{self.tail_logs()}")
            if predicate():
                return
            time.sleep(0.25)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.tail_logs()}")

    def _stepd_pids(self) -> List[int]:
        return [pid for pid, cmd in _proc_fields("cmdline")
                if cmd and os.path.basename(cmd[0]).startswith(b"slurmstepd")
                and (self.root is None or self._belongs_to_us(pid))]

    def _belongs_to_us(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f"SLURM_CONF={self.conf}".encode() in f.read().split(b"\0")
        except OSError:
            return False

    def _squeue_ids(self) -> List[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(), capture_output=True, text=True,
                             timeout=10).stdout
        return out.split()

    # ---------------------------------------------------------------- using it
    def run(self, cmd: List[str], cwd: Optional[str] = None, env: Optional[dict] = None, timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, cwd=cwd, env=self.env(env), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def signal_batch(self, job_id: str, sig: str = "USR1", timeout: float = 60) -> None:
        """`scancel --signal=SIG --batch` to the running task of a job (or of a one-task array, by its own JobId).
        Retried while the job is RUNNING: CI saw `Invalid job id specified` from a signal sent to an array job by its
        ArrayJobId while its task ran; a job that is not running when signalled is an error."""
        deadline = time.time() + timeout
        while True:
            records = self.job(job_id)
            running = [r.get("JobId", job_id) for r in records if r.get("JobState") == "RUNNING"]
            if running:
                proc = self.run(["scancel", f"--signal={sig}", "--batch", running[0]], check=False)
                if proc.returncode == 0:
                    return
            if not running or time.time() > deadline:
                states = [(r.get("JobId"), r.get("JobState")) for r in records]
                raise RuntimeError(f"could not send {sig} to job {job_id} (records {states}): "
                                   f"{proc.stderr.strip() if running else 'not running'}\n{self.tail_logs()}")
            time.sleep(1)

    def sbatch(self, args: List[str], cwd: Optional[str] = None, env: Optional[dict] = None) -> str:
        """Submit; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> List[Dict[str, str]]:
        """`scontrol show job -o` records (one per array task) as dicts; [] when the job is unknown."""
        proc = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if proc.returncode != 0:
            return []
        records = []
        for line in proc.stdout.splitlines():
            if line.strip():
                records.append(dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", line)))
        return records

    def states(self, job_id: str) -> List[str]:
        return [r.get("JobState", "?") for r in self.job(job_id)]

    def wait(self, job_id: str, timeout: float = 300, poll: float = 0.5) -> str:
        """Wait until every task of the job is in a terminal state; returns the state (the worst one for arrays)."""
        deadline = time.time() + timeout
        states = []
        while time.time() < deadline:
            records = self.job(job_id)
            states = [r.get("JobState", "?") for r in records]
            stuck = [r.get("Reason") for r in records if r.get("JobState") == "PENDING" and r.get("Reason") in STUCK]
            if stuck:
                raise RuntimeError(f"job {job_id} can never start here (pending: {stuck[0]}): {records[0]}")
            if states and all(s in TERMINAL for s in states) and not any(
                    r.get("ArrayTaskId", "").startswith("[") or "-" in r.get("ArrayTaskId", "")
                    for r in records):  # a pending array remainder like [1-3] is not finished
                bad = [s for s in states if s != "COMPLETED"]
                return bad[0] if bad else "COMPLETED"
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not finished after {timeout:.0f} s (states {states})\n{self.tail_logs()}")

    def tail_logs(self, chars: int = 3000) -> str:
        out = []
        for name in ["slurmctld.log", "slurmd.log"] + [f"slurmd-{n}.log" for n in self.nodes if self.num_nodes > 1]:
            path = os.path.join(self.root or "", "log", name)
            if os.path.isfile(path):
                with open(path, errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-chars:]}")
        return "\n".join(out)


def _proc_fields(name: str):
    """(pid, /proc/PID/<name> split at NUL bytes) of every process that can be read (cmdline, environ)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/{name}", "rb") as f:
                    yield int(entry), f.read().split(b"\0")
            except OSError:
                continue


def rank_process(folder: str, procid: int):
    """The trainer task of Slurm rank `procid` training into run folder `folder` (a psutil.Process), or None."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "megatron_sat.train" in " ".join(proc.info["cmdline"] or []) and folder in proc.info["cmdline"] \
                    and proc.environ().get("SLURM_PROCID") == str(procid):
                return proc
        except psutil.Error:
            pass
    return None


def _stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants (found through /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(children.get(p, []))
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


if __name__ == "__main__":
    with SlurmCluster() as c:
        print(f"cluster up: node {c.node} ({c.cpus} CPUs), partition {c.partition}\n"
              f"  export SLURM_CONF={c.conf}\nPress Enter to stop it.")
        try:
            input()
        except EOFError:
            pass
