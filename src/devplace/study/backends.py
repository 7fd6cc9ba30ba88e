"""Where a study's tasks run: `local` (a process pool on this machine) or `ray` (Ray tasks, on a local Ray
cluster devplace starts, or on an existing cluster at `address`).

A backend runs `fn(*args)` for every argument tuple and yields `(tag, result)` pairs as tasks finish, in
whatever order they finish; the driver writes the results. `share(obj)` hands the backend an object that
many tasks take (a graph): the local pool pickles it per task (graphs are tens of kB), Ray stores it once in
its object store. Task functions must return normally: they catch their own errors.

Workers never outlive their driver: each one watches the driver's process (`watch_driver`) and exits when it is
gone, so a driver killed with -9 or SIGTERM leaves no worker (nor, since the forkserver and resource tracker
end with their last worker, any helper process) behind, on the local pool and on a local Ray cluster. A local
Ray cluster's own agents (dashboard and runtime-env agents) would outlive a killed driver too: a small reaper
process ends them (`_REAPER`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from devplace.defaults import cpu_cores
from devplace.errors import DevplaceError

BACKENDS = ("local", "ray")
_DIED = ("a worker process died while running a cell (out of memory?); the finished cells are saved: run the "
         "same command again to resume, with fewer --workers if memory is short")


class BackendError(DevplaceError):
    """An unknown backend, a bad worker count, or a Ray cluster that cannot be reached."""


DRIVER_POLL_S = 0.5  # how often a worker checks that its driver still runs
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_watched: int | None = None  # the driver pid this process watches (one watcher thread per process)


def worker_init(driver_pid: int | None = None) -> None:
    """Per-process setup of a study worker: one torch thread (cells run side by side, one per core; the
    placers' tensors are small, so more threads only contend), no downloads, and with `driver_pid` an exit
    when that driver process ends (`watch_driver`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if driver_pid is not None:
        watch_driver(driver_pid)
    import torch

    torch.set_num_threads(1)


def watch_driver(driver_pid: int) -> None:
    """End this process when process `driver_pid` ends (killed with -9 included; a pool's shutdown never
    reaches a dead driver's workers, which would otherwise wait for tasks forever, ~400 MB each).

    Where the driver is this process's parent (spawn), Linux's parent-death signal (prctl PR_SET_PDEATHSIG)
    delivers SIGKILL at once; in every case a daemon thread checks every DRIVER_POLL_S seconds that the
    driver is still running (forkserver workers are children of the fork server, not of the driver).
    """
    global _watched
    if _watched == driver_pid:
        return
    _watched = driver_pid
    if sys.platform.startswith("linux") and os.getppid() == driver_pid:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the thread below still ends the process
            pass
    threading.Thread(target=_exit_when_gone, args=(driver_pid,), name="devplace-driver-watch",
                     daemon=True).start()


def _exit_when_gone(pid: int) -> None:
    while _running(pid):
        time.sleep(DRIVER_POLL_S)
    os._exit(1)  # the driver that would write this cell's row is gone: stop at once, no cleanup to wait for


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed driver its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc (not Linux): existence is all we know
        return True
    return state not in (b"Z", b"X")


class LocalBackend:
    """A pool of `workers` processes started with forkserver (spawn where unavailable): a fresh interpreter,
    not a fork of a driver that may hold threads and open SQLite handles."""

    name = "local"

    def __init__(self, workers: int = 1) -> None:
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        self.workers = workers
        self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=worker_init,
                                         initargs=(os.getpid(),))

    def share(self, obj: Any) -> Any:
        return obj

    def run(self, fn: Callable[..., Any], tasks: Iterable[tuple[Any, tuple[Any, ...]]]) -> Iterator[tuple[Any, Any]]:
        """Run fn(*args) for each (tag, args); yield (tag, result) as each finishes. A few tasks per worker are
        in flight at a time, so a study of thousands of cells does not pickle them all up front."""
        def finished(pending: list[Future[Any]]) -> list[tuple[Future[Any], Any]]:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            out = []
            for fut in done:
                try:
                    out.append((fut, fut.result()))
                except BrokenProcessPool:
                    raise BackendError(_DIED) from None
            return out

        yield from _windowed(tasks, 4 * self.workers, lambda args: self._pool.submit(fn, *args), finished)

    def close(self) -> None:
        # cancel_futures: on Ctrl-C the queued cells are dropped at once (they simply stay unfinished)
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayBackend:
    """Ray tasks of one CPU each. Without `address`, starts a local Ray cluster of `workers` CPUs (no
    dashboard) and stops it at close; with one, connects to that cluster (`ray://host:10001` or `auto`)."""

    name = "ray"

    def __init__(self, workers: int = 1, address: str | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise BackendError("the ray backend needs the `ray` package; pip install 'ray[default]', "
                               "or use --backend local") from None
        self._ray = ray
        self._started = False
        self._reaper: subprocess.Popen[bytes] | None = None
        try:
            if not ray.is_initialized():
                # no runtime_env: it would start Ray's runtime-env agent and delay every worker's start;
                # worker_init sets the thread count and offline mode inside each task instead
                if address is None:
                    self._reaper = _start_reaper()
                    # address="local": a cluster of its own, never one another process on this machine runs
                    # (ray.init would join that one, and then refuses num_cpus)
                    ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False,
                             configure_logging=False)
                else:
                    ray.init(address=address, log_to_driver=False)
                self._started = True
        except (ConnectionError, RuntimeError, ValueError) as exc:
            _stop_reaper(self._reaper)
            raise BackendError(f"cannot start or reach the Ray cluster{f' at {address}' if address else ''}: "
                               f"{exc}") from None
        self.workers = workers if address is None else max(1, int(ray.cluster_resources().get("CPU", workers)))
        self._remote = ray.remote(num_cpus=1, max_retries=0)(_ray_call)
        # workers on this machine watch this driver; on other machines Ray itself ends a dead driver's tasks
        self._driver = (socket.gethostname(), os.getpid())

    def share(self, obj: Any) -> Any:
        return self._ray.put(obj)

    def run(self, fn: Callable[..., Any], tasks: Iterable[tuple[Any, tuple[Any, ...]]]) -> Iterator[tuple[Any, Any]]:
        """As LocalBackend.run: at most a few tasks per CPU are submitted ahead of the results."""
        ray = self._ray

        def finished(pending: list[Any]) -> list[tuple[Any, Any]]:
            (ref,), _ = ray.wait(pending, num_returns=1)
            try:
                return [(ref, ray.get(ref))]
            except ray.exceptions.RayError as exc:  # a worker or node died: the task function never raises
                raise BackendError(f"{_DIED} ({type(exc).__name__})") from None

        yield from _windowed(tasks, 4 * self.workers, lambda args: self._remote.remote(self._driver, fn, *args),
                             finished)

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()
        _stop_reaper(self._reaper)
        self._reaper = None


# The reaper of a local Ray cluster. Every second it notes the driver's living descendants (the Ray processes),
# keeping the ones noted before while they live: a process whose parent died in the meantime is no longer a
# descendant, but it is still the driver's. When its stdin reaches EOF without a word (the driver died and
# nobody shut the cluster down) it kills them all; a driver that shuts Ray down writes "done" first and the
# reaper leaves. Processes are known by pid and start time, so a reused pid is never killed. Linux only.
_REAPER = r"""
import os, select, signal, sys
driver, me = int(sys.argv[1]), os.getpid()
def table():
    out = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/stat", "rb") as fh:
                    f = fh.read().rsplit(b")", 1)[1].split()
                out[int(e)] = (int(f[1]), f[19], f[0])  # parent, start time, state
            except (OSError, IndexError, ValueError):
                pass
    return out
def note(seen):
    t = table()
    keep = {p: s for p, s in seen.items() if p in t and t[p][1] == s and t[p][2] not in (b"Z", b"X")}
    kids = {}
    for p, (parent, _, state) in t.items():
        if state not in (b"Z", b"X"):
            kids.setdefault(parent, []).append(p)
    todo = [driver]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k != me:
                keep[k] = t[k][1]
                todo.append(k)
    return keep
seen = note({})
while True:
    if select.select([0], [], [], 1.0)[0]:
        if os.read(0, 16):
            sys.exit(0)
        break
    seen = note(seen)
for pid in note(seen):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""


def _start_reaper() -> subprocess.Popen[bytes] | None:
    """The reaper of this driver's local Ray cluster (see _REAPER), or None where there is no /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    # its own session: a Ctrl-C or kill of the driver's process group does not reach it
    return subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop_reaper(reaper: subprocess.Popen[bytes] | None) -> None:
    """Tell the reaper that the cluster was shut down properly, so it leaves without killing anything."""
    if reaper is None:
        return
    assert reaper.stdin is not None
    try:
        reaper.stdin.write(b"done")
        reaper.stdin.close()
    except OSError:  # it is gone already
        pass
    reaper.wait()


def _windowed(tasks: Iterable[tuple[Any, tuple[Any, ...]]], window: int, submit: Callable[[tuple[Any, ...]], Any],
              finished: Callable[[list[Any]], list[tuple[Any, Any]]]) -> Iterator[tuple[Any, Any]]:
    """Keep at most `window` tasks submitted; yield (tag, result) as `finished(handles)` reports them (it waits
    for at least one and returns (handle, result) pairs)."""
    pending: dict[Any, Any] = {}
    it = iter(tasks)
    exhausted = False
    while pending or not exhausted:
        while not exhausted and len(pending) < window:
            try:
                tag, args = next(it)
            except StopIteration:
                exhausted = True
                break
            pending[submit(args)] = tag
        if not pending:
            break
        for handle, result in finished(list(pending)):
            yield pending.pop(handle), result


def _ray_call(driver: tuple[str, int], fn: Callable[..., Any], *args: Any) -> Any:
    # Ray resolves ObjectRefs passed as top-level arguments, so shared graphs arrive as objects here
    host, pid = driver
    worker_init(pid if host == socket.gethostname() else None)
    return fn(*args)


def check_backend(name: str, workers: int, address: str | None = None) -> None:
    """Refuse (BackendError) what `make_backend` could not start: an unknown backend, a worker count below 1
    or, on this machine (no --address), above its CPU cores (`defaults.cpu_cores`: more only share them, each
    costing its memory), or an --address for the local backend. Checked before a study touches its database."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise BackendError(f"workers must be an integer >= 1, got {workers!r}")
    if address is None and workers > cpu_cores():
        raise BackendError(f"workers must be at most the {cpu_cores()} CPU cores of this machine, got {workers:,}; "
                           "more workers only share them, and each costs hundreds of MB")
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    if name == "local" and address is not None:
        raise BackendError("--address is for the ray backend; add --backend ray")


def make_backend(name: str, workers: int, address: str | None = None) -> LocalBackend | RayBackend:
    """The backend called `name` ("local" or "ray") with `workers` parallel tasks."""
    check_backend(name, workers, address)
    return LocalBackend(workers) if name == "local" else RayBackend(workers, address)
