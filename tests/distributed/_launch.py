"""Run a function on ``world`` gloo processes (CPU) with a hang detector: CI never hangs.

Each rank runs ``fn(rank, world, *args)`` after ``init_process_group``; a rank that
raises writes its traceback to ``out/error_rank<r>.txt`` and the launcher raises it.

Note [A hang is a stall, not a slow run]
A fixed wall-clock limit cannot tell a hang from a busy machine: with the load at
10–16 on 2 cores every multi-process test ran past a fixed 240 s and failed. A hung
run is one in which no rank does any work: ranks blocked in a collective that will
never complete (a dead or diverged peer) or in a deadlock sleep in the kernel and
use almost no CPU time (their background threads wake now and then: one clock tick,
10 ms, every few seconds, measured on idle ranks). So the launcher reads the ranks'
CPU time (``/proc/<pid>/stat``) and stops them when, for ``stall`` seconds, it has
grown by no more than ``IDLE_SHARE`` of that time per rank and one tick; a slow run
on a loaded machine keeps using far more (a rank on 2 cores at load 16 gets about
12 % of a core). Counting any tick as work, the detector missed a 5 s stall for
minutes when the idle wake-ups fell into every window (180 s in CI). A busy
loop that never ends is caught by the overall ``timeout``, set generously. Where
``/proc`` is missing the overall timeout alone applies.

Note [A rank killed by a signal]
A rank can die by a signal after every rank joined, with no Python exception to
write: CI once saw rank 1 of a world-2 run end in SIGABRT with nothing else
reported, and twenty runs of the same launches here, some beside three busy
processes, did not repeat it. The C++ side of torch.distributed (gloo's transport
threads, for one) can end a process by ``std::terminate`` on an error it cannot
hand to Python, so the cause is only in what the rank printed. Each rank sends its
stderr (fd 2, where libstdc++ prints the ``what()`` of such an error) to
``out/stderr_rank<r>.txt`` and arms ``faulthandler`` there (the Python stack of
every thread at the signal); a signal death is reported with the tail of those
files. Such a run is started once more: a failure that repeats is raised with
both reports; one that does not passes with a warning carrying the first report,
so it stays visible in the test summary without failing the suite on a fault the
test does not check (the second run checks every value as the first would).

Note [Nothing of a run outlives its process group]
The second such death in CI printed "terminate called without an active exception"
(rank 1 of the DDP test, then launched apart in tests/optimizers): a C++ thread
object destroyed while its thread still ran. 150 runs of that worker here did not
repeat it, so the cause is read from the message. A gloo process group owns
threads that its destructor joins, and it is destroyed when its last reference
goes, not by ``destroy_process_group``, which only unregisters it. A DDP reducer,
an FSDP module, a device mesh or a DTensor kept alive by a local name or by a
reference cycle (modules with hooks form cycles) holds the group past that call,
to the interpreter's finalization, where tearing it down can end in
``std::terminate``. So a worker lets go of everything of its run and collects the
cycles (``gc.collect()``) before it destroys the group, while the interpreter is
whole; the DDP test now runs through this launcher.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import pathlib
import signal
import socket
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

# A collective may wait this long for a peer; the stall detector stops a real hang first.
COLLECTIVE_TIMEOUT = 600
# The ranks idle for this long: the run is hung.
STALL = 90.0
# CPU time per rank and second that still counts as idle (Note [A hang is a stall,
# not a slow run]): five times the wake-ups of a waiting rank, a tenth of a loaded one
IDLE_SHARE = 0.01


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, out: str, args: tuple) -> None:
    # Note [A rank killed by a signal]: what a dying rank prints goes to a file
    err = open(pathlib.Path(out, f"stderr_rank{rank}.txt"), "w")  # noqa: SIM115 (lives with the process)
    os.dup2(err.fileno(), 2)
    faulthandler.enable(file=err, all_threads=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        # a dead peer fails the others; generous, since a peer may be descheduled for
        # long on a loaded machine (Note [A hang is a stall, not a slow run])
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT),
    )
    pathlib.Path(out, f"joined_rank{rank}").touch()
    try:
        fn(rank, world, out, *args)
    except BaseException:
        pathlib.Path(out, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        gc.collect()  # Note [Nothing of a run outlives its process group]
        dist.destroy_process_group()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (all its threads), or None without /proc."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # after the command name: state is field 3 of stat(5), utime and stime fields 14, 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Watch:
    """Tells a stalled run (the ranks idle for ``stall`` s) from a slow one."""

    def __init__(self, pids: list[int], stall: float):
        self.pids, self.stall = pids, stall
        self.last, self.since = None, time.monotonic()

    def stalled(self) -> bool:
        used = [cpu_seconds(pid) for pid in self.pids]
        if any(u is None for u in used):
            return False  # no /proc, or a rank already gone: the join reports it
        total, now = sum(used), time.monotonic()
        idle = IDLE_SHARE * len(self.pids) * (now - self.since) + 0.01  # and one tick
        if self.last is None or total > self.last + idle:
            self.last, self.since = total, now
        return now - self.since > self.stall


class _StartFailed(RuntimeError):
    """A rank died before every rank had joined the process group."""


class _Killed(RuntimeError):
    """A rank died by a signal after every rank joined (Note [A rank killed by a signal])."""


def _stderr_tails(out: str, limit: int = 4000) -> str:
    """The last ``limit`` characters of each rank's stderr file that is not empty."""
    parts = []
    for path in sorted(pathlib.Path(out).glob("stderr_rank*.txt")):
        text = path.read_text(errors="replace").strip()
        if text:
            parts.append(f"--- {path.name} ---\n{text[-limit:]}")
    return "\n".join(parts)


def _launch_once(fn, world: int, out: str, args: tuple, timeout: float, stall: float) -> None:
    for pattern in ("joined_rank*", "error_rank*.txt", "stderr_rank*.txt"):
        for stale in pathlib.Path(out).glob(pattern):
            stale.unlink()
    ctx = mp.start_processes(
        _entry,
        args=(fn, world, free_port(), out, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    watch = _Watch([p.pid for p in ctx.processes], stall)
    try:
        while not ctx.join(timeout=1.0):
            if watch.stalled():
                raise TimeoutError(
                    f"{fn.__name__} on {world} processes: no rank used any CPU time for "
                    f"{stall} s (a hang)"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} on {world} processes ran over {timeout} s")
    except ProcessException as exc:
        if len(list(pathlib.Path(out).glob("joined_rank*"))) < world:
            raise _StartFailed(f"{fn.__name__} on {world} processes: {exc}") from exc
        errors = sorted(pathlib.Path(out).glob("error_rank*.txt"))
        detail = "\n".join(e.read_text() for e in errors)
        # a rank killed by a signal makes its peers raise (a closed connection): the
        # signal is the cause, whichever exit the join met first. SIGTERM and SIGKILL
        # are the clean-up of the others by torch's join and by this launcher.
        killed = [
            f"rank {rank}: {signal.Signals(-p.exitcode).name}"
            for rank, p in enumerate(ctx.processes)
            if p.exitcode is not None
            and p.exitcode < 0
            and -p.exitcode not in (signal.SIGTERM, signal.SIGKILL)
        ]
        if killed:
            raise _Killed(
                f"{fn.__name__} on {world} processes, killed: {', '.join(killed)}\n"
                f"{_stderr_tails(out)}\n{detail}"
            ) from exc
        raise RuntimeError(f"{fn.__name__} failed on {world} processes:\n{detail or exc}") from exc
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def launch(
    fn,
    world: int,
    out,
    *args,
    timeout: float = 1800.0,
    stall: float = STALL,
    attempts: int = 3,
) -> None:
    """Run ``fn(rank, world, out, *args)`` on ``world`` processes; raise on error or hang.

    The run is stopped as hung when no rank used CPU time for ``stall`` seconds, or
    when it runs over ``timeout`` (Note [A hang is a stall, not a slow run]).

    A launch whose ranks die before all of them joined the process group (the port
    from `free_port` taken by another process before rank 0 bound it, which ended
    in a SIGABRT inside gloo once in CI) is tried again on a new port, up to
    ``attempts`` times. A rank killed by a signal after joining is reported with its
    stderr and tried once more (Note [A rank killed by a signal]); a failure of
    ``fn`` itself (a Python exception) is raised at once.
    """
    out = str(out)
    killed: _Killed | None = None
    for attempt in range(1, attempts + 1):
        try:
            _launch_once(fn, world, out, args, timeout, stall)
        except _StartFailed:
            if attempt == attempts:
                raise
            continue
        except _Killed as exc:
            if killed is not None:
                raise RuntimeError(f"killed twice:\n{killed}\n--- and again ---\n{exc}") from exc
            killed = exc
            continue
        if killed is not None:
            warnings.warn(f"a rank was killed, the run again passed:\n{killed}", stacklevel=2)
        return
    if killed is not None:
        raise killed


def hello_worker(rank: int, world: int, out: str) -> None:
    """The smallest worker: an all-reduce, its result written to ``out/hello_rank<r>.txt``."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    pathlib.Path(out, f"hello_rank{rank}.txt").write_text(str(int(t.item())))


def sleeping_worker(rank: int, world: int, out: str) -> None:
    """A worker that hangs without using CPU time (rank 0 never joins the barrier)."""
    if rank == 0:
        time.sleep(3600)
    dist.barrier()


def raising_worker(rank: int, world: int, out: str) -> None:
    """A worker that fails after joining: the launcher raises its error without a retry."""
    raise ValueError(f"boom on rank {rank}")


def aborting_worker(rank: int, world: int, out: str, always: bool) -> None:
    """Rank 1 ends in SIGABRT, as a C++ ``std::terminate`` would: on the first run only,
    or on every run (``always``)."""
    first = pathlib.Path(out, "aborted_once")
    if rank == 1 and (always or not first.exists()):
        first.touch()
        print("the worker's own last words", file=sys.stderr, flush=True)
        os.abort()
    dist.barrier()
