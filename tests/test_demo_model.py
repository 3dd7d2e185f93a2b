"""`python -m openjev.tools.demo_model --out DIR` replaces DIR only when it is empty or an earlier
demo build. Before 2026-12-04 it renamed any existing folder away and deleted it: pointed at a
user's folder, it deleted the user's files (found by a review)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openjev.tools.demo_model import STAMP_FILE, NotADemoBuild, build_demo_model


def _run(out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "openjev.tools.demo_model", "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _refused_in_one_line(out: Path, result: subprocess.CompletedProcess) -> None:
    assert result.returncode != 0, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "not replacing it" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_folder_of_someone_elses_files_is_left_alone(tmp_path):
    out = tmp_path / "models"
    (out / "nested").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "nested" / "weights.bin").write_bytes(b"\x01\x02")
    _refused_in_one_line(out, _run(out))
    assert (out / "notes.txt").read_text() == "mine" and (out / "nested" / "weights.bin").read_bytes() == b"\x01\x02"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # no temporary folder left beside it


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_file_or_a_link_is_left_alone(tmp_path, kind):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("mine")
    else:
        out.symlink_to(target)
    _refused_in_one_line(out, _run(out))
    assert (out.read_text() if kind == "file" else (out / "keep.txt").read_text()) == "mine"
    assert out.is_symlink() == (kind == "link")


def test_an_empty_folder_or_an_earlier_build_is_replaced(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    build_demo_model(out, seed=5, with_tokenizer=False)
    assert json.loads((out / STAMP_FILE).read_text())["seed"] == 5
    (out / "left-by-an-old-build").write_text("x")  # an earlier build's folder, whatever else is in it
    build_demo_model(out, seed=6, with_tokenizer=False)
    assert json.loads((out / STAMP_FILE).read_text())["seed"] == 6
    assert not (out / "left-by-an-old-build").exists()
    (out / STAMP_FILE).unlink()  # no stamp: no longer recognised as a build, so kept
    with pytest.raises(NotADemoBuild, match="holds no demo build"):
        build_demo_model(out, seed=7, with_tokenizer=False)
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_build_stopped_by_a_signal_leaves_no_temporary_folder(tmp_path, signum):
    out = tmp_path / "demo"
    build = subprocess.Popen([sys.executable, "-m", "openjev.tools.demo_model", "--out", str(out)])
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".demo.tmp-*")):  # the build has begun writing
            assert build.poll() is None and time.monotonic() < deadline, "no build under way to stop"
            time.sleep(0.005)
        build.send_signal(signum)
        assert build.wait(timeout=60) == 128 + signum
    finally:
        build.kill()
    assert list(tmp_path.iterdir()) == []


def test_a_stop_during_the_swap_waits_for_its_end(tmp_path):
    """A SIGTERM that lands between the swap's renames (injected: sent by the first rename, the
    old build's move aside) used to leave no build at --out and the old one beside it."""
    out = tmp_path / "demo"
    build_demo_model(out, seed=1, with_tokenizer=False)
    script = f"""
import os, signal
from openjev.tools import demo_model
from openjev.tools.stop_signals import exit_on_stop_signals
real = os.replace
def replace(src, dst):
    if str(src) == {str(out)!r}:
        os.kill(os.getpid(), signal.SIGTERM)
    real(src, dst)
demo_model.os.replace = replace
exit_on_stop_signals()
demo_model.build_demo_model({str(out)!r}, seed=2, with_tokenizer=False)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert json.loads((out / STAMP_FILE).read_text())["seed"] == 2  # the new build, whole
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]


def test_a_damaged_build_is_built_again(tmp_path):
    out = tmp_path / "demo"
    build_demo_model(out, seed=3, with_tokenizer=False)
    weights = out / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size // 2)  # a copy cut short
    build_demo_model(out, seed=3, with_tokenizer=False)
    assert weights.stat().st_size == size
    (out / "config.json").unlink()
    build_demo_model(out, seed=3, with_tokenizer=False)
    assert (out / "config.json").is_file()
