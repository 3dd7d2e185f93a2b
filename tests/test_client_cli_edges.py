"""What a mutation review of `openjev.client` and `openjev decide`/`tokenize` found no test for:
every field of the response JSON, what the client puts on the wire (token, request id, deadline,
channel options), and the command line's stdin, policy, output, defaults and refusals. The wire
is read by a stand-in frontend on loopback that records each call (and, for one test, never
answers); the answers themselves come from the session's real pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from openjev import abi
from openjev.client import Client, response_to_json, sendable_token
from openjev.tools import cli
from openjev.v1 import decision_pb2 as api
from openjev.v1 import decision_pb2_grpc

SMALL = {"state": "hi", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}
EXAMPLE = json.loads((Path(__file__).resolve().parents[1] / "examples" / "contract_example.json").read_text())


class _Recorder(decision_pb2_grpc.DecisionServiceServicer):
    """Records each call; answers `reply`, or aborts with `abort` (code, details, trailing
    metadata), or with `hang` answers only once the caller has gone."""

    def __init__(self):
        self.calls: list[SimpleNamespace] = []
        self.reply = api.DecideResponse(model="recorded")
        self.abort: tuple | None = None
        self.hang = False
        self.address = ""  # the fixture's, once serving

    def Decide(self, request, context):
        self.calls.append(
            SimpleNamespace(
                request=request, metadata=dict(context.invocation_metadata()), remaining=context.time_remaining()
            )
        )
        if self.hang:
            gone = threading.Event()
            context.add_callback(gone.set)
            gone.wait(60)
        if self.abort:
            code, details, trailing = self.abort
            context.set_trailing_metadata(trailing)
            context.abort(code, details)
        return self.reply


@pytest.fixture
def recorder():
    servicer = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    decision_pb2_grpc.add_DecisionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.address = f"127.0.0.1:{port}"
    yield servicer
    server.stop(0).wait()


def _cli(*args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != cli.TOKEN_ENV}
    return subprocess.run(
        [sys.executable, "-m", "openjev.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
        input=stdin,
    )


# --- openjev.client: the response JSON -------------------------------------------------------


def _full_response() -> api.DecideResponse:
    """Every field set, each to a value no other field has."""
    r = api.DecideResponse(model="m-1")
    choice = r.answers.add(question_id="z-choice", keys=["a", "b"], probabilities=[0.25, 0.75])
    choice.choice.choice, choice.choice.confidence = "b", 0.5
    score = r.answers.add(question_id="a-score", keys=["0", "1"], probabilities=[0.125, 0.875])
    score.score.score, score.score.confidence = 0.875, 0.375
    score.score.legend_json.extend(['"low"', '{"n": 12345678901234567890123}'])
    noul = r.answers.add(question_id="m-noul", keys=["yes", "no"], probabilities=[0.0625, 0.9375])
    noul.noul.noul = 0.0625
    r.usage.input_tokens, r.usage.output_tokens = 41, 3
    m = r.metadata
    m.method, m.temperature, m.candidate_sequences, m.inference_seconds, m.max_length = "meth", 2.5, 7, 0.123456, 99
    m.prefix_cache.policy = abi.policy_to_enum("shared")
    m.prefix_cache.enabled = False
    m.prefix_cache.scope = api.PREFIX_SCOPE_WITHIN_QUESTION
    m.prefix_cache.saved_tokens = 13
    return api.DecideResponse.FromString(r.SerializeToString())


def test_every_field_of_the_response_lands_in_its_contract_key_in_question_order():
    got = response_to_json(_full_response())
    assert got == {
        "model": "m-1",
        "answers": {
            "z-choice": {"type": "choice", "choice": "b", "probabilities": {"a": 0.25, "b": 0.75}, "confidence": 0.5},
            "a-score": {
                "type": "score",
                "score": 0.875,
                "probabilities": {"0": 0.125, "1": 0.875},
                "confidence": 0.375,
                "legend": {"0": "low", "1": {"n": 12345678901234567890123}},
            },
            "m-noul": {"type": "noul", "noul": 0.0625},
        },
        "usage": {"input_tokens": 41, "output_tokens": 3},
        "metadata": {
            "method": "meth",
            "temperature": 2.5,
            "candidate_sequences": 7,
            "inference_seconds": 0.123456,
            "max_length": 99,
            "prefix_cache": {"policy": "shared", "enabled": False, "scope": "within_question", "saved_tokens": 13},
        },
    }
    assert list(got["answers"]) == ["z-choice", "a-score", "m-noul"]  # the server's order, not sorted


def test_an_answer_whose_keys_and_probabilities_differ_in_length_is_refused_not_cut():
    response = api.DecideResponse()
    answer = response.answers.add(question_id="q", keys=["a", "b"], probabilities=[1.0])
    answer.choice.choice = "a"
    with pytest.raises(ValueError):
        response_to_json(response)


# --- openjev.client: what goes on the wire ---------------------------------------------------


def test_printable_ascii_tokens_with_inner_spaces_and_tildes_are_sendable_and_stripped(recorder):
    assert sendable_token("a b~") and not sendable_token("") and not sendable_token("a\x7f")
    with Client(recorder.address, token=" \ta b~\n") as client:
        assert client.decide(SMALL, timeout=30)["model"] == "recorded"
    assert recorder.calls[-1].metadata["authorization"] == "Bearer a b~"


@pytest.mark.parametrize("token", ["", "  \t"])
def test_an_empty_or_blank_token_is_refused_not_sent_as_no_token(token):
    with pytest.raises(ValueError, match="token is empty"):
        Client("127.0.0.1:1", token=token)


def test_request_id_and_policy_reach_the_frontend(recorder):
    with Client(recorder.address) as client:
        client.decide(SMALL, policy="fixed", timeout=30, request_id="trace-me-42")
    call = recorder.calls[-1]
    assert call.metadata["x-request-id"] == "trace-me-42"
    assert call.request.prefix_policy == abi.policy_to_enum("fixed")


@pytest.mark.parametrize("timeout", [float("inf"), 1e10])
def test_a_timeout_past_grpcs_range_is_no_deadline_not_an_instant_failure(recorder, timeout):
    with Client(recorder.address) as client:
        assert client.decide(SMALL, timeout=timeout)["model"] == "recorded"
    assert recorder.calls[-1].remaining > 1e12  # what gRPC reports for no deadline


def test_a_request_string_with_a_lone_surrogate_raises_and_a_dicts_goes_as_its_escape(recorder):
    with Client(recorder.address) as client:
        with pytest.raises(UnicodeEncodeError):
            client.decide('{"state": "\ud800", "questions": {}}', timeout=30)
        assert recorder.calls == []
        request = {"state": "\ud800", "questions": {}}
        client.decide(request, timeout=30)
    assert recorder.calls[-1].request.request_json == json.dumps(request)


def test_decide_keeps_the_answers_of_a_newer_server_with_a_kind_this_build_does_not_know(recorder):
    recorder.reply.answers.add(question_id="q", keys=["x", "y"], probabilities=[0.5, 0.5])
    with Client(recorder.address) as client:
        got = client.decide(SMALL, timeout=30)
    assert got["answers"] == {"q": {"type": "unknown", "probabilities": {"x": 0.5, "y": 0.5}}}


def test_the_callers_channel_options_win_over_the_defaults(recorder):
    recorder.reply.model = "m" * 1000
    with Client(recorder.address, options=[("grpc.max_receive_message_length", 100)]) as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.decide(SMALL, timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_default_channel_takes_an_answer_past_grpcs_4_mib_default(recorder):
    recorder.reply.model = "m" * (5 * 1024 * 1024)
    with Client(recorder.address) as client:
        assert len(client.decide(SMALL, timeout=30)["model"]) == 5 * 1024 * 1024


def test_leaving_the_with_block_closes_the_channel(recorder):
    with Client(recorder.address) as client:
        client.decide(SMALL, timeout=30)
    with pytest.raises(ValueError, match="closed channel"):
        client.decide(SMALL, timeout=30)


# --- openjev decide ------------------------------------------------------------------------


def test_cli_reads_the_request_from_stdin(pair):
    out = _cli("decide", "-", "--addr", pair.frontend.address, stdin=json.dumps(EXAMPLE))
    assert out.returncode == 0, out.stderr
    assert list(json.loads(out.stdout)["answers"]) == ["route", "refund_review", "urgency"]


def test_cli_policy_reaches_the_engine_and_the_output_is_indented(pair, tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(EXAMPLE))
    out = _cli("decide", str(path), "--addr", pair.frontend.address, "--policy", "shared")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["metadata"]["prefix_cache"]["policy"] == "shared"
    assert out.stdout.startswith('{\n "model": ')


def test_cli_prints_a_score_level_too_long_for_int_as_its_digits(pair, tmp_path):
    digits = "9" * 5000 + "1"
    path = tmp_path / "request.json"
    path.write_text(
        '{"state": "s", "questions": {"s": {"type": "score", "instructions": "how big?", "criteria": [{"n": 0}, {"n": '
        + digits
        + "}]}}}"
    )
    out = _cli("decide", str(path), "--addr", pair.frontend.address)
    assert out.returncode == 0, out.stderr[-500:]
    assert json.loads(out.stdout, parse_int=str)["answers"]["s"]["legend"]["1"] == {"n": digits}


def test_cli_sends_its_timeout_as_the_deadline_default_60(recorder, tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(SMALL))
    out = _cli("decide", str(path), "--addr", recorder.address)
    assert out.returncode == 0, out.stderr
    # gRPC rounds the timeout it puts on the wire up to a coarser unit: a little over 60 s may arrive
    assert 0 < recorder.calls[-1].remaining <= 61, recorder.calls[-1].remaining
    recorder.hang = True  # answers only once the caller has gone
    out = _cli("decide", str(path), "--addr", recorder.address, "--timeout", "0.5")
    assert out.returncode == 1 and out.stderr.startswith("error: DEADLINE_EXCEEDED: "), out.stderr


def test_cli_a_blank_token_variable_is_unset(recorder, tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(SMALL))
    out = _cli("decide", str(path), "--addr", recorder.address, env={cli.TOKEN_ENV: "  \t "})
    assert out.returncode == 0, out.stderr
    assert "authorization" not in recorder.calls[-1].metadata


def test_cli_a_token_file_of_comments_holds_no_token_whatever_the_servers_variable(tmp_path, monkeypatch):
    path = tmp_path / "tokens"
    path.write_text("# none yet\n")
    monkeypatch.setenv("OPENJEV_AUTH_TOKENS", "a-server-token")  # the frontend's variable, not the client's
    with pytest.raises(SystemExit, match="holds no token"):
        cli._token(SimpleNamespace(token_file=path))


def test_cli_quotes_only_a_request_id_the_servers_could_have_given(recorder, tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(SMALL))
    recorder.abort = (grpc.StatusCode.UNAVAILABLE, "down", (("x-request-id", "two words"),))
    out = _cli("decide", str(path), "--addr", recorder.address)
    assert out.returncode == 1 and out.stderr.strip() == "error: UNAVAILABLE: down", out.stderr


def test_cli_defaults_and_the_largest_timeout():
    args = cli.parser().parse_args(["decide", "r.json"])
    assert (args.addr, args.timeout, args.policy, args.token_file) == ("127.0.0.1:50051", 60.0, None, None)
    assert cli.parser().parse_args(["decide", "r.json", "--timeout", "1e9"]).timeout == 1e9


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["decide", "r.json", "--timeout", "0"], "must be a positive finite number of seconds up to 1000000000"),
        (["decide", "r.json", "--timeout", "soon"], "not a number of seconds: 'soon'"),
        (["decide", "r.json", "--policy", "bogus"], "argument --policy: invalid choice: 'bogus'"),
        (["tokenize", "r.json"], "the following arguments are required: --model"),
        ([], "the following arguments are required: command"),
    ],
)
def test_cli_usage_mistakes_exit_2_with_their_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_ctrl_c_exits_130_without_a_traceback(monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_decide", interrupted)
    try:
        cli.main(["decide", "r.json"])
    except KeyboardInterrupt:  # caught here: escaping, it would stop the test session
        pytest.fail("Ctrl-C escaped main() (a traceback)")
    except SystemExit as exited:
        assert exited.code == 130
    else:
        pytest.fail("main() returned")


# --- openjev tokenize ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ({"questions": {}}, "error: INVALID_ARGUMENT: request requires state"),
        (
            {"state": "word " * 17000, "questions": {"q": {"type": "noul", "instructions": "ok?"}}},
            "error: INVALID_ARGUMENT: ",
        ),
    ],
    ids=["no state", "longer than max_length"],
)
def test_cli_tokenize_refuses_what_the_frontend_refuses(demo_model, tmp_path, request_, message):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(request_))
    out = _cli("tokenize", str(path), "--model", str(demo_model))
    assert out.returncode == 1 and out.stdout == "", out.stderr[-500:]
    assert out.stderr.startswith(message) and "Traceback" not in out.stderr, out.stderr[-500:]
