"""The closed loop: what the backend produced for each completed request goes to the metrics and,
with ``online_learning`` on, to the online learner.

``UsageRecorder`` is the relay's ``on_usage`` hook. It runs on the event loop once per completed
scheduled request and does O(1) work: a counter, a histogram, and the learner's ``observe`` (which
only appends to a bounded buffer; refits run in the learner's own thread).

The learner learns only from ``Usage`` records, which the relay reads from the BACKEND's answer:
nothing a client sends (the request body, its proxy field, its headers) can reach it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from clairvoyant.metrics import Metrics
from clairvoyant.usage import Usage

if TYPE_CHECKING:
    from clairvoyant.dispatcher import Ticket

__all__ = ["UsageRecorder"]

logger = logging.getLogger(__name__)


class UsageRecorder:
    """Counts each completed request's usage and feeds the learner (``learner=None``: metrics only)."""

    def __init__(self, metrics: Metrics, learner: object | None = None) -> None:
        self.metrics = metrics
        self.learner = learner

    def __call__(self, ticket: Ticket, usage: Usage) -> None:
        self.metrics.count_usage(usage.source, usage.output_tokens)
