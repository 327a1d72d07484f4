"""Durable results: one folder (``--out``), a manifest, one JSON file per run, a lock.

Note [Durable runs]
A run's record is written the moment it finishes (atomically: a temporary
file, then a rename), and the manifest ``manifest.json`` is rewritten after
it: the options of each section, the versions of python, torch and stiefel,
start and end times, the state (``running``, ``finished``, ``interrupted``)
and the list of runs. A process killed at any point leaves whole files only;
``--resume`` then skips every run whose record exists for the same options.
A lock file ``.lock`` holding the writer's pid refuses a second writer; a lock
left by a dead process is taken over. Every path is checked to lie inside
``--out`` after resolving links, so nothing is written outside it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import platform
import re
from typing import Any

from .writers import write_json

__all__ = ["RunStore", "OutputLocked", "run_key", "normalize"]

MANIFEST = "manifest.json"
LOCK = ".lock"


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def versions() -> dict[str, str]:
    import torch

    from .. import __version__

    return {"python": platform.python_version(), "torch": torch.__version__, "stiefel": __version__}


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

    # ------------------------------------------------------------------ open / close
    def __enter__(self) -> RunStore:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            state = "finished"
        elif issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            state = "interrupted"
        else:
            state = "failed"
        self.close(state)

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
        if path.exists():
            self.manifest = json.loads(path.read_text())
        self.manifest.setdefault("sections", {})
        self.manifest.update(
            state="running", pid=os.getpid(), started=_now(), ended=None, versions=versions()
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
                for sec in self.manifest["sections"].values():
                    if sec["state"] == "running":
                        sec["state"] = state
                        sec["ended"] = _now()
                self.manifest.update(state=state, ended=_now())
                self.save_manifest()
        finally:
            self._unlock()

    def _lock(self) -> None:
        lock = self.root / LOCK
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(lock.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and pid != os.getpid() and _alive(pid):
                    raise OutputLocked(
                        f"--out {self.out} is being written by another process (pid {pid}, "
                        f"lock file {lock}); wait for it to end or choose another --out"
                    ) from None
                lock.unlink(missing_ok=True)  # a stale lock of a dead process
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self._locked = True
            return
        raise OutputLocked(f"--out {self.out}: could not take the lock {lock}")

    def _unlock(self) -> None:
        if self._locked:
            (self.root / LOCK).unlink(missing_ok=True)
            self._locked = False

    # ------------------------------------------------------------------ paths
    def path(self, rel: str) -> pathlib.Path:
        """``out/rel``, refused when it (or a folder on the way) leads outside ``out``."""
        assert self.root is not None, "RunStore is not open"
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        inside = p.parent.resolve()
        if p.is_symlink() or p.exists():
            inside = p.resolve()
        if not (inside == self.root or inside.is_relative_to(self.root)):
            raise ValueError(
                f"refusing to write {p}: it is a link to {inside}, outside --out {self.root}"
            )
        return p

    def save_manifest(self) -> None:
        write_json(self.path(MANIFEST), self.manifest)

    # ------------------------------------------------------------------ sections and runs
    def begin_section(self, name: str, options: dict[str, Any]) -> dict[str, Any]:
        """Start (or resume) section ``name``; ValueError when that would mix results."""
        opts = normalize(options)
        sections = self.manifest["sections"]
        old = sections.get(name)
        if old is not None and not self.overwrite:
            if not self.resume:
                raise ValueError(
                    f"--out {self.out} already holds {name} results ({old['state']}, "
                    f"{len(old['runs'])} runs): pass --resume to continue them, --overwrite "
                    "to replace them, or choose another --out"
                )
            diff = sorted(
                k for k in {*opts, *old["options"]} if opts.get(k) != old["options"].get(k)
            )
            if diff:
                raise ValueError(
                    f"--resume: the {name} options differ from those in {self.out / MANIFEST} "
                    f"for {', '.join(diff)}; resume with the same options or use another --out"
                )
        if old is not None and (self.overwrite or not self.resume):
            for run in old["runs"]:
                (self.root / run["file"]).unlink(missing_ok=True)
            old = None
        sec = old or {"options": opts, "runs": [], "outputs": [], "skipped": []}
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
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if data.get("key") != key:
            return None
        self._list(section, key, data.get("finished"))
        return data["record"]

    def save_run(self, section: str, key: str, record: dict[str, Any]) -> None:
        """Write a finished run's record now, then list it in the manifest."""
        finished = _now()
        write_json(
            self.path(self._file(section, key)),
            {"key": key, "finished": finished, "record": record},
        )
        self._list(section, key, finished)

    def _list(self, section: str, key: str, finished: str | None) -> None:
        sec = self.manifest["sections"][section]
        if any(r["key"] == key for r in sec["runs"]):
            return
        sec["runs"].append({"key": key, "file": self._file(section, key), "finished": finished})
        self.save_manifest()

    def end_section(self, name: str, outputs: list[str], skipped: list[str] = ()) -> None:
        """Mark section ``name`` finished with the files its report part uses."""
        sec = self.manifest["sections"][name]
        sec.update(state="finished", ended=_now(), outputs=list(outputs), skipped=list(skipped))
        self.save_manifest()
