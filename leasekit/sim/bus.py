"""The notification bus between D and P workers, with programmable faults.

Each message is delivered after ``latency_s`` unless a rule says otherwise. Rules see a
:class:`Message` and return ``None`` (no opinion) or an :class:`Action`; the first rule with an
opinion wins. Randomness comes from the world's seeded RNG only, so runs are deterministic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Message:
    """A NIXL notification in flight: raw bytes from ``src`` (agent) to ``dst`` (agent)."""

    src: str
    dst: str
    payload: bytes
    sent_at_s: float
    kind: str  # "heartbeat" | "completion" | "push_reg" (push mode: to P's writer thread) | "other"
    seq: int = 0


@dataclass(frozen=True)
class Action:
    """What a fault rule does to one message: drop it silently, fail the send (the sender sees an
    error, as when NIXL ``send_notif`` raises), add ``delay_s``, or send ``copies`` of it."""

    drop: bool = False
    fail_send: bool = False
    delay_s: float = 0.0
    copies: int = 1


Rule = Callable[[Message, random.Random], Action | None]


def drop_heartbeats(predicate: Callable[[Message], bool]) -> Rule:
    """Drop every heartbeat for which ``predicate(msg)`` is true."""
    return lambda msg, rng: Action(drop=True) if msg.kind == "heartbeat" and predicate(msg) else None


def fail_sends(predicate: Callable[[Message], bool]) -> Rule:
    """Make the send of every message matching ``predicate`` fail visibly at the sender."""
    return lambda msg, rng: Action(fail_send=True) if predicate(msg) else None


def drop_fraction(kind: str, fraction: float) -> Rule:
    """Drop a random ``fraction`` of messages of ``kind``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    return lambda msg, rng: Action(drop=True) if msg.kind == kind and rng.random() < fraction else None


def delay_when(predicate: Callable[[Message], bool], delay_s: float) -> Rule:
    """Delay messages matching ``predicate`` by ``delay_s`` seconds."""
    return lambda msg, rng: Action(delay_s=delay_s) if predicate(msg) else None


def duplicate_when(predicate: Callable[[Message], bool], copies: int = 2) -> Rule:
    """Deliver ``copies`` of messages matching ``predicate``."""
    return lambda msg, rng: Action(copies=copies) if predicate(msg) else None


def reorder(kind: str, max_extra_delay_s: float) -> Rule:
    """Add a random delay in ``[0, max_extra_delay_s]`` to messages of ``kind`` (reordering them)."""
    return lambda msg, rng: Action(delay_s=rng.uniform(0, max_extra_delay_s)) if msg.kind == kind else None


@dataclass
class NotificationBus:
    """Routes messages with ``latency_s`` and fault ``rules``; counts what it did in ``stats``."""

    latency_s: float = 0.001
    rules: list[Rule] = field(default_factory=list)
    stats: dict = field(default_factory=lambda: {"sent": 0, "dropped": 0, "send_failed": 0, "duplicated": 0, "delivered": 0})

    def route(self, msg: Message, rng: random.Random) -> list[float] | None:
        """Delivery delays (seconds) for ``msg``: empty if silently dropped, several if duplicated,
        None if the send itself failed (the sender knows)."""
        self.stats["sent"] += 1
        action = next((a for a in (rule(msg, rng) for rule in self.rules) if a is not None), Action())
        if action.fail_send:
            self.stats["send_failed"] += 1
            return None
        if action.drop:
            self.stats["dropped"] += 1
            return []
        if action.copies > 1:
            self.stats["duplicated"] += action.copies - 1
        return [self.latency_s + action.delay_s] * max(1, action.copies)
