"""Progress: plain lines when the stream is a log, one redrawn line on a terminal."""

from __future__ import annotations

import io
import logging

from openjev import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_few_plain_lines():
    log = io.StringIO()
    assert list(progress.track(range(100), "work", stream=log)) == list(range(100))
    lines = log.getvalue().splitlines()
    assert lines[0] == "work: started, 100 to do"
    assert lines[-1].startswith("work: done, 100/100 (100 %) in ")
    assert 3 <= len(lines) <= 12  # about every 10 %, never a line per item
    assert "\r" not in log.getvalue()


def test_a_terminal_gets_one_redrawn_bar():
    screen = Terminal()
    bar = progress.Progress("capture", 4, stream=screen)
    for _ in range(4):
        bar.advance()
    bar.close()
    text = screen.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    last = text.rstrip("\n").split("\r")[-1]
    assert last.startswith("capture [" + "#" * 30 + "] 4/4 (100 %)")


def test_unknown_total_counts_only():
    log = io.StringIO()
    bar = progress.Progress("soak", None, stream=log)
    bar.advance(3)
    bar.close()
    assert log.getvalue().splitlines() == ["soak: started", log.getvalue().splitlines()[1]]
    assert log.getvalue().splitlines()[1].startswith("soak: done, 3 in ")


def test_a_servers_log_gets_its_lines_as_log_records(caplog):
    """The worker's graph warm-up passes its logger: off a terminal the lines are its log records
    (JSON in a server's log), not plain text written among them."""
    stream = io.StringIO()
    logger = logging.getLogger("openjev.test.progress")
    with caplog.at_level(logging.INFO, logger=logger.name):
        assert list(progress.track(range(20), "graphs", stream=stream, log=logger)) == list(range(20))
    assert stream.getvalue() == ""
    messages = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert messages[0] == "graphs: started, 20 to do" and messages[-1].startswith("graphs: done, 20/20")
    terminal = Terminal()  # a terminal still gets its bar
    list(progress.track(range(3), "graphs", stream=terminal, log=logger))
    assert "\r" in terminal.getvalue()
