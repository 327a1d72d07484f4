"""The training grid of a section: every task × strategy × dtype × seed, run durably.

Every combination is checked before the first run (task options, strategy
names and options); one that cannot run (the LSTM baseline on a matrix task)
is reported, never dropped silently; each finished run is stored at once
(`stiefel.comparisons.store`), and a resumed grid skips stored runs.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from . import task as tasks_mod
from .config import task_lr, task_options_for
from .runner import RunConfig, check_optimizer, parse_strategy, run, unsupported
from .store import RunStore, run_key
from .strategies import parse
from .writers import Progress

__all__ = ["plan", "run_grid"]


def plan(opts: dict[str, Any], build: bool = False) -> tuple[list[RunConfig], list[str]]:
    """The runs of ``opts`` and the combinations that cannot run (with the reason); ValueError
    for an unknown name, a bad task option, or a task no strategy can run on. ``build`` (the
    CLI, once before any section trains) also builds each map and optimizer (`check_optimizer`)."""
    strategies = [parse_strategy(s) for s in opts["strategies"]]
    others = parse("none+" + opts["others"])  # the optimizer of the other weights parses
    if build:
        check_optimizer(others, None)
    jobs, skipped = [], []
    shared = {k: opts.get(k) for k in ("steps", "device", "record_every", "others", "lr")}
    for task in opts["tasks"]:
        cls = tasks_mod.get(task)
        topts = task_options_for(task, opts)
        instance = tasks_mod.make(task, torch.float32, torch.device("cpu"), 0, **topts)
        runnable, reasons = [], []
        for s in strategies:
            reason = unsupported(s, cls)
            if reason is None:
                try:
                    instance.check_method(s.method, s.method_options)
                    if build and s.method not in cls.extra_methods:
                        instance.build(s.method, s.method_options)
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"strategy {s.name!r} on task {task!r}: {exc}") from exc
                if build:
                    check_optimizer(s, shared["lr"] or task_lr(task, s.optimizer))
                runnable.append(s)
            else:
                skipped.append(f"{s.name} on {task}: {reason}")
                reasons.append(f"{s.name}: {reason}")
        if not runnable:
            raise ValueError(
                f"task {task!r} is of kind {cls.kind!r} and every strategy given cannot run on it "
                f"({'; '.join(reasons)}); add a METHOD+OPTIMIZER strategy such as cwy+adam"
            )
        for s in runnable:
            for dtype in opts["dtypes"]:
                if s.method in cls.extra_methods and dtype.startswith("complex"):
                    text = cls.extra_methods[s.method]  # a task-built model is real
                    skipped.append(f"{s.name} on {task} [{dtype}]: {text} is real")
                    continue
                kw = shared | {"lr": task_lr(task, s.optimizer)} if shared["lr"] is None else shared
                jobs += [RunConfig(task, s.name, seed, dtype=dtype, task_options=topts, **kw)
                         for seed in range(opts["seeds"])]  # fmt: skip
    return jobs, skipped


def _key(job: RunConfig) -> str:
    return run_key(task=job.task, strategy=job.strategy, dtype=job.dtype, seed=job.seed)


def _name(j: RunConfig) -> str:
    return f"{j.task} {j.strategy} {j.dtype} seed {j.seed}"


def run_grid(store: RunStore, section: str, opts: dict[str, Any]) -> tuple[list[dict], list[str]]:
    """Run (or resume) the grid of ``opts`` into ``store``; return all records and the skipped."""
    jobs, skipped = plan(opts)
    for line in skipped:
        print(f"not run: {line}", flush=True)
    store.begin_section(section, opts)
    records: list[dict | None] = [store.load_run(section, _key(j)) for j in jobs]
    todo = [i for i, r in enumerate(records) if r is None]
    if len(todo) < len(jobs):
        print(f"{section}: {len(jobs) - len(todo)} of {len(jobs)} runs already done", flush=True)
    bar = Progress(sum(jobs[i].steps for i in todo), section, "steps")  # runs differ in length
    try:
        if opts.get("jobs", 1) > 1 and len(todo) > 1:
            _run_parallel(store, section, jobs, todo, records, opts, bar)
        else:
            for i in todo:
                records[i] = run(jobs[i], bar)
                store.save_run(section, _key(jobs[i]), records[i])
                bar.finished(_name(jobs[i]), jobs[i].steps - records[i]["step"][-1] - 1)  # diverged
    finally:
        bar.close()
    return records, skipped  # type: ignore[return-value]


def _worker(imports: list[str], threads: int, parent: int) -> None:
    """A worker's start: its watch of the harness, its torch threads, the task modules.

    Note [Workers end with the harness]
    A harness stopped by SIGKILL (or the kernel's OOM killer) cannot shut its pool
    down, and a worker waiting for its next run holds the queue's pipe open itself:
    it never sees the end of it and would wait for work forever, one idle process
    per job left on the machine. Each worker watches the harness (its pid, passed in)
    from its start and exits when it is gone.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    torch.set_num_threads(threads)
    tasks_mod.import_modules(imports)


def _run_parallel(store, section, jobs, todo, records, opts, bar) -> None:
    """Note [Parallel runs]

    Runs are independent and seeded, so ``jobs=k`` spreads them over k worker
    processes of ``--threads`` torch threads each (default 1: small models use
    one core badly with more, and one thread lets the CPU clock count the work);
    each imports the run's ``imports`` (the modules that register its tasks).
    Each record is stored as it arrives.
    """
    import concurrent.futures as cf
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # no fork of a process that holds torch threads
    start = (opts.get("imports") or [], torch.get_num_threads(), os.getpid())
    pool = cf.ProcessPoolExecutor(opts["jobs"], mp_context=ctx, initializer=_worker, initargs=start)
    try:
        futures = {pool.submit(run, jobs[i], None): i for i in todo}
        for fut in cf.as_completed(futures):
            i = futures[fut]
            records[i] = fut.result()
            store.save_run(section, _key(jobs[i]), records[i])
            bar.finished(_name(jobs[i]), jobs[i].steps)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
