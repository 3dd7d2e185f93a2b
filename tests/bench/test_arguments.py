"""`openjev bench` refuses arguments it cannot honour before it starts anything (exit 2, one line)."""

from __future__ import annotations

import pytest

from openjev.tools.bench import main as bench_main


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--arms", "off,offf"], "--arms 'off,offf'"),
        (["--arms", "transformers"], "--arms 'transformers'"),
        (["--workload", "no-such-workload.jsonl"], "no-such-workload.jsonl: no such file"),
    ],
    ids=["unknown arm", "no policy arm", "missing workload"],
)
def test_bad_arguments_stop_the_run_before_it_starts(tmp_path, capsys, extra, says):
    with pytest.raises(SystemExit) as stopped:
        bench_main.main(["--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"), *extra])
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
