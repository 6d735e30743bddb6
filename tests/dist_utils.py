"""Helpers for multi-process torch.distributed tests (gloo on CPU, NCCL on a GPU).

Usage (in a test module; the function must be importable, i.e. defined at module level)::

    from dist_utils import run_distributed, init_megatron

    def _worker(hidden):                     # runs in every rank, process group already initialized
        init_megatron(tp=2)                  # optional: megatron parallel state + RNG tracker
        ...
        return {"loss": loss}                # anything torch.save can write; tensors come back on CPU

    def test_something():
        results = run_distributed(_worker, 2, 32)   # list indexed by rank
        assert torch.equal(results[0]["loss"], results[1]["loss"])

How it works: ``run_distributed`` starts ``world_size`` fresh Python processes (``subprocess``, not fork: no state
leaks from the pytest process), with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR=127.0.0.1/MASTER_PORT=<free port> in
their environment and the parent's ``sys.path`` on PYTHONPATH.  Each child calls
``megatron_sat.compat.ensure_cpu_compat()`` (unless ``compat=False``), initializes the default process group with
``megatron_sat.compat.dist_backend()`` (unless ``init_process_group=False``), runs ``fn(*args, **kwargs)`` and
writes the return value (via ``torch.save``, tensors moved to CPU) or its traceback to a temporary folder.  If any
rank fails, the others are terminated and :class:`DistributedTestError` is raised with the failing rank's
traceback and the tail of its output.  A timeout kills all ranks and raises too.  Children get
OMP_NUM_THREADS = max(1, cpu_count // world_size) to avoid oversubscribing small CI machines.

``fn`` may be a module-level callable or a string ``"package.module:function"`` or ``"/path/to/file.py:function"``.
Keep the number of launches small (each costs a few seconds of imports per rank): one launch that checks several
things is better than several launches.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from megatron_sat.parallel.world import free_port

__all__ = ["run_distributed", "init_megatron", "free_port", "DistributedTestError"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)


class DistributedTestError(RuntimeError):
    """A rank of :func:`run_distributed` failed or timed out; the message holds its traceback."""


def _fn_spec(fn) -> str:
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"expected 'module:function' or 'path.py:function', got {fn!r}")
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"{fn!r} must be a module-level function (the child processes import it)")
    if module == "__main__":
        path = os.path.abspath(sys.modules["__main__"].__file__)
        return f"{path}:{qualname}"
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    # Test modules imported by pytest (rootdir/prepend mode) may not be importable under the same name from a
    # fresh interpreter; loading them by file path always works.
    if path and path.endswith(".py") and os.path.dirname(os.path.abspath(path)) == _HERE:
        return f"{os.path.abspath(path)}:{qualname}"
    return f"{module}:{qualname}"


def run_distributed(
    fn: Callable | str,
    world_size: int,
    *args: Any,
    timeout: float = 600.0,
    env: dict | None = None,
    compat: bool = True,
    init_process_group: bool = True,
    retries: int = 1,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` processes; return the per-rank results (index = rank).

    timeout: seconds for the whole launch; env: extra environment variables for the children;
    compat: call ``megatron_sat.compat.ensure_cpu_compat()`` first; init_process_group: initialize the default
    group (gloo without GPU, nccl with; set ``init_process_group=False`` to do it yourself);
    retries: relaunches after a port clash ("address already in use").
    """
    spec = _fn_spec(fn)
    for attempt in range(retries + 1):
        try:
            return _launch(spec, world_size, args, kwargs, timeout, env, compat, init_process_group)
        except DistributedTestError as e:
            if attempt < retries and "ddress already in use" in str(e):
                continue
            raise
    raise AssertionError("unreachable")


def _launch(spec, world_size, args, kwargs, timeout, env, compat, init_pg):
    with tempfile.TemporaryDirectory(prefix="dist_test_") as tmp:
        payload = os.path.join(tmp, "payload.pkl")
        with open(payload, "wb") as f:
            pickle.dump(
                {"fn": spec, "args": args, "kwargs": kwargs, "compat": compat, "init_pg": init_pg}, f
            )
        port = free_port()
        threads = max(1, (os.cpu_count() or 1) // world_size)
        pypath = [_HERE, _REPO] + [p for p in sys.path if p and os.path.isdir(p)]
        if os.environ.get("PYTHONPATH"):
            pypath.append(os.environ["PYTHONPATH"])
        procs, logs = [], []
        for rank in range(world_size):
            child_env = dict(os.environ)
            child_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS=str(threads),
                PYTHONPATH=os.pathsep.join(dict.fromkeys(pypath)),
                PYTHONUNBUFFERED="1",
                DIST_TEST_DIR=tmp,
            )
            if env:
                child_env.update({k: str(v) for k, v in env.items()})
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+b")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", "import dist_utils; dist_utils._child_main()", payload],
                    env=child_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=os.getcwd(),
                    start_new_session=True,
                )
            )
        try:
            failed = _wait(procs, timeout)
            if failed is not None:
                rank, reason = failed
                raise DistributedTestError(_failure_message(tmp, rank, reason, logs))
            results = []
            for rank in range(world_size):
                import torch

                results.append(torch.load(os.path.join(tmp, f"result{rank}.pt"), weights_only=False))
            return results
        finally:
            for p in procs:
                _kill(p)
            for log in logs:
                log.close()


def _wait(procs, timeout):
    """Wait for all; return (rank, reason) of the first failure, or None."""
    deadline = time.monotonic() + timeout
    while True:
        alive = False
        for rank, p in enumerate(procs):
            rc = p.poll()
            if rc is None:
                alive = True
            elif rc != 0:
                return rank, f"exit code {rc}"
        if not alive:
            return None
        if time.monotonic() > deadline:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    return rank, f"timed out after {timeout:.0f} s"
        time.sleep(0.05)


def _kill(p):
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)  # the child's own session (start_new_session=True)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()


def _tail(path, n=6000):
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data[-n:].decode(errors="replace")
    except OSError:
        return "<no output>"


def _failure_message(tmp, rank, reason, logs):
    for log in logs:
        log.flush()
    # Report the rank whose traceback was written first: it is the cause; the others usually fail only
    # because a peer went away ("Connection closed by peer"), and may exit before it is polled.
    tb_ranks = [r for r in range(len(logs)) if os.path.exists(os.path.join(tmp, f"error{r}.txt"))]
    if tb_ranks:
        first = min(tb_ranks, key=lambda r: os.path.getmtime(os.path.join(tmp, f"error{r}.txt")))
        if first != rank:
            reason = f"the first to fail; rank {rank} then: {reason}"
            rank = first
    tb_path = os.path.join(tmp, f"error{rank}.txt")
    parts = [f"rank {rank} failed ({reason})"]
    if os.path.exists(tb_path):
        with open(tb_path) as f:
            parts.append(f"---- traceback (rank {rank}) ----\n{f.read()}")
    parts.append(f"---- output tail (rank {rank}) ----\n{_tail(os.path.join(tmp, f'rank{rank}.log'))}")
    return "\n".join(parts)


def _load_fn(spec: str):
    target, _, qualname = spec.rpartition(":")
    if target.endswith(".py"):
        import importlib.util

        name = "_dist_test_" + os.path.splitext(os.path.basename(target))[0]
        mod_spec = importlib.util.spec_from_file_location(name, target)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
    else:
        import importlib

        module = importlib.import_module(target)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _to_cpu(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_to_cpu(v) for v in obj]
        return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
    return obj


def _child_main():
    import traceback

    payload_path = sys.argv[1]
    tmp = os.path.dirname(payload_path)
    rank = int(os.environ["RANK"])
    try:
        with open(payload_path, "rb") as f:
            payload = pickle.load(f)
        import torch

        if payload["compat"]:
            from megatron_sat import compat

            compat.ensure_cpu_compat()
        if payload["init_pg"]:
            import torch.distributed as dist

            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
            dist.init_process_group(backend=backend, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
        fn = _load_fn(payload["fn"])
        result = fn(*payload["args"], **payload["kwargs"])
        torch.save(_to_cpu(result), os.path.join(tmp, f"result{rank}.pt"))
        if payload["init_pg"]:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(tmp, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def init_megatron(tp: int = 1, pp: int = 1, vpp: int | None = None, cp: int = 1, seed: int = 1234, **kwargs):
    """In a child of :func:`run_distributed`: (re)initialize megatron's parallel state and RNG tracker.

    Destroys a previous parallel state first, so one launch can test several layouts in turn.  Extra keyword
    arguments go to ``parallel_state.initialize_model_parallel``.
    """
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_sat.parallel.layout import destroy

    destroy()  # releases the previous layout's groups (Megatron's own destroy leaves them running)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        **kwargs,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return ps


# ``python tests/dist_utils.py`` self-check: two ranks all-reduce a tensor.
def _selfcheck_worker(x):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x + dist.get_rank())])
    dist.all_reduce(t)
    return t


if __name__ == "__main__":
    sys.path.insert(0, _HERE)
    import dist_utils as _du  # so the function is importable by name in the children

    print(_du.run_distributed(_du._selfcheck_worker, 2, 1.0))
