"""The batch job's output: a JSONL file written exactly once per record, safe to resume after any interruption.

The driver alone writes it, each line with one `write` on a file opened with O_APPEND and fsync'ed; a torn last
line (power loss mid-write) is cut off when the file is opened again, and the key (`records.key_of`) of every
line already there is remembered, so a record is never written twice.
"""

import contextlib
import fcntl
import json
import os
from pathlib import Path

from lookup_decode.engines.batch.records import key_of


class Output:
    """The output JSONL: repaired and scanned on open, appended one whole line per record, exclusively locked."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise RuntimeError(f"{self.path} is being written by another run (locked)") from None
        self.done: set[str] = set()
        self.repaired = 0                 # bytes of a torn last line cut off
        self._scan()

    def _scan(self) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):               # a line without its newline was never completed: drop it
            os.ftruncate(self.fd, end)
            self.repaired = len(data) - end
        for raw in data[:end].splitlines():
            with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):     # not ours: left as it is
                self.done.add(key_of(json.loads(raw)))

    def write(self, record: dict) -> bool:
        """Append one record (False if its key is already in the file: never written twice)."""
        key = key_of(record)
        if key in self.done:
            return False
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        written = 0
        while written < len(data):        # one write for any sane line; a short write is completed
            written += os.write(self.fd, data[written:])
        os.fsync(self.fd)
        self.done.add(key)
        return True

    def close(self) -> None:
        os.close(self.fd)
