"""The engine facade and the backend choice at the edges a mutation review found untested: the
cost model and pass depth `auto` decides with, the seconds a request spent queued and running, a
contract error naming its question, a closed engine; which runner each `--backend` builds and on
how many threads."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import types

import pytest
import torch
from test_engine import TEMPERATURE, RecordingRunner, shared_context_request
from test_scheduler import PassLog, torch_runner, wait_until  # noqa: F401  (torch_runner: a fixture)

from openjev.worker import backends, geometry
from openjev.worker.cuda.fused_weights import shape_config
from openjev.worker.engine import Engine, InferenceError, QuestionWork, QueueFull
from openjev.worker.planner import CPU_COST_MODEL, CostModel

# ---- the engine -------------------------------------------------------------------------------

LAUNCHES_DEAR = CostModel(seconds_per_launch=1.0, seconds_per_token=1e-6, seconds_per_attention_pair=0.0)


def test_auto_decides_with_the_engines_cost_model_and_the_runners_pass_depth(torch_runner):  # noqa: F811
    """A pass costing a second and tokens next to nothing: the whole tree shared pays only where it
    fits one pass (the torch runner's depth); one tree level a pass (depth 1) auto falls back to
    `default`, where the CPU model would still share across questions."""
    questions = shared_context_request()
    deep = Engine(torch_runner, cost_model=LAUNCHES_DEAR).execute(questions, temperature=TEMPERATURE, policy="auto")
    assert (deep.executed_policy, deep.num_launches) == ("shared", 1)
    shallow = Engine(RecordingRunner(torch_runner), cost_model=LAUNCHES_DEAR)
    got = shallow.execute(questions, temperature=TEMPERATURE, policy="auto")
    assert (got.executed_policy, got.num_launches) == ("default", 2)
    assert 0 < got.num_saved_tokens < deep.num_saved_tokens
    assert Engine(torch_runner).cost_model == CPU_COST_MODEL  # the torch backend's own, when none is given


def test_queued_and_running_seconds_are_apart_and_running_includes_planning(torch_runner, monkeypatch):  # noqa: F811
    """The second request waits while the first's pass is held: its queue_seconds cover at least
    that wait, inference_seconds the planning (a slow planner injected) and its passes, and the
    two together never exceed the call's own duration."""
    gate, began = threading.Event(), threading.Event()
    log = PassLog(torch_runner, gate)
    engine = Engine(log, cost_model=CPU_COST_MODEL)
    plan, planned = engine.plan, []

    def slow_plan(*args, **kwargs):
        started = time.perf_counter()
        time.sleep(0.2)  # the injected slowness itself, no synchronisation
        planned.append(time.perf_counter() - started)
        return plan(*args, **kwargs)

    first: dict = {}

    def run_first() -> None:  # every candidate whole, in one pass
        first["result"] = engine.execute(
            shared_context_request(), temperature=TEMPERATURE, policy="off", on_start=began.set
        )

    leader = threading.Thread(target=run_first)
    leader.start()
    second: dict = {}

    def run_second() -> None:
        called = time.perf_counter()
        second["result"] = engine.execute(shared_context_request(1), temperature=TEMPERATURE)
        second["wall"] = time.perf_counter() - called

    try:
        assert began.wait(30)
        monkeypatch.setattr(engine, "plan", slow_plan)
        waiter = threading.Thread(target=run_second)
        waiter.start()
        wait_until(lambda: engine.scheduler.depth == 2)  # the second admitted, behind the held pass
        held_from = time.perf_counter()
        time.sleep(0.05)  # the wait the second request's queue_seconds must cover
        held = time.perf_counter() - held_from
    finally:
        gate.set()
        leader.join(30)
    waiter.join(30)
    assert first["result"].num_launches == 1
    got = second["result"]
    assert got.queue_seconds >= held
    assert got.inference_seconds >= planned[0]
    assert got.queue_seconds + got.inference_seconds <= second["wall"]
    assert got.num_shared_passes == 0  # the first request's pass had ended before the second's began
    engine.close()


def test_a_probability_the_contract_refuses_names_its_question(torch_runner):  # noqa: F811
    """A noul question with two candidates (the frontend never sends one): InferenceError naming
    question 1, not a ValueError escaping the engine's contract."""
    a, b = shared_context_request(1)[0].candidates[:2]
    questions = [QuestionWork("choice", (a, b)), QuestionWork("noul", (a, b))]
    with pytest.raises(InferenceError, match=r"^question 1: a noul question has 1 head score, got 2$"):
        Engine(torch_runner, cost_model=CPU_COST_MODEL).execute(questions, temperature=TEMPERATURE)


def test_a_closed_engine_takes_no_more_requests(torch_runner):  # noqa: F811
    engine = Engine(torch_runner, cost_model=CPU_COST_MODEL)
    engine.execute(shared_context_request(1), temperature=TEMPERATURE)
    engine.close()
    with pytest.raises(QueueFull, match="^worker is shutting down$"):
        engine.execute(shared_context_request(1), temperature=TEMPERATURE)


# ---- the backend choice -----------------------------------------------------------------------


def test_auto_is_cuda_only_where_a_gpu_and_cupy_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)  # torch sees a GPU, CuPy is not installed
    assert backends.cuda_available() is False
    assert backends.resolve_backend("auto") == "torch"
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    assert backends.cuda_available() is True
    assert backends.resolve_backend("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CuPy but no GPU
    assert backends.resolve_backend("auto") == "torch"


def test_a_backend_that_cannot_run_here_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    with pytest.raises(SystemExit, match=r"^openjev-worker: --backend cuda: no CUDA GPU with CuPy is available$"):
        backends.resolve_backend("cuda")
    with pytest.raises(SystemExit, match=r"^unknown backend 'tensorrt'$"):
        backends.resolve_backend("tensorrt")
    assert [backends.resolve_backend(b) for b in ("torch", "transformers")] == ["torch", "transformers"]
    with pytest.raises(SystemExit, match=r"^openjev-worker: --synthetic needs a GPU"):
        backends.build_runner("torch", tmp_path / "none", synthetic="27b", seed=0, threads=None)  # nothing read


def test_the_widest_hidden_size_the_kernels_take_is_accepted():
    config = dataclasses.replace(shape_config("27b"), hidden_size=geometry.MAX_NORM_WIDTH)
    assert backends.cuda_config_problems(config) == []


@pytest.fixture
def torch_threads():
    """torch's intra-op thread count, set by the runner for the whole process: put back after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("widest_one_thread", "threads", "want"),
    [(128, None, 1), (127, None, 3), (4096, 2, 2)],
    ids=["as-wide-as-the-limit", "wider", "threads-given"],
)
def test_a_narrow_model_runs_on_one_torch_thread(
    demo_model, torch_threads, monkeypatch, widest_one_thread, threads, want
):
    """The demo model's hidden size is 128: at the limit it gets one thread, past it torch's
    count is left alone, and --threads always wins."""
    torch.set_num_threads(3)
    monkeypatch.setattr(backends, "ONE_THREAD_HIDDEN_SIZE", widest_one_thread)
    runner = backends.build_runner("torch", demo_model, synthetic=None, seed=0, threads=threads)
    assert runner.backend == "torch" and torch.get_num_threads() == want


def test_the_transformers_arm_runs_the_export_on_the_cpu_in_float32(demo_model, monkeypatch):
    """The benchmark's baseline arm without --synthetic: the export's weights in transformers, not
    the CUDA runner's (which a CPU host cannot build), in float32 where there is no GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner = backends.build_runner("transformers", demo_model, synthetic=None, seed=0, threads=None)
    assert runner.backend == "transformers" and runner.device == torch.device("cpu")
    assert {p.dtype for p in runner.model.parameters()} == {torch.float32}
