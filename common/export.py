"""An Open-Jev export directory: its metadata file and the checks that refuse a broken one.

The frontend reads this too (chat template, max_length, model names), so this module imports
no torch. The layout:

    config.json            Qwen3.5 text backbone config (nested `text_config` or flat)
    *.safetensors          the backbone weights, Hugging Face tensor names
    tokenizer.json         the `tokenizers` file
    open_jev_export.json   this file's subject: format, ids, temperature, chat template, head
"""

from __future__ import annotations

import json
import math
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

EXPORT_FORMAT = "open-jev-text-merged/1"
META_FILE = "open_jev_export.json"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
MAX_LENGTH_LIMIT = 16384
# Names every loaded model answers to besides its own id and alias (docs/contract.md).
GENERIC_MODEL_NAMES = ("open-jev", "jev-latest")


T = TypeVar("T")


class ExportError(Exception):
    """A refused export. The message names the file and the problem."""


@dataclass(frozen=True)
class ExportMeta:
    """What open_jev_export.json says, validated. head_weight has hidden_size fp32 entries."""

    directory: Path
    model_id: str
    alias: str | None
    base_revision: str
    checkpoint_revision: str
    temperature: float
    max_length: int
    chat_prefix: str
    chat_suffix: str
    head_weight: tuple[float, ...]
    head_bias: float

    @property
    def accepted_model_names(self) -> frozenset[str]:
        names = {self.model_id, *GENERIC_MODEL_NAMES}
        if self.alias is not None:
            names.add(self.alias)
        return frozenset(names)


# Larger safetensors headers are refused (the safetensors library's own limit): a stated length
# of gigabytes would be read into memory whole.
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000


# config.json and open_jev_export.json are kilobytes (a 27B head is ~100 KB): one of gigabytes
# would be read and parsed whole first (a 360 MB one took 21 s and 1.5 GB to refuse)
MAX_JSON_BYTES = 16 << 20


def check_file(path: Path, max_bytes: int, limit: str) -> None:
    """An export's file must be a regular file of at most max_bytes (`limit` says whose limit):
    else ExportError naming it. One of hundreds of MB would be read and parsed whole first."""
    if not path.exists():
        if path.is_symlink():  # exists() follows links: a loop or a dangling link is not "missing"
            raise ExportError(f"{path.name}: a symbolic link to no file (dangling, or a loop)")
        raise ExportError(f"{path.name}: missing from export directory {path.parent}")
    if not path.is_file():  # a device or FIFO (symlinks followed): a read could block or never end
        raise ExportError(f"{path.name}: not a regular file")
    if (size := path.stat().st_size) > max_bytes:
        raise ExportError(f"{path.name}: {size} bytes, more than {limit} ({max_bytes})")


# Qwen3.5's tokenizer.json is 15 MB (a 434 MB one was read whole, by a review of 2026-12-02)
MAX_TOKENIZER_BYTES = 64 << 20


def check_tokenizer_file(path: Path) -> None:
    check_file(path, MAX_TOKENIZER_BYTES, "a tokenizer may have")


def _read_json(path: Path) -> dict[str, Any]:
    check_file(path, MAX_JSON_BYTES, "an export's JSON files may have")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, 5,000-digit ints
        raise ExportError(f"{path.name}: not readable JSON ({type(exc).__name__})") from exc
    if not isinstance(value, dict):
        raise ExportError(f"{path.name}: top level must be a JSON object")
    return value


def _string(meta: dict[str, Any], key: str, *, may_be_empty: bool = False) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or (not value and not may_be_empty):
        raise ExportError(f"{META_FILE}: {key} must be a {'' if may_be_empty else 'nonempty '}string, got {value!r}")
    return value


FLOAT32_MAX = 3.4028234663852886e38  # the head runs in fp32: a weight past it is infinite there


# The calibration temperature divides score gaps: p = softmax((s - max s) / T). Temperature
# scaling of a trained head lands near 1 (the real exports': 1.90 for 9B, 2.53 for 27B); three
# orders of magnitude either side is room for any real head, while 1e308 or 1e-300 (finite, so
# they loaded) turned every answer uniform or saturated, silently.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e3
# The bias is common to every candidate of a question, so it cancels in choice and score answers
# and only moves noul's logit s / T. Past 1e4 the fp32 score is no finer than 2^-10 (~1e-3, the
# numerical gates' size) and |s| / T > 10 at every allowed temperature, so every noul answer would
# sit at 0 or 1 whatever the model computed; a real head's bias is of the order of its scores (1).
MAX_ABS_HEAD_BIAS = 1e4


def _finite_number(meta: dict[str, Any], key: str, limit: float = math.inf) -> float:
    return _checked_number(meta.get(key), key, limit)


def _checked_number(value: Any, name: str, limit: float = math.inf) -> float:
    # bool is an int in Python; a JSON true is never a temperature.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value) or abs(value) > limit:
        bound = "" if limit == math.inf else " within float32's range"
        raise ExportError(f"{META_FILE}: {name} must be a finite number{bound}, got {value!r}")
    return float(value)


def finite(value: int | float) -> bool:
    """A number that is finite as a float (an int past 1.8e308 is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def text_config_of(config: dict[str, Any]) -> Any:
    """The text model's settings: `text_config` of a nested (`qwen3_5`) config.json, else the
    top level (a flat `qwen3_5_text` one may carry a stray `text_config`, which is not its own)."""
    return config.get("text_config", config) if config.get("model_type") == "qwen3_5" else config


MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


def hidden_size_of(config: dict[str, Any]) -> int:
    """hidden_size from a nested (`text_config`) or flat Qwen3.5 config.json (another model type
    is named as such, not as a missing hidden_size)."""
    if config.get("model_type") not in MODEL_TYPES:
        raise ExportError(f"{CONFIG_FILE}: model_type is {config.get('model_type')!r}, expected one of {MODEL_TYPES}")
    text = text_config_of(config)
    size = text.get("hidden_size") if isinstance(text, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ExportError(f"{CONFIG_FILE}: hidden_size must be a positive integer, got {size!r}")
    return size


def check_safetensors_file(path: Path) -> list[str]:
    """Parse a safetensors header without torch and check the file holds every tensor's bytes.
    Returns the tensor names. A truncated or garbled file raises ExportError naming it."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the read forever
            raise ExportError(f"{path.name}: not a regular file")
        size_bytes = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ExportError(f"{path.name}: truncated safetensors file (no header)")
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > size_bytes - 8:
                raise ExportError(f"{path.name}: truncated safetensors file (header past end)")
            if header_bytes > MAX_SAFETENSORS_HEADER_BYTES:
                raise ExportError(f"{path.name}: safetensors header of {header_bytes} bytes (at most 100 MB)")
            header = json.loads(f.read(header_bytes))
    except OSError as exc:
        raise ExportError(f"{path.name}: not readable ({exc})") from exc
    except (ValueError, RecursionError) as exc:
        raise ExportError(f"{path.name}: safetensors header is not JSON ({type(exc).__name__})") from exc
    if not isinstance(header, dict):
        raise ExportError(f"{path.name}: safetensors header is not an object")
    data_bytes = size_bytes - 8 - header_bytes
    names = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise ExportError(f"{path.name}: tensor {name!r} has no data_offsets")
        if not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]:
            raise ExportError(f"{path.name}: tensor {name!r} has data_offsets {offsets!r} (two integers, start <= end)")
        if offsets[1] > data_bytes:
            raise ExportError(
                f"{path.name}: truncated safetensors file: tensor {name!r} ends at byte "
                f"{offsets[1]} of a {data_bytes}-byte data section"
            )
        names.append(name)
    return names


def safetensors_files(directory: Path) -> list[Path]:
    # iterdir, not glob: glob finds nothing in a directory it may not list, iterdir says why
    # (check_safetensors_file refuses any not a regular file)
    files = sorted(path for path in directory.iterdir() if path.name.endswith(".safetensors"))
    if not files:
        raise ExportError(f"*.safetensors: no weight files in export directory {directory}")
    return files


def load_export_meta(directory: str | Path) -> ExportMeta:
    """Validate an export directory and return its metadata. Raises ExportError."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file, not an export directory" if directory.exists() else "export directory does not exist"
        raise ExportError(f"{directory}: {what}")
    meta = _read_json(directory / META_FILE)
    config = _read_json(directory / CONFIG_FILE)
    check_tokenizer_file(directory / TOKENIZER_FILE)
    for path in safetensors_files(directory):
        check_safetensors_file(path)

    if meta.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{META_FILE}: format is {meta.get('format')!r}, expected {EXPORT_FORMAT!r}")
    max_length = meta.get("max_length")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or not 1 <= max_length <= MAX_LENGTH_LIMIT:
        raise ExportError(f"{META_FILE}: max_length must be an integer in 1..{MAX_LENGTH_LIMIT}, got {max_length!r}")
    temperature = _finite_number(meta, "temperature")
    if temperature <= 0:
        raise ExportError(f"{META_FILE}: temperature must be positive, got {temperature!r}")
    if not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise ExportError(
            f"{META_FILE}: temperature must be between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g} "
            f"(a calibrated head's is near 1), got {temperature!r}"
        )

    hidden_size = hidden_size_of(config)
    head_weight = meta.get("head_weight")
    if not isinstance(head_weight, list):
        raise ExportError(f"{META_FILE}: head_weight must be a list of numbers")
    if len(head_weight) != hidden_size:
        raise ExportError(
            f"{META_FILE}: head_weight has {len(head_weight)} entries, expected hidden_size={hidden_size}"
        )
    head = tuple(_checked_number(w, f"head_weight[{i}]", FLOAT32_MAX) for i, w in enumerate(head_weight))
    head_bias = _finite_number(meta, "head_bias", FLOAT32_MAX)
    if abs(head_bias) > MAX_ABS_HEAD_BIAS:
        raise ExportError(
            f"{META_FILE}: head_bias must be within -{MAX_ABS_HEAD_BIAS:g}..{MAX_ABS_HEAD_BIAS:g} "
            f"(past it every noul answer is 0 or 1), got {head_bias!r}"
        )

    return ExportMeta(
        directory=directory,
        model_id=_string(meta, "model_id"),
        alias=None if meta.get("alias") is None else _string(meta, "alias"),
        base_revision=_string(meta, "base_revision"),
        checkpoint_revision=_string(meta, "checkpoint_revision"),
        temperature=temperature,
        max_length=max_length,
        chat_prefix=_string(meta, "chat_prefix", may_be_empty=True),
        chat_suffix=_string(meta, "chat_suffix", may_be_empty=True),
        head_weight=head,
        head_bias=head_bias,
    )


def load_export_meta_or_exit(directory, program: str) -> ExportMeta:
    """For the servers' start: a malformed export ends the process with the file and the problem,
    not a traceback."""
    return or_exit(load_export_meta, directory, program=program)


def or_exit(load: Callable[..., T], *args, program: str, **kwargs) -> T:
    """load(*args, **kwargs), or the process ends with one line when it raises ExportError or
    cannot read the export (an OSError such as a directory the process may not read)."""
    try:
        return load(*args, **kwargs)
    except ExportError as error:
        raise SystemExit(f"{program}: {error}") from None
    except OSError as error:
        raise SystemExit(f"{program}: cannot read the export: {error}") from None
