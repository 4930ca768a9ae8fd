"""What a TapChannel measures, per rank.

- bytes per microbatch: on the reader, the payload of every tap it read for that microbatch,
  ``tokens x sum of tap widths x element size`` (each feature counted once, local taps included);
  ``moved_bytes`` counts only what crossed a transport (local taps are read in place).
- write time per source: on writers, the wall time of ``write`` per tap layer (copy + stamp, or
  posting the send), with the part spent waiting for a free slot (back-pressure) split out.
- reader wait time per step: on the reader, the time ``read`` spent waiting for stamps, summed per
  training step (``begin_step`` .. ``end_step``), next to the time spent copying out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class StepStats:
    step: int
    reader_wait_s: float = 0.0
    reader_copy_s: float = 0.0
    microbatches_read: int = 0
    bytes_read: int = 0
    moved_bytes: int = 0
    write_s: float = 0.0
    backpressure_s: float = 0.0
    writes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TapMetrics:
    bytes_per_microbatch: dict[int, int] = field(default_factory=dict)  # seq -> bytes (reader)
    write_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # layer -> seconds
    backpressure_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    writes: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    written_bytes: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    steps: list[StepStats] = field(default_factory=list)
    _current: StepStats | None = None

    def begin_step(self, step: int) -> None:
        self._current = StepStats(step)

    def end_step(self) -> dict:
        cur = self._current or StepStats(len(self.steps))
        self.steps.append(cur)
        self._current = None
        return cur.as_dict()

    def _step(self) -> StepStats:
        if self._current is None:
            self._current = StepStats(len(self.steps))
        return self._current

    def record_write(self, layer: int, nbytes: int, seconds: float, backpressure_s: float = 0.0) -> None:
        self.write_s[layer] += seconds
        self.backpressure_s[layer] += backpressure_s
        self.writes[layer] += 1
        self.written_bytes[layer] += nbytes
        st = self._step()
        st.write_s += seconds
        st.backpressure_s += backpressure_s
        st.writes += 1

    def record_read(self, seq: int, nbytes: int, moved: int, wait_s: float, copy_s: float) -> None:
        self.bytes_per_microbatch[seq] = nbytes
        st = self._step()
        st.reader_wait_s += wait_s
        st.reader_copy_s += copy_s
        st.microbatches_read += 1
        st.bytes_read += nbytes
        st.moved_bytes += moved

    def summary(self) -> dict:
        per_mb = list(self.bytes_per_microbatch.values())
        return {
            "bytes_per_microbatch": per_mb,
            "mean_bytes_per_microbatch": sum(per_mb) / len(per_mb) if per_mb else 0.0,
            "write_s_per_source": {l: self.write_s[l] / self.writes[l] for l in sorted(self.writes)},
            "backpressure_s_per_source": {l: self.backpressure_s[l] / self.writes[l] for l in sorted(self.writes)},
            "writes_per_source": dict(sorted(self.writes.items())),
            "reader_wait_s_per_step": [s.reader_wait_s for s in self.steps],
            "reader_copy_s_per_step": [s.reader_copy_s for s in self.steps],
            "steps": [s.as_dict() for s in self.steps],
        }
