"""Clairvoyant: a shortest-predicted-first scheduling proxy for serial LLM servers."""

from __future__ import annotations

__version__ = "0.2.0"
__all__ = ["__version__"]
