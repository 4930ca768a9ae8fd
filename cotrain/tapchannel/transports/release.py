"""Reader side of a GPU mailbox: a slot is released only once the GPU has finished reading it.

Why. On the reader, ``read(copy=True)`` only *queues* the copy-out on the reader's current CUDA stream,
and a zero-copy view is read by kernels queued later still. Storing ``released`` (which lets a writer
overwrite the slot) as soon as the CPU returns would let a writer in another process overwrite rows
the GPU has not read yet.

Protocol. ``release(t, seq)`` records an event on the reader's current stream (after the copy-out, or,
for a zero-copy view, after whatever the caller queued on that stream before releasing it) and
publishes ``released`` only once that event has completed: at once if ``event.query()`` says so,
otherwise from one publisher thread that waits on the events in order (``synchronize()`` leaves the
GIL). The reader's CPU never stalls on its GPU, and a release is published even while the reader
blocks elsewhere, e.g. in the pipeline's own receive, which may wait for a writer that needs this
very slot (a lazy "poll before the slot is needed" could deadlock there).

Work on *other* streams that uses a zero-copy view must be ordered before the release by the caller
(e.g. ``torch.cuda.current_stream().wait_stream(side)``). A failure in the publisher (an event error,
or a slot that changed before it was released) is raised on the reader's next call.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Protocol


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeferredRelease:
    """Publishes ``release(t, seq)`` once the event recorded at the call has completed (module doc)."""

    def __init__(self, publish: Callable[[int, int], None], record: Callable[[], Event], name: str = "tapchannel"):
        self._publish = publish  # stores `released` (Mailbox.release)
        self._record = record  # records an event on the reader's current stream
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Event, int, int]] = deque()
        self._busy = 0  # queued or being waited on by the thread
        self._thread: threading.Thread | None = None
        self._closed = False
        self.error: BaseException | None = None

    @property
    def pending(self) -> int:
        """Releases recorded but not published yet."""
        with self._cond:
            return self._busy

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def release(self, t: int, seq: int) -> None:
        self.check()
        event = self._record()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name}: release after close")
            if event.query():  # the GPU is already past the read: no hand-off
                self._publish(t, seq)
                return
            self._queue.append((event, t, seq))
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}-release", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                event, t, seq = self._queue.popleft()
            try:
                event.synchronize()
                self._publish(t, seq)
            except BaseException as e:  # raised on the reader's next call
                self.error = e
                with self._cond:
                    self._queue.clear()
                    self._busy = 0
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every recorded release is published; False if ``timeout_s`` passed first."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._busy == 0, timeout=timeout_s)
        self.check()
        return done

    def close(self, timeout_s: float = 10.0) -> None:
        """Publish what is queued (bounded by ``timeout_s``), then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
