"""The engine thread and its bounded queue: requests run one sequence at a time, each exactly as it would alone."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from strata_nb.errors import StrataError
from strata_nb.model.textstream import TextStream
from strata_nb.runtime.sampler import SamplerConfig
from strata_nb.serve.conversations import Runner, Turn
from strata_nb.serve.metrics import Metrics


class QueueFull(StrataError):
    """Every queue place is taken: the client should retry later."""


@dataclass
class Job:
    """One request for the engine. emit(kind, value) is called from the engine thread: ("text", str) pieces, then
    one ("done", Turn) or ("error", str). Setting cancel stops the job, queued or running, at its next token."""

    prompt: list[int]
    max_new: int
    sampler: SamplerConfig
    emit: Callable[[str, object], None]
    stop: list[str] = field(default_factory=list)
    boundary: int | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    stopped_by_string: bool = False


class Scheduler:
    """Runs jobs in arrival order on one thread (the only one that touches the engine)."""

    def __init__(self, runner: Runner, metrics: Metrics, max_queue: int = 16):
        if max_queue < 1:
            raise StrataError(f"--max-queue must be >= 1, got {max_queue}")
        self.runner = runner
        self.metrics = metrics
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._current: Job | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="strata-nb-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return int(self._current is not None)

    @property
    def queued(self) -> int:
        return self._q.qsize()

    def submit(self, job: Job) -> None:
        if self._closing.is_set():
            raise QueueFull("the server is shutting down")
        try:
            self._q.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"all {self._q.maxsize} queue places are taken") from None

    def _work(self) -> None:
        while not self._closing.is_set():
            try:
                job = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            if job is None:
                break
            if job.cancel.is_set():
                self.metrics.request("cancelled")
                continue
            self._current = job
            try:
                turn = self._run(job)
            except Exception as e:  # noqa: BLE001 -- the client hears of it; the engine thread keeps serving
                self.metrics.request("error")
                job.emit("error", str(e) if isinstance(e, StrataError) else f"internal error: {type(e).__name__}: {e}")
            else:
                self.metrics.turn(turn)
                self.metrics.request("cancelled" if job.cancel.is_set() else "ok")
                job.emit("done", turn)
            finally:
                self._current = None

    def _run(self, job: Job) -> Turn:
        text = TextStream(self.runner.engine.tokenizer, job.stop)

        def on_token(t: int) -> bool:
            piece = text.push(t)
            if piece:
                job.emit("text", piece)
            return text.stopped or job.cancel.is_set()

        turn = self.runner.run(job.prompt, job.max_new, job.sampler, on_token=on_token, boundary=job.boundary)
        tail = text.flush()
        if tail:
            job.emit("text", tail)
        job.stopped_by_string = text.stopped
        return turn

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel what is queued and running, and wait (bounded) for the engine thread to finish."""
        self._closing.set()
        current = self._current
        if current is not None:
            current.cancel.set()
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.emit("error", "the server is shutting down")
        self._thread.join(timeout_s)
