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
        (["--from-block", "1"], "--from-block re-renders a saved run: use it with --report-only"),
    ],
    ids=["unknown arm", "no policy arm", "missing workload", "from-block without report-only"],
)
def test_bad_arguments_stop_the_run_before_it_starts(tmp_path, capsys, extra, says):
    with pytest.raises(SystemExit) as stopped:
        bench_main.main(["--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"), *extra])
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_roofline_reads_the_synthetic_shape_in_either_spelling(tmp_path):
    """`--worker-args --synthetic=27b` once gave the roofline the export's config, not the 27B's."""
    from openjev.tools.bench.prepare import model_config
    from openjev.worker.cuda.fused_weights import shape_config

    expected = shape_config("27b")
    assert model_config(tmp_path, ["--synthetic=27b"]) == expected
    assert model_config(tmp_path, ["--log-level", "info", "--synthetic", "27b"]) == expected
