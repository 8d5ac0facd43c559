"""The server's counters and histograms, rendered in Prometheus' text format (no client library needed).

Names (all prefixed ``numatp_``): ``requests_total{finish_reason=...}`` (requests that ended: stop,
length, cancelled, error), ``requests_rejected_total{reason=...}`` (429 and 4xx before the engine),
``prompt_tokens_total``, ``generated_tokens_total``, ``time_to_first_token_seconds`` and
``inter_token_latency_seconds`` (histograms, measured on the engine thread from a request's arrival),
``batch_occupancy`` (histogram of the slots in use at each decode step), ``active_slots``, ``max_slots`` and
``queue_length`` (gauges read at scrape time).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

__all__ = ["Histogram", "Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """A cumulative Prometheus histogram over fixed upper bounds."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, help_: str) -> list[str]:
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        total = 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {total}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return lines


class Metrics:
    """Updated by the engine thread and the HTTP handlers (one lock); :meth:`render` gives the text page."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finish: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.prompt = 0
        self.generated = 0
        self.ttft = Histogram(_LATENCY_BUCKETS)
        self.itl = Histogram(_LATENCY_BUCKETS)
        self.occupied: Histogram | None = None
        self.gauges: dict[str, Callable[[], float]] = {}

    def prompt_tokens(self, n: int) -> None:
        with self._lock:
            self.prompt += n

    def generated_tokens(self, n: int) -> None:
        with self._lock:
            self.generated += n

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def occupancy(self, used: int, slots: int) -> None:
        with self._lock:
            if self.occupied is None:
                self.occupied = Histogram(tuple(float(i) for i in range(1, slots + 1)))
            self.occupied.observe(used)

    def finished(self, reason: str) -> None:
        with self._lock:
            self.finish[reason] = self.finish.get(reason, 0) + 1

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def render(self) -> str:
        with self._lock:
            out = ["# HELP numatp_requests_total Requests that ended, by finish reason.",
                   "# TYPE numatp_requests_total counter"]
            out += [f'numatp_requests_total{{finish_reason="{k}"}} {v}' for k, v in sorted(self.finish.items())]
            out += ["# HELP numatp_requests_rejected_total Requests refused before generating (429, 4xx).",
                    "# TYPE numatp_requests_rejected_total counter"]
            out += [f'numatp_requests_rejected_total{{reason="{k}"}} {v}' for k, v in sorted(self.rejected.items())]
            out += ["# HELP numatp_prompt_tokens_total Prompt tokens prefilled.",
                    "# TYPE numatp_prompt_tokens_total counter", f"numatp_prompt_tokens_total {self.prompt}",
                    "# HELP numatp_generated_tokens_total Tokens generated.",
                    "# TYPE numatp_generated_tokens_total counter",
                    f"numatp_generated_tokens_total {self.generated}"]
            out += self.ttft.render("numatp_time_to_first_token_seconds",
                                    "From a request's arrival at the engine to its first token.")
            out += self.itl.render("numatp_inter_token_latency_seconds", "Between a request's consecutive tokens.")
            if self.occupied is not None:
                out += self.occupied.render("numatp_batch_occupancy", "Slots in use at each decode step.")
            for name, read in sorted(self.gauges.items()):
                out += [f"# TYPE numatp_{name} gauge", f"numatp_{name} {read():g}"]
        return "\n".join(out) + "\n"
