"""What a worker says about itself in its log (JSON lines): its start-up, before it serves, and
its last words at exit (peak device memory, CUDA graph counts)."""

from __future__ import annotations

import json

_NOISE = ("timestamp", "level", "logger")


def _events(log_text: str):
    for line in log_text.splitlines():
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def exit_stats(log_text: str) -> dict:
    """The last `peak_memory` line (empty without a GPU)."""
    found = {}
    for event in _events(log_text):
        if event.get("event") == "peak_memory":
            found = event
    return found


def startup(log_text: str, serving_seconds: float | None, name: str, max_chars: int = 240) -> dict:
    """Seconds from spawn to SERVING, the `graphs_ready` line if any, and every line logged before
    `serving`, shortened: which of them the time went to is what a reader of the report wants."""
    ready, logged = None, []
    for event in _events(log_text):
        if event.get("event") == "serving":
            break
        fields = {"event": event.get("event"), **{k: v for k, v in event.items() if k not in _NOISE}}
        if event.get("event") == "graphs_ready":
            ready = {k: v for k, v in fields.items() if k != "event"}
        text = json.dumps(fields, ensure_ascii=False)
        logged.append(text if len(text) <= max_chars else text[: max_chars - 3] + "...")
    return {"name": name, "serving_seconds": serving_seconds or float("nan"), "graphs_ready": ready, "events": logged}
