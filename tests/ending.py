"""Ending a ticket the dispatcher granted or queued, for tests that drive tickets by hand instead of
holding each in ``Dispatcher.lease`` (the serving path's one way in)."""

from __future__ import annotations

from clairvoyant.prediction.usage import Usage
from clairvoyant.scheduling.dispatcher import Dispatcher, Lease, Ticket


def end(dispatcher: Dispatcher, ticket: Ticket, *, completed: bool = False, usage: Usage | None = None) -> None:
    """What leaving ``lease`` does: withdraw the ticket if it still waits, else give its slot back
    (``completed``: its answer ended normally; only those teach the service-time model)."""
    dispatcher._end(ticket, Lease(ticket, completed, usage) if completed or usage is not None else None)
