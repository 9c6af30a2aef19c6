"""A run folder's claim: a file that says which process trains in `<storage>/<name>/` now, so a
second `train` of the same name is refused instead of writing into the first one's files."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from pathlib import Path

import pyarrow.fs as pafs

from raytrain_lm.errors import UserError
from raytrain_lm.store import files
from raytrain_lm.store.storage import RunFolder, process_alive


class RunClaim:
    """A driver's claim on a run's (or sweep's) folder, so that two `train --name X` never run
    in one folder (their metrics would interleave, and one would delete the other's
    checkpoints). It works alike on a local disk and on object stores, which have no atomic
    create: each driver writes a claim file of its own (`.claim-<id>.json`: host, pid, time),
    then lists the claims; if any other live claim is there it withdraws its own and refuses.
    Two drivers that claim at the same moment may both refuse, never both run. A claim is
    live while its driver renews it (every HEARTBEAT_S; stale after STALE_S) and, on this
    machine, while its process exists, so a killed driver's claim does not block --resume.

    `release` removes the claim, and the folders the claim created if nothing else was written
    into them: a run refused before it started leaves nothing behind."""

    HEARTBEAT_S = 20.0
    STALE_S = 90.0

    def __init__(self, run: RunFolder):
        self.run = run
        self.file = f"{files.CLAIM_PREFIX}{uuid.uuid4().hex}.json"
        self._stop = None
        self._created: list[str] = []

    def _record(self) -> dict:
        import time

        return {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}

    def take(self) -> "RunClaim":
        import threading

        if self.run.local:  # the folders this claim creates, innermost first, to remove on release
            self._created = [str(p) for p in (Path(self.run.path), *Path(self.run.path).parents)
                             if not p.exists()]
        self.run.write_json(self.file, self._record())
        others = self.others()
        if others:
            self.release()
            who = others[0]
            raise UserError(f"{self.run.name!r} in {self.run.storage_uri} is in use by another "
                            f"driver (pid {who.get('pid')} on {who.get('host')}); wait until it "
                            f"ends, or choose another --name")
        self._stop = threading.Event()
        threading.Thread(target=self._renew, name="run-claim", daemon=True).start()
        return self

    def others(self) -> list[dict]:
        """The live claims of other drivers on the folder (stale ones found are deleted)."""
        return [c for c in live_claims(self.run) if c["file"] != self.file]

    def _renew(self) -> None:
        while not self._stop.wait(self.HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed renewal is retried next time
                self.run.write_json(self.file, self._record())

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
        with contextlib.suppress(OSError):
            self.run.fs.delete_file(f"{self.run.path}/{self.file}")
        if not self.run.local:  # an object store's folder marker, if nothing else is in it
            with contextlib.suppress(OSError):
                if not self.run.fs.get_file_info(pafs.FileSelector(self.run.path, allow_not_found=True)):
                    self.run.fs.delete_dir(self.run.path)
        for folder in self._created:  # only while empty: what the run wrote stays
            try:
                os.rmdir(folder)
            except OSError:
                break

    def __enter__(self) -> "RunClaim":
        return self.take()

    def __exit__(self, *exc) -> None:
        self.release()


def live_claims(run: RunFolder) -> list[dict]:
    """The live claims on `run`'s folder (RunClaim), each with its "file"; stale ones (not
    renewed for STALE_S, or of a process of this machine that has ended) are deleted."""
    import time

    found = []
    try:
        infos = run.fs.get_file_info(pafs.FileSelector(run.path, allow_not_found=True))
    except OSError:
        return []
    for info in infos:
        if not (info.base_name.startswith(files.CLAIM_PREFIX) and info.type == pafs.FileType.File):
            continue
        try:
            claim = run.read_json(info.base_name)
            stale = (time.time() - float(claim["time"]) > RunClaim.STALE_S or
                     claim["host"] == socket.gethostname() and not process_alive(int(claim["pid"])))
        except (UserError, OSError, KeyError, TypeError, ValueError):
            continue  # vanished while read (released), or half written: not a claim yet
        if stale:
            with contextlib.suppress(OSError):
                run.fs.delete_file(info.path)
            continue
        found.append({**claim, "file": info.base_name})
    return found
