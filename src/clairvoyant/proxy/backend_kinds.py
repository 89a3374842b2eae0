"""The kinds of backend (llama.cpp's server, Ollama, vLLM, any OpenAI-compatible server), each
one object that says what the proxy needs to know of it; ``auto`` stands for one not asked yet.
The names are the ``kind`` setting's (``config.BackendKindName``); nothing else compares them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

__all__ = ["AUTO", "DISCOVERY_ORDER", "KINDS", "OPENAI", "BackendKind", "backend_kind"]


@dataclass(frozen=True, slots=True)
class BackendKind:
    name: str
    known: bool = True  # False: ``auto``, what the backend is has not been found out yet
    # Ready when GET health_path answers anything but 503 (llama.cpp's while its model loads; a
    # backend without the path answers 404: alive is enough).
    health_path: str = "/health"
    # Asked at start-up, in DISCOVERY_ORDER: a JSON object with one of ``identify_keys`` here says
    # the backend is of this kind (None: found by elimination, or never).
    identify_path: str | None = None
    identify_keys: tuple[str, ...] = ()
    # The slot probe: the key of that answer giving how many requests it runs at once. None: it
    # does not say (Ollama's OLLAMA_NUM_PARALLEL and vLLM's max_num_seqs are not exposed): ``slots``.
    slots_key: str | None = None
    # The cancel behaviour: a non-streamed generation may go on after its client left (llama.cpp),
    # so the left client's slot is held until GET busy_slots_path shows it idle. None: it stops
    # when the connection closes.
    busy_slots_path: str | None = None
    # It loads models on demand and lists the loaded ones here (Ollama): routing prefers a backend
    # that has the request's model loaded.
    loaded_models_path: str | None = None
    # The body field that carries the request's computed priority (``vllm_priority``).
    priority_field: str | None = None

    def __str__(self) -> str:
        return self.name

    def identifies(self, answer: Any) -> TypeGuard[dict[str, Any]]:
        """Whether ``answer`` (identify_path's JSON) says the backend is of this kind."""
        return isinstance(answer, dict) and any(key in answer for key in self.identify_keys)

    @property
    def may_report_slots(self) -> bool:
        """Its slots may be asked of it (it says them, or it is not known yet)."""
        return not self.known or self.slots_key is not None


# Not asked yet: it may be llama.cpp, so a left client's slot is held while /slots shows it busy.
AUTO = BackendKind("auto", known=False, busy_slots_path="/slots")
LLAMACPP = BackendKind(
    "llamacpp",
    identify_path="/props",
    identify_keys=("total_slots", "default_generation_settings"),
    slots_key="total_slots",
    busy_slots_path="/slots",
)
OLLAMA = BackendKind("ollama", identify_path="/api/version", identify_keys=("version",), loaded_models_path="/api/ps")
VLLM = BackendKind("vllm", identify_path="/version", identify_keys=("version",), priority_field="priority")
OPENAI = BackendKind("openai")  # it answers, but none of the above: an OpenAI-compatible server

KINDS = {kind.name: kind for kind in (AUTO, LLAMACPP, OLLAMA, VLLM, OPENAI)}
DISCOVERY_ORDER = (LLAMACPP, OLLAMA, VLLM)  # llama.cpp first: its answer carries its slots


def backend_kind(name: str) -> BackendKind:
    """The kind called ``name``; ValueError naming the known ones for any other name."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown backend kind {name!r}: one of {', '.join(KINDS)}") from None
