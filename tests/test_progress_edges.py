"""The progress reporter at the edges a mutation review found untested: where its lines go and
when, a terminal's redraws, rounded percentages, work that fails part way, nothing to do."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from test_progress import Terminal

from openjev import progress


class Flushed(io.StringIO):
    """A log that records what had been written at each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []

    def flush(self) -> None:
        self.flushed.append(self.getvalue())


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=lambda: now[0]))  # a clock the test moves
    return now


def test_a_terminal_is_drawn_at_once_then_at_most_ten_times_a_second(clock):
    screen = Terminal()
    bar = progress.Progress("capture", 8, stream=screen)
    assert screen.getvalue() == ""
    draws = []
    for step in (0.0, 0.0625, 0.0625, 0.0, 0.125, 0.0):  # binary fractions: sums exact
        clock[0] += step
        bar.advance()
        draws.append(screen.getvalue().count("\r"))
    assert draws == [1, 1, 2, 2, 3, 3]
    frames = screen.getvalue().split("\r")[1:]
    assert all(frame.endswith(" s\x1b[K") for frame in frames)  # each redraw erases what a longer one left
    assert frames[0].startswith("capture [" + "#" * 4 + "." * 26 + "] 1/8 (12 %) 0.0 s")  # 30/8 = 3.75: 4
    assert frames[-1].startswith("capture [" + "#" * 19 + "." * 11 + "] 5/8 (62 %) ")  # 18.75: 19


def test_a_log_gets_a_line_every_ten_seconds_without_a_total(clock):
    log = Flushed()
    bar = progress.Progress("soak", None, stream=log)
    for step in (5.0, 5.0, 5.0, 5.0, 9.9):
        clock[0] += step
        bar.advance()
    bar.close()
    assert log.getvalue().splitlines() == [
        "soak: started",
        "soak: 2 10.0 s",
        "soak: 4 20.0 s",
        "soak: done, 5 in 29.9 s",
    ]
    assert log.flushed == [log.getvalue()[: end + 1] for end, c in enumerate(log.getvalue()) if c == "\n"]


def test_a_log_gets_a_line_at_each_tenth_and_rounded_percentages(clock):
    log = io.StringIO()
    bar = progress.Progress("work", 10, stream=log)
    bar.advance()
    assert log.getvalue().splitlines()[-1] == "work: 1/10 (10 %) 0.0 s"
    thirds = io.StringIO()
    list(progress.track(range(3), "thirds", stream=thirds))
    assert "thirds: 2/3 (67 %) 0.0 s" in thirds.getvalue().splitlines()


def test_lines_go_to_stderr_by_default_and_a_stream_without_isatty_is_a_log(clock, capsys):
    assert list(progress.track(range(2), "model")) == [0, 1]
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[0] == "model: started, 2 to do"

    class Pipe:
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> None:
            self.text += text

        def flush(self) -> None:
            pass

    pipe = Pipe()
    list(progress.track(range(2), "model", stream=pipe))  # type: ignore[arg-type]
    assert pipe.text.splitlines()[0] == "model: started, 2 to do" and "\r" not in pipe.text


@pytest.mark.parametrize("stream", [io.StringIO, Terminal])
def test_work_that_fails_part_way_still_ends_the_bar_counting_what_was_done(clock, stream):
    out = stream()
    with pytest.raises(RuntimeError, match="tensor 2"):
        for item in progress.track(range(5), "tensors", stream=out):
            if item == 2:
                raise RuntimeError("tensor 2")
    last = out.getvalue().rstrip("\n").splitlines()[-1].split("\r")[-1]
    assert out.getvalue().endswith("\n")
    want = (
        "tensors [" + "#" * 12 + "." * 18 + "] 2/5 (40 %) 0.0 s"
        if stream is Terminal
        else "tensors: done, 2/5 (40 %) in 0.0 s"
    )
    assert last.startswith(want), out.getvalue()


@pytest.mark.parametrize("stream", [io.StringIO, Terminal])
def test_nothing_to_do_is_counted_not_divided_by(clock, stream):
    """An empty list (a warm-up with no graph shapes to capture): a total of 0 counts, no percentage."""
    out = stream()
    assert list(progress.track([], "graphs", stream=out)) == []
    log = "graphs: started\ngraphs: done, 0 in 0.0 s\n"
    assert out.getvalue() == (log if stream is io.StringIO else "\rgraphs 0 0.0 s\x1b[K\n")
