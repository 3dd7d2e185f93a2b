"""How each request of a run ends (an Outcome) and, per kind of request, which ends are expected."""

from __future__ import annotations

from dataclasses import dataclass

# Per kind, the statuses that count as expected ("OPEN": an idle stream answered its first
# message and stayed open until the end; "STOPPED": an idle Execute the soak itself cancelled
# at the end). OK answers must still equal the answer alone, refusals carry their exact message.
EXPECTED = {
    "valid": {"OK"},
    "invalid": {"INVALID_ARGUMENT"},
    "oversized": {"INVALID_ARGUMENT"},
    "cancel": {"CANCELLED", "OK"},
    "deadline": {"DEADLINE_EXCEEDED", "OK"},
    "idle_watch": {"OPEN", "RESOURCE_EXHAUSTED"},
    "idle_reflection": {"OPEN", "RESOURCE_EXHAUSTED"},
    "idle_execute": {"CANCELLED", "STOPPED"},
}
KINDS = tuple(EXPECTED)


@dataclass
class Outcome:
    kind: str  # one of KINDS
    status: str
    seconds: float
    ok: bool  # the outcome was the expected one (equal answer / exact message), kills aside
    request_id: str
    started: float = 0.0  # time.monotonic() when sent
    ended: float = 0.0  # time.monotonic() when its status came (or its first reply, for an idle stream)
    answered_ok: bool | None = None  # an OK answer: equal to the answer alone?
    detail: str = ""
