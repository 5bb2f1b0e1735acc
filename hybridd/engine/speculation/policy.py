"""When to speculate and how far: measured, per sequence and per batch size.

Per sequence: an exponential moving average of the fraction of its draft tokens the
target accepted. Its next draft is the longest k (1 .. `max_tokens`) whose last token
is still worth scoring: with acceptance a per token, the k-th draft token is kept with
probability about a**k, and it is proposed while that stays >= `min_keep`.

Per batch size (grouped into powers of two): the moving averages of the seconds per
emitted token of steps scheduled speculating and of steps scheduled without. The
policy speculates where speculating has measured cheaper per token; a mode not yet
measured at a size is tried first, and every `probe_interval` steps at a size the
other mode is tried again for `probe_steps` steps in a row (a switch drains the
pipeline once, which a run of steps amortizes), so that a change in the load (streams
that stop repeating their prompt, more of them) is seen. The first step of each mode
at each size is not counted (it may compile or warm caches). Speculating costs a
drained pipeline (the host waits for a verify step's tokens before drafting the next)
and rows for the drafts; both are in the measured time, so a size where speculation
does not pay (many streams, little repetition) settles on plain decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def size_class(batch_size: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, ... (the next power of two)."""
    return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))


@dataclass
class _Cost:
    seconds_per_token: float | None = None

    def add(self, seconds_per_token: float, weight: float) -> None:
        old = self.seconds_per_token
        self.seconds_per_token = seconds_per_token if old is None else old + weight * (seconds_per_token - old)


class SpeculationPolicy:
    def __init__(self, max_tokens: int, smoothing: float = 0.2, min_keep: float = 0.25, probe_interval: int = 64,
                 initial_acceptance: float = 0.6, adaptive: bool = True, probe_steps: int = 4) -> None:
        """`adaptive` False: speculate at every batch size (k per sequence still adapts)."""
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.smoothing = smoothing
        self.min_keep = min_keep
        self.probe_interval = probe_interval
        self.probe_steps = probe_steps
        self.initial_acceptance = initial_acceptance
        self._acceptance: dict[str, float] = {}
        self._costs: dict[tuple[int, bool], _Cost] = {}
        self._decisions: dict[int, int] = {}
        self._seen: set[tuple[int, bool]] = set()  # (size, mode) whose first step was seen

    # ----------------------------------------------------------- per sequence
    def acceptance(self, request_id: str) -> float:
        return self._acceptance.get(request_id, self.initial_acceptance)

    def draft_length(self, request_id: str) -> int:
        a = self.acceptance(request_id)
        if a >= 1.0 or self.min_keep <= 0.0:
            return self.max_tokens
        if a <= 0.0:
            return 1
        return max(1, min(self.max_tokens, int(math.log(self.min_keep) / math.log(a))))

    def observe_draft(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed:
            old = self.acceptance(request_id)
            self._acceptance[request_id] = old + self.smoothing * (accepted / proposed - old)

    def release(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)

    # ---------------------------------------------------------- per batch size
    def speculates(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` decoding sequences is scheduled speculating (the
        same answer until `scheduled` counts a step of that size)."""
        if not self.adaptive:
            return True
        size = size_class(batch_size)
        count = self._decisions.get(size, 0)
        spec = self._costs.get((size, True), _Cost()).seconds_per_token
        plain = self._costs.get((size, False), _Cost()).seconds_per_token
        if spec is None:
            return True
        if plain is None:
            return False
        choice = spec <= plain
        return (not choice) if count % self.probe_interval < self.probe_steps else choice

    def scheduled(self, batch_size: int) -> None:
        """A step of `batch_size` decoding sequences was scheduled (the probes count steps,
        not the times a step waited for the one before it)."""
        size = size_class(batch_size)
        self._decisions[size] = self._decisions.get(size, 0) + 1

    def observe_step(self, batch_size: int, speculating: bool, seconds: float, tokens: int) -> None:
        """A decode or verify step's measured time and the tokens it gave."""
        key = (size_class(batch_size), speculating)
        if key not in self._seen:
            self._seen.add(key)
            return
        if tokens > 0 and seconds > 0:
            cost = self._costs.setdefault(key, _Cost())
            cost.add(seconds / tokens, self.smoothing)

    def snapshot(self) -> dict:
        return {f"{size}{'_speculating' if spec else '_plain'}": round(cost.seconds_per_token * 1e3, 4)
                for (size, spec), cost in sorted(self._costs.items()) if cost.seconds_per_token is not None}
