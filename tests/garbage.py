"""What a call leaves for Python's cycle collector: an error held by a local of a frame in its own
traceback keeps that frame, every frame above it and what they hold (a request's body, its
messages) until a full collection, which can be many requests later."""

from __future__ import annotations

import gc
import types
from collections.abc import Callable
from pathlib import Path


def left_in_cycles(
    call: Callable[[], object], frames_of: Callable[[types.FrameType], bool] = lambda frame: True
) -> tuple[list[str], list[str]]:
    """(frames, errors) of `call()` found only in reference cycles: their names, sorted; frames
    only where `frames_of` says. The call runs once before, so that what its first run keeps for
    good (a started child, a warmed cache) is not counted."""
    call()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        call()
        gc.collect()
        frames = {
            f"{o.f_code.co_name} ({Path(o.f_code.co_filename).name})"
            for o in gc.garbage
            if isinstance(o, types.FrameType) and frames_of(o)
        }
        errors = {type(o).__name__ for o in gc.garbage if isinstance(o, BaseException)}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return sorted(frames), sorted(errors)
