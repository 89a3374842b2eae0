"""What a replica and the shared store exchange: a waiting request's entry, the grant of a slot,
the messages the store pushes to a replica, and the leases a replica holds.

Times sent to the store are durations (seconds); the store stamps arrivals and expiries on its
own clock (Redis ``TIME``), so replicas' clocks never need to agree.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from clairvoyant.scheduling.request import Ticket

__all__ = [
    "BackendSpec",
    "Entry",
    "HeldLease",
    "Message",
    "MessageKind",
    "Placed",
    "RenewReply",
    "ServiceObservation",
    "StoreUnavailable",
]


class StoreUnavailable(ConnectionError):
    """The shared store cannot be reached (or answered with an error a retry will not fix)."""


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One backend as every replica must name it: the same name, slots and models on each."""

    name: str
    slots: int
    models: tuple[str, ...] = ()  # the models it may run; () = any


@dataclass(frozen=True, slots=True)
class Entry:
    """One waiting request as the shared queue keeps it: metadata only, never prompt text."""

    request_id: str
    tenant: str = ""
    weight: float = 1.0  # the tenant's fair-share weight
    priority: int = 0  # band: lower goes first, strictly
    model: str = ""  # "" = any backend's default
    score: float = 0.0  # the policy's key inside a band: lower goes sooner
    predicted_s: float = 1.0  # predicted service seconds: fair share charges these
    guard_s: float = math.inf  # seconds of waiting after which it is overdue (starvation guard)
    deadline_s: float = math.inf  # seconds from now from which it must never be granted
    supersede_key: str = ""  # a digest of (tenant, X-Clairvoyant-Supersede); never the raw header


class MessageKind(enum.Enum):
    GRANT = "grant"  # a slot is this request's: backend, slot
    SUPERSEDED = "superseded"  # a newer request with its supersede key replaced it (it waited)
    ABORT = "abort"  # a newer request with its supersede key replaced it while it ran
    LEASE_LOST = "lease_lost"  # its lease expired unrenewed: stop its backend call


@dataclass(frozen=True, slots=True)
class Message:
    kind: MessageKind
    request_id: str
    backend: str = ""
    slot: int = -1


@dataclass(frozen=True, slots=True)
class HeldLease:
    """A slot this replica holds (renewed, or re-registered after the store lost its state)."""

    request_id: str
    backend: str
    slot: int


@dataclass(frozen=True, slots=True)
class RenewReply:
    lost: tuple[str, ...] = ()  # held leases the store no longer had and could not take back
    replicas: tuple[str, ...] = ()  # the live replicas, in rank order (the local fallback's share)
    reset: bool = False  # the store had lost its state: this replica's waiting entries must be sent again


@dataclass(frozen=True, slots=True)
class ServiceObservation:
    """One completed request's inputs to the service-time estimates, as ``Dispatcher._learn`` used
    them and every replica applies them (``cluster/observations.py``): metadata only."""

    model: str | None  # the backend model the request named (None: the backend's default)
    backend: str  # the backend's name (the same on every replica)
    prompt_tokens: int
    output_tokens: int  # the PREDICTED output tokens: what the fit regresses on (Dispatcher._learn says why)
    service_s: float  # the slot's seconds less any model load it paid (<= 0: nothing for the fit)
    predicted_s: float  # the seconds predicted for it (the backend's slowness compares the two)
    load_s: float | None = None  # a model load the backend reported that taught its load cost, seconds


@dataclass(frozen=True, slots=True)
class Placed:
    """Where an enqueued entry stands in the whole cluster's order (for its queue deadline's check
    and Retry-After): the entries that go before it, and their predicted seconds plus what the
    requests running now have left of theirs (0 and 0 when it was granted at once)."""

    ahead: int
    ahead_s: float


@dataclass(frozen=True, slots=True)
class WaitingView:
    request_id: str
    replica: str
    tenant: str
    priority: int
    model: str
    score: float
    predicted_s: float
    waited_s: float
    overdue: bool
    expires_in_s: float  # seconds until its queue deadline (huge: none)
    seq: int  # arrival order in the store


@dataclass(frozen=True, slots=True)
class LeaseView:
    backend: str
    slot: int
    request_id: str
    replica: str
    expires_in_s: float


@dataclass(frozen=True, slots=True)
class ReplicaView:
    replica: str
    beat_age_s: float  # seconds since its last join/renew


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The whole cluster as the store holds it: waiting entries in dispatch order (if nothing else
    arrived and every backend served every model), leases, replicas."""

    waiting: tuple[WaitingView, ...]
    leases: tuple[LeaseView, ...]
    replicas: tuple[ReplicaView, ...]
    quiet_s: float  # seconds left of a quiet period after the store lost its state (0: none)


class ClusterSide(Protocol):
    """What the dispatcher tells its replica's side of the shared queue (``cluster/replica.py``)."""

    def enqueued(self, ticket: Ticket, deadline_in_s: float) -> None:
        """``ticket`` was queued here; ``deadline_in_s``: seconds until its queue deadline (inf: none)."""

    def withdrawn(self, ticket: Ticket) -> None:
        """A waiting ticket ended without a slot (its client left, its deadline came, it was refused)."""

    def supersede_key(self, ticket: Ticket, tenant: str, key: str) -> None:
        """A queued ticket carries an X-Clairvoyant-Supersede key (told before its entry is sent)."""

    def slot_freed(self, ticket: Ticket, now: float) -> bool:
        """A granted ticket gave its slot back: True when the dispatcher may grant it again itself."""

    def pool_changed(self) -> None:
        """A backend's slot count changed (learned after start-up)."""

    def rekeyed(self, ticket: Ticket) -> None:
        """A waiting ticket's prediction was refined: its entry is sent again (an enqueue of an id
        the store holds updates it in place)."""
