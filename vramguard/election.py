"""Leader election among extender replicas: the pure decisions over one ``coordination.k8s.io/v1`` Lease.

The semantics are client-go's ``leaderelection``: a candidate takes the Lease only after it has seen
the same record, unchanged, for ``leaseDurationSeconds`` of its *own* clock (the holder's
``renewTime`` is never compared with the local clock, so clocks need not be synchronised); a leader
that has not renewed for ``renew_deadline`` stops leading, which is before anyone else may take the
Lease (``renew_deadline < lease_duration``). Writes carry the ``resourceVersion`` read, so two
candidates racing for an expired Lease cannot both win (the API server answers the loser 409).

A newly leading replica that took the Lease over from another holder (one that did not release it)
waits :attr:`ElectionTimings.takeover_grace` before serving, see :func:`serve_after`.

Pure: times are seconds of a monotonic clock passed in by the caller.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Action", "ElectionTimings", "LeaderRecord", "decide", "parse_record", "serve_after", "still_leading"]


@dataclass(frozen=True, slots=True)
class ElectionTimings:
    """client-go's defaults: 15 s / 10 s / 2 s; validated on construction."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    takeover_grace: float | None = None
    """Seconds a replica that took the Lease over from another holder waits before serving; ``None``:
    ``lease_duration``."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period} / {self.renew_deadline} / {self.lease_duration}"
            )
        if self.takeover_grace is not None and self.takeover_grace < 0:
            raise ValueError(f"takeover grace must not be negative, got {self.takeover_grace}")

    @property
    def grace(self) -> float:
        """The takeover grace in force."""
        return self.lease_duration if self.takeover_grace is None else self.takeover_grace


@dataclass(frozen=True, slots=True)
class LeaderRecord:
    """What the election reads of the Lease: its holder, duration, transitions and version."""

    holder: str
    """``""`` when nobody holds it (released, or never held)."""
    duration: float | None
    """``leaseDurationSeconds``; ``None`` when absent or not a positive integer."""
    transitions: int
    resource_version: str


def parse_record(obj: Mapping[str, Any]) -> LeaderRecord:
    """Read a Lease object (JSON-decoded). Never raises: junk fields read as absent."""
    metadata = obj.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    spec = obj.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    holder = spec.get("holderIdentity")
    duration = spec.get("leaseDurationSeconds")
    if not isinstance(duration, int) or isinstance(duration, bool) or duration <= 0:
        duration = None
    transitions = spec.get("leaseTransitions")
    if not isinstance(transitions, int) or isinstance(transitions, bool) or transitions < 0:
        transitions = 0
    version = metadata.get("resourceVersion")
    return LeaderRecord(
        holder if isinstance(holder, str) else "",
        float(duration) if duration is not None else None,
        transitions,
        version if isinstance(version, str) else "",
    )


class Action(enum.Enum):
    """What a candidate does with the Lease it read."""

    RENEW = "renew"
    """It holds the Lease: write a new ``renewTime``."""
    TAKE = "take"
    """Nobody holds it (released or never held): take it and serve once synced."""
    TAKE_OVER = "take-over"
    """Another holder let it expire: take it, and serve only after the takeover grace."""
    WAIT = "wait"
    """Another holder's Lease is still valid."""


def decide(
    record: LeaderRecord, me: str, observed_at: float, now: float, timings: ElectionTimings
) -> Action:
    """What ``me`` does at ``now`` with ``record``, first seen unchanged at ``observed_at``.

    The record's own ``leaseDurationSeconds`` counts when it has one (a released Lease says 1 s);
    otherwise ``timings.lease_duration``.
    """
    if record.holder == me:
        return Action.RENEW
    if not record.holder:
        return Action.TAKE
    duration = record.duration if record.duration is not None else timings.lease_duration
    if now < observed_at + duration:
        return Action.WAIT
    return Action.TAKE_OVER


def still_leading(last_renewed: float | None, now: float, timings: ElectionTimings) -> bool:
    """Whether a leader whose last successful write started at ``last_renewed`` may still lead.

    The write's *start* counts (not its answer), so a slow API server shortens leadership instead
    of extending it past what the other candidates assume.
    """
    return last_renewed is not None and now - last_renewed < timings.renew_deadline


def serve_after(action: Action, acquired_at: float, timings: ElectionTimings) -> float:
    """When a replica that acquired the Lease at ``acquired_at`` by ``action`` starts serving verbs.

    After a takeover, the previous leader may have Bindings still on their way: it stopped issuing
    them at least ``lease_duration - renew_deadline`` before this replica could take the Lease, and
    the grace gives those Bindings time to be committed and reach this replica's pod watch before it
    places anything itself (a released Lease needs none: its holder drained before releasing it).
    """
    if action is Action.TAKE_OVER:
        return acquired_at + timings.grace
    return acquired_at
