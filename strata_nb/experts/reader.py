"""Reader threads: whole expert blobs from the SSD into aligned RAM slots, bypassing the page cache.

A read is a list of extents (file offset, length), each 4 KiB aligned, copied back to back into one destination
buffer. O_DIRECT keeps the model's cold experts out of the page cache (which would otherwise evict the resident
set the memory plan counted on); where the file system refuses O_DIRECT, plain reads are used and said so.
Every read is checked: a short read, an I/O error or a file changed under us (size or mtime) fails the read with
a message naming the file, and the store turns that into an error of the run; nothing waits unboundedly.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ALIGN = 4096

# Priorities: a lower number is read first.
DEMAND, LOOKAHEAD, FILL = 0, 1, 2


@dataclass(order=True)
class ReadJob:
    priority: int
    seq: int
    extents: tuple[tuple[int, int], ...] = field(compare=False)  # (file offset, length), 4 KiB aligned
    dest: memoryview = field(compare=False)  # writable, 4 KiB aligned, at least sum of lengths
    done: Callable[["ReadJob", str | None], None] = field(compare=False)  # called once, error text or None
    nbytes: int = field(default=0, compare=False)


class BlobReader:
    """A pool of threads doing positioned reads of one file; jobs are queued by priority."""

    def __init__(self, path: str | os.PathLike, threads: int = 4, direct: bool = True):
        self.path = Path(path)
        flags = os.O_RDONLY
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT)
                self.direct = True
            except OSError:
                self.fd = os.open(self.path, flags)  # tmpfs and some network file systems refuse O_DIRECT
        else:
            self.fd = os.open(self.path, flags)
        st = os.fstat(self.fd)
        self._stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        self.size = st.st_size
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0
        self._busy = 0  # reads in progress
        self._busy_since = 0.0
        self.busy_s = 0.0  # wall time during which at least one read was in progress
        self._closed = False
        self.threads = max(1, threads)
        self._threads = [threading.Thread(target=self._run, name=f"strata-reader-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, extents, dest: memoryview, done) -> None:
        if self._closed:
            raise RuntimeError("reader closed")
        self._q.put(ReadJob(priority, next(self._seq), tuple(extents), dest, done))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._q.put(ReadJob(-1, -1, (), memoryview(b""), lambda j, e: None))
        for t in self._threads:
            t.join(timeout=5.0)
        os.close(self.fd)

    # -- the threads --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job.seq < 0:
                return
            self._account(+1)
            err = None
            try:
                self._read(job)
            except Exception as e:  # any failure becomes the job's error, never a silent thread death
                err = f"{self.path.name}: {e}"
            finally:
                self._account(-1)
            job.done(job, err)

    def _account(self, d: int) -> None:
        with self._lock:
            now = time.perf_counter()
            if self._busy == 0 and d > 0:
                self._busy_since = now
            self._busy += d
            if self._busy == 0:
                self.busy_s += now - self._busy_since

    def _read(self, job: ReadJob) -> None:
        pos = 0
        for off, length in job.extents:
            want = min(length, self.size - off)  # the last extent may run past the end of the file
            if want <= 0:
                raise OSError(f"expert read at byte {off} lies past the end of the file ({self.size} bytes)")
            got = self._read_extent(off, job.dest[pos:pos + length], want)
            if got != want:
                raise OSError(f"short read at byte {off}: {got} of {want} bytes (file truncated?)")
            pos += length
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns, st.st_ino) != self._stamp:
            raise OSError("the file changed while the model was running (size or modification time differs)")
        job.nbytes = pos
        with self._lock:
            self.bytes_read += pos
            self.reads += 1

    def _read_extent(self, off: int, dest: memoryview, want: int) -> int:
        """Read up to len(dest) bytes at off; returns the bytes read (stops at end of file)."""
        got = 0
        while got < want:
            n = os.preadv(self.fd, [dest[got:]], off + got)
            if n <= 0:
                break
            got += n
        return got
