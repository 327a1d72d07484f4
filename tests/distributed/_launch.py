"""Run a function on ``world`` gloo processes (CPU) with a hard timeout: CI never hangs.

Each rank runs ``fn(rank, world, *args)`` after ``init_process_group``; a rank that
raises writes its traceback to ``out/error_rank<r>.txt`` and the launcher raises it.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, out: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),  # a dead peer fails the others, never hangs
    )
    pathlib.Path(out, f"joined_rank{rank}").touch()
    try:
        fn(rank, world, out, *args)
    except BaseException:
        pathlib.Path(out, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


class _StartFailed(RuntimeError):
    """A rank died before every rank had joined the process group."""


def _launch_once(fn, world: int, out: str, args: tuple, timeout: float) -> None:
    for marker in pathlib.Path(out).glob("joined_rank*"):
        marker.unlink()
    ctx = mp.start_processes(
        _entry,
        args=(fn, world, free_port(), out, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} on {world} processes ran over {timeout} s")
    except ProcessException as exc:
        if len(list(pathlib.Path(out).glob("joined_rank*"))) < world:
            raise _StartFailed(f"{fn.__name__} on {world} processes: {exc}") from exc
        errors = sorted(pathlib.Path(out).glob("error_rank*.txt"))
        detail = "\n".join(e.read_text() for e in errors) or str(exc)
        raise RuntimeError(f"{fn.__name__} failed on {world} processes:\n{detail}") from exc
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def launch(fn, world: int, out, *args, timeout: float = 80.0, attempts: int = 3) -> None:
    """Run ``fn(rank, world, out, *args)`` on ``world`` processes; raise on error or timeout.

    A launch whose ranks die before all of them joined the process group (the port
    from `free_port` taken by another process before rank 0 bound it, which ended
    in a SIGABRT inside gloo once in CI) is tried again on a new port, up to
    ``attempts`` times; a failure of ``fn`` itself is raised at once.
    """
    out = str(out)
    for attempt in range(1, attempts + 1):
        try:
            _launch_once(fn, world, out, args, timeout)
            return
        except _StartFailed:
            if attempt == attempts:
                raise


def hello_worker(rank: int, world: int, out: str) -> None:
    """The smallest worker: an all-reduce, its result written to ``out/hello_rank<r>.txt``."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    pathlib.Path(out, f"hello_rank{rank}.txt").write_text(str(int(t.item())))


def raising_worker(rank: int, world: int, out: str) -> None:
    """A worker that fails after joining: the launcher raises its error without a retry."""
    raise ValueError(f"boom on rank {rank}")
