"""Durable results: one folder (``--out``), a manifest, one JSON file per run, a lock, the table.

Note [Durable runs]
A run's record is written the moment it finishes (atomically: a temporary file,
then a rename), and the manifest ``manifest.json`` is rewritten after it: the
options of each section, the versions of python, torch and stiefel, the machine
(CPU model, cores, threads, workers, load average at each section's start and
end: `stiefel.comparisons.cost.machine`), start and end times, the state
(``running``, ``finished``, ``interrupted``) and the list of runs. A process
killed at any point leaves whole files only; ``--resume`` then skips every run
whose record exists for the same options, ``--out`` and ``--jobs`` aside (each
record holds its section's options: with the manifest lost, a record of other
options is run again, never reused). A lock file ``.lock`` holding the writer's
pid refuses a second writer: it appears with the pid already in it (written to a temporary file,
then linked into place), and a pid-less lock (a writer of another kind, between
creating and writing it) counts as held for `LOCK_GRACE_S`; a lock left by a
dead process is taken over. Every path written, and every path read from
``--out`` (the manifest's run files and outputs), must resolve inside
``--out``, so nothing outside it is written, deleted or read. Each finished
section rewrites the long table ``results.jsonl`` from the runs the manifest
lists (`stiefel.comparisons.table`). A damaged record (truncated, not JSON,
another shape) is skipped with a warning naming its file and line, never
failing a finished section; a damaged manifest is kept beside as
``manifest.json.damaged`` and a new one started (the records stay, and are
reused for the same options).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import platform
import re
import tempfile
import time
import warnings
from typing import Any

import torch

from .. import __version__ as version
from .cost import machine
from .table import dumps, run_rows
from .writers import write_json, write_text

__all__ = ["RunStore", "OutputLocked", "run_key", "normalize", "read_json"]

MANIFEST = "manifest.json"
DAMAGED = MANIFEST + ".damaged"  # an unreadable manifest, kept beside the new one
LOCK = ".lock"
TABLE = "results.jsonl"
#: seconds a lock without a pid counts as held (its owner may be about to write the pid)
LOCK_GRACE_S = 60.0


class OutputLocked(RuntimeError):
    """Another live process is writing the same ``--out``."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def normalize(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples as lists, paths as strings)."""
    return json.loads(json.dumps(obj, default=str))


def run_key(**fields: Any) -> str:
    """A stable key of a run from its defining fields."""
    return json.dumps(normalize(fields), sort_keys=True)


def read_json(path: pathlib.Path, what: str = "run record") -> Any:
    """The JSON of ``path``, or None with a warning naming the file and line when damaged."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        warnings.warn(f"skipping the {what} {path}: the file is missing", stacklevel=2)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError and UnicodeDecodeError
        where = f"line {exc.lineno}: {exc.msg}" if hasattr(exc, "lineno") else str(exc)
        warnings.warn(f"skipping the damaged {what} {path} ({where})", stacklevel=2)
    return None


#: options that leave the numbers alone: the folder (moved, or named another way) and the
#: worker count (runs are seeded: Note [Parallel runs]); a resume may change them
UNCOMPARED = ("out", "jobs")


def _defining(options: dict[str, Any]) -> dict[str, Any]:
    """The options that a stored run must share to be reused (all but `UNCOMPARED`)."""
    return {k: v for k, v in options.items() if k not in UNCOMPARED}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunStore:
    """The results folder of one harness process (use as a context manager).

    Args:
        out: the folder; created if missing.
        resume: continue the sections already in the manifest, skipping finished runs.
        overwrite: discard the sections this process runs again.

    Raises:
        OutputLocked: another live process holds the folder.
        OSError: the folder cannot be created or written (before any training).
    """

    def __init__(self, out: str | pathlib.Path, resume: bool = False, overwrite: bool = False):
        self.out = pathlib.Path(out)
        self.resume, self.overwrite = resume, overwrite
        self.root: pathlib.Path | None = None
        self.manifest: dict[str, Any] = {}
        self._locked = False
        self.damaged = False  # the manifest found was unreadable (kept as .damaged)
        # section → this process's machine and the stored end, while a resume has measured
        # nothing in it: its runs keep the machine that measured them (until `save_run`)
        self._pending: dict[str, dict[str, Any]] = {}

    def __enter__(self) -> RunStore:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        stopped = exc_type and issubclass(exc_type, (KeyboardInterrupt, SystemExit))
        self.close("finished" if exc_type is None else "interrupted" if stopped else "failed")

    def open(self) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self.root = self.out.resolve(strict=True)
            self._lock()
        except OutputLocked:
            raise
        except OSError as exc:
            raise OSError(f"--out {self.out} cannot be written: {exc}") from exc
        self._check_links()
        path = self.root / MANIFEST
        m = read_json(path, "manifest") if path.exists() else {}
        if not isinstance(m, dict) or not isinstance(m.get("sections", {}), dict):
            os.replace(path, self.inside(DAMAGED, "a link to"))
            note = f"{path} kept as {DAMAGED}; stored runs are reused on --resume"
            warnings.warn(note, stacklevel=2)
            m, self.damaged = {}, True
        self.manifest = m
        self.manifest.setdefault("sections", {})
        v = {"python": platform.python_version(), "torch": torch.__version__, "stiefel": version}
        self.manifest.update(
            state="running", pid=os.getpid(), started=_now(), ended=None, versions=v
        )
        self.save_manifest()

    def _check_links(self) -> None:
        """Refuse a folder holding links that lead outside it (before anything is written)."""
        for folder, dirs, files in os.walk(self.root):
            for name in dirs + files:
                p = pathlib.Path(folder, name)
                if p.is_symlink() and not p.resolve().is_relative_to(self.root):
                    self._unlock()
                    raise ValueError(
                        f"--out {self.out} holds {p}, a link to {p.resolve()} outside it; "
                        "remove the link or choose another --out (nothing is written outside --out)"
                    )

    def close(self, state: str) -> None:
        if self.root is None:
            return
        try:
            if self.manifest:
                for name, sec in self.manifest["sections"].items():
                    if sec["state"] == "running":  # a resume that measured nothing: its end
                        sec["state"] = state
                        sec["ended"] = self._pending.get(name, {}).get("ended") or _now()
                self.manifest.update(state=state, ended=_now())
                self.save_manifest()
        finally:
            self._unlock()

    def _lock(self) -> None:
        lock = self.root / LOCK
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".lock.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            for _ in range(2):
                try:
                    os.link(tmp, lock)  # atomic: the lock appears with the pid in it
                except FileExistsError:
                    self._take_over(lock)
                    continue
                self._locked = True
                return
        finally:
            os.unlink(tmp)
        raise OutputLocked(f"--out {self.out}: could not take the lock {lock}")

    def _take_over(self, lock: pathlib.Path) -> None:
        """Remove ``lock`` if its writer is dead; OutputLocked while it may be alive."""
        try:
            text, age = lock.read_text().strip(), time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        pid = int(text) if text.isdigit() else 0
        if pid and pid != os.getpid() and _alive(pid):
            held = f"pid {pid}"
        elif not pid and age < LOCK_GRACE_S:
            held = f"no pid yet, created {age:.0f} s ago"
        else:
            lock.unlink(missing_ok=True)  # a stale lock of a dead process
            return
        raise OutputLocked(
            f"--out {self.out} is being written by another process ({held}, lock file "
            f"{lock}); wait for it to end or choose another --out"
        )

    def _unlock(self) -> None:
        if self._locked:
            (self.root / LOCK).unlink(missing_ok=True)
            self._locked = False

    def path(self, rel: str) -> pathlib.Path:
        """``out/rel`` to write, refused when it (or a folder on the way) leads outside ``out``."""
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        return self.inside(rel, "a link to")

    def inside(self, rel: str, why: str = f"named in {MANIFEST}:") -> pathlib.Path:
        """``out/rel`` (a path read from ``--out``); ValueError unless it resolves inside."""
        assert self.root is not None, "RunStore is not open"
        p = self.root / rel
        if not p.resolve().is_relative_to(self.root):
            raise ValueError(
                f"refusing {rel!r} in --out {self.out}, {why} {p.resolve()}, outside --out; "
                "remove it (or the manifest), or choose another --out"
            )
        return p

    def save_manifest(self) -> None:
        write_json(self.path(MANIFEST), self.manifest)

    def begin_section(self, name: str, options: dict[str, Any]) -> dict[str, Any]:
        """Start (or resume) section ``name``; ValueError when that would mix results."""
        opts = normalize(options)
        sections = self.manifest["sections"]
        old = sections.get(name)
        if old is not None and not self.overwrite:
            if not self.resume:
                held = f"{name} results ({old['state']}, {len(old['runs'])} runs)"
                fix = "--resume to continue them, --overwrite to replace them, or another --out"
                raise ValueError(f"--out {self.out} already holds {held}: pass {fix}")
            was, now = _defining(old["options"]), _defining(opts)
            if diff := sorted(k for k in {*now, *was} if now.get(k) != was.get(k)):
                given = "; ".join(f"{k}: stored {was.get(k)!r}, given {now.get(k)!r}" for k in diff)
                raise ValueError(f"--resume: the {name} options differ from those in "
                                 f"{self.out / MANIFEST} ({given}); give the stored ones, or "
                                 "choose another --out")  # fmt: skip
            old["options"] = opts  # where it is and how many workers: this run's
        if old is not None and (self.overwrite or not self.resume):
            for path in [self.inside(run["file"]) for run in old["runs"]]:  # all checked first
                path.unlink(missing_ok=True)
            old = None
        sec = old or {"options": opts, "runs": [], "outputs": [], "skipped": []}
        current = machine(opts.get("jobs", 1)) | {"load_end": None}
        if sec["runs"] and sec.get("machine"):  # a resume: the stored times' machine stays
            self._pending[name] = {"machine": current, "ended": sec.get("ended")}
        else:
            sec["machine"] = current
        sec.update(state="running", started=sec.get("started") or _now(), ended=None)
        sections[name] = sec
        self.save_manifest()
        return sec

    def _file(self, section: str, key: str) -> str:
        slug = re.sub(r"[^A-Za-z0-9._=-]+", "_", " ".join(str(v) for v in json.loads(key).values()))
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        return f"runs/{section}/{slug[:80]}-{digest}.json"

    def load_run(self, section: str, key: str) -> dict[str, Any] | None:
        """The stored record of a finished run, or None (also for a record of another key)."""
        path = self.root / self._file(section, key)
        data = read_json(path) if path.exists() else None
        if not isinstance(data, dict):  # a damaged record is run again
            return None
        options = _defining(self.manifest["sections"][section]["options"])
        if data.get("key") != key or _defining(data.get("options") or {}) != options:
            return None
        self._list(section, key, data.get("finished"))
        return data["record"]

    def save_run(self, section: str, key: str, record: dict[str, Any]) -> None:
        """Write a finished run's record now, then list it in the manifest."""
        finished = _now()
        pending = self._pending.pop(section, None)  # measured now: this machine applies
        if pending is not None:
            self.manifest["sections"][section]["machine"] = pending["machine"]
            self.save_manifest()  # a run listed already is not listed (nor saved) again
        sec_options = self.manifest["sections"][section]["options"]
        write_json(
            self.path(self._file(section, key)),
            {"key": key, "options": sec_options, "finished": finished, "record": record},
        )
        self._list(section, key, finished)

    def _list(self, section: str, key: str, finished: str | None) -> None:
        sec = self.manifest["sections"][section]
        if any(r["key"] == key for r in sec["runs"]):
            return
        sec["runs"].append({"key": key, "file": self._file(section, key), "finished": finished})
        self.save_manifest()

    def end_section(self, name: str, outputs: list[str], skipped: list[str] = ()) -> None:
        """Mark section ``name`` finished with the files its report part uses; write the table."""
        sec = self.manifest["sections"][name]
        kept = self._pending.pop(name, None)  # a resume that measured nothing: its record
        sec.update(state="finished", outputs=list(outputs), skipped=list(skipped))
        sec["ended"] = kept["ended"] if kept and kept["ended"] else _now()
        if kept is None:
            sec.setdefault("machine", {})["load_end"] = machine()["load"]
        self.save_manifest()
        rows = []
        for section, sec in self.manifest["sections"].items():
            for run in sec["runs"]:
                data = read_json(self.inside(run["file"]))
                try:
                    rows += run_rows(section, json.loads(data["key"]), data["record"])
                except (TypeError, KeyError, ValueError) as exc:  # another shape
                    if data is not None:
                        note = f"skipping the run record {run['file']}: {exc!r}"
                        warnings.warn(note, stacklevel=2)
        write_text(self.path(TABLE), dumps(rows))
