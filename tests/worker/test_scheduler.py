"""The continuous-batching scheduler on the real PyTorch runner (demo export): requests share
forward passes, whole trees run in one pass, and no answer depends on what else shared it."""

from __future__ import annotations

import random
import threading
import time

import pytest

from openjev.worker.engine import Engine, ExecutionResult, QuestionWork
from openjev.worker.planner import CPU_COST_MODEL, PackLimits
from openjev.worker.runner_api import SegmentRun
from openjev.worker.scheduler import Cancelled, InferenceError, QueueFull

TEMPERATURE = 2.0


@pytest.fixture(scope="module")
def torch_runner(demo_model):
    from openjev.worker.model.runner import TorchRunner

    return TorchRunner(demo_model, num_threads=2)


class PassLog:
    """Wraps the real runner; records every pass it is given (token counts, in-pass parents)."""

    backend = "torch"

    def __init__(self, inner, gate: threading.Event | None = None):
        self.inner, self.gate = inner, gate
        self.max_pass_depth = inner.max_pass_depth
        self.passes: list[list[tuple[int, int | None]]] = []

    def run_launch(self, runs: list[SegmentRun]):
        if self.gate is not None:
            self.gate.wait(30)
        self.passes.append([(len(r.token_ids), r.parent_in_pass) for r in runs])
        return self.inner.run_launch(runs)


def random_request(rng: random.Random, context: list[int]) -> list[QuestionWork]:
    """A JevBench-like request: a shared context, 1-3 questions of 1-6 candidates."""
    questions = []
    for _ in range(rng.randint(1, 3)):
        stem = context + [rng.randrange(1000, 5000) for _ in range(rng.randint(2, 12))]
        kind = rng.choice(["choice", "noul", "score"])
        n = 1 if kind == "noul" else rng.randint(2, 6)
        questions.append(
            QuestionWork(
                kind,
                tuple(tuple(stem + [rng.randrange(1000, 5000) for _ in range(rng.randint(1, 9))]) for _ in range(n)),
            )
        )
    return questions


def run_concurrently(engine: Engine, requests, policies) -> list:
    """Submit every request from its own thread, all released at once."""
    results: list = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def one(i: int) -> None:
        barrier.wait()
        results[i] = engine.execute(requests[i], temperature=TEMPERATURE, policy=policies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_a_shared_tree_runs_in_one_pass(torch_runner):
    log = PassLog(torch_runner)
    engine = Engine(log, cost_model=CPU_COST_MODEL)
    context = list(range(300, 400))
    questions = [
        QuestionWork("choice", tuple(tuple(context + [7, 8, c]) for c in range(5))),
        QuestionWork("noul", (tuple(context + [9]),)),
    ]
    shared = engine.execute(questions, temperature=TEMPERATURE, policy="shared")
    assert shared.num_launches == 1 and len(log.passes) == 1
    assert any(parent is not None for _, parent in log.passes[0])  # children beside their parents
    off = engine.execute(questions, temperature=TEMPERATURE, policy="off")
    assert (
        max(
            abs(a - b)
            for qa, qb in zip(shared.probabilities, off.probabilities, strict=True)
            for a, b in zip(qa, qb, strict=True)
        )
        <= 1e-3
    )


@pytest.mark.parametrize(("seed", "shared_tokens"), [(0, None), (1, None), (2, None), (3, 256)])
def test_answers_are_bit_identical_alone_and_sharing_passes(torch_runner, seed, shared_tokens):
    rng = random.Random(seed)
    contexts = [[rng.randrange(1000, 5000) for _ in range(rng.randint(20, 200))] for _ in range(3)]
    requests = [random_request(rng, rng.choice(contexts)) for _ in range(6)]
    policies = [rng.choice(["off", "default", "shared", "fixed", "auto"]) for _ in requests]
    # A small budget so that requests split across passes in varying company; the same budget
    # alone, since it decides where long nodes are cut (shared_tokens: shorter shared passes).
    limits = PackLimits(max_sequences=7, max_tokens=600, chunk_tokens=128, shared_tokens=shared_tokens)
    alone = Engine(torch_runner, cost_model=CPU_COST_MODEL, pack_limits=limits)
    expected = [alone.execute(r, temperature=TEMPERATURE, policy=p) for r, p in zip(requests, policies, strict=True)]
    mixed = Engine(PassLog(torch_runner), cost_model=CPU_COST_MODEL, pack_limits=limits)
    got = run_concurrently(mixed, requests, policies)
    assert any(r.num_shared_passes for r in got), "no pass carried two requests"
    for want, have in zip(expected, got, strict=True):
        assert have.head_scores == want.head_scores  # bit for bit
        assert have.probabilities == want.probabilities


def test_two_concurrent_requests_share_a_pass_through_the_servers(demo_model, tmp_path):
    """Through the real frontend and worker: two requests sent together ride in one pass, and
    their answers equal those of the same requests sent alone.

    So that they wait together whatever the timing, a long request (one pass of its own: the
    pass budget holds all of it) keeps the worker busy while they arrive; its pass was chosen
    before they came, so it shares none, and the pass after it carries both."""
    from concurrent.futures import ThreadPoolExecutor

    from openjev.client import Client
    from openjev.tools import launch
    from openjev.tools.soak import log_events

    bodies = [
        {"state": "ticket 1: refund please " * 20, "questions": {"q": {"type": "noul", "instructions": "refund?"}}},
        {
            "state": "ticket 2: where is my parcel " * 20,
            "questions": {
                "t": {"type": "choice", "instructions": "team?", "criteria": {"billing": None, "shipping": None}}
            },
        },
    ]
    # ~6,000 tokens, one segment: over a second of one pass on the CPU (budget 8,192 tokens a
    # pass; the torch backend even where a GPU would run it in milliseconds)
    long_body = {
        "state": "log line: disk quota warning " * 1000,
        "questions": {"q": {"type": "noul", "instructions": "full?"}},
    }
    pair = launch.start_pair(
        demo_model, tmp_path, worker_args=["--backend", "torch", "--log-level", "debug", "--max-launch-tokens", "8192"]
    )
    try:
        with Client(pair.frontend.address) as client:
            alone = [client.decide(b) for b in bodies]
            before = len(pair.worker.log_text())
            with ThreadPoolExecutor(3) as pool:
                busy = pool.submit(client.decide, long_body)
                # the long request's pass has begun (accepted alone is not enough: the two
                # could be admitted before it and share its pass)
                wait_until(lambda: log_events(pair.worker.log_text()[before:], "execute_started"))
                together = list(pool.map(client.decide, bodies))
                busy.result(60)
            log = pair.worker.log_text()[before:]
    finally:
        pair.stop()
    for a, t in zip(alone, together, strict=True):
        assert a["answers"] == t["answers"]
    lines = log_events(log, "execute")
    assert len(lines) == 3 and all(line["status"] == "OK" for line in lines), lines
    long_line = max(lines, key=lambda line: line["tokens_submitted"])
    assert long_line["tokens_submitted"] > 4000
    # the long request ran alone, in one pass, before the two: they shared no pass with it ...
    assert (long_line["passes"], long_line["shared_passes"]) == (1, 0), long_line
    # ... so the passes they shared, they shared with each other
    two = [line for line in lines if line is not long_line]
    assert all(line["shared_passes"] >= 1 for line in two), two
    assert any(event["requests"] == 2 for event in log_events(log, "pass")), log_events(log, "pass")


def test_queue_full_and_arrival_order(torch_runner):
    gate = threading.Event()
    log = PassLog(torch_runner, gate)
    engine = Engine(
        log, cost_model=CPU_COST_MODEL, queue_capacity=1, pack_limits=PackLimits(max_sequences=1, max_tokens=4096)
    )
    # two requests told apart by their length (3 and 4 tokens): the runner sees which ran first
    works = [[QuestionWork("noul", ((1, 2, 3),))], [QuestionWork("noul", ((1, 2, 3, 4),))]]

    def one(i: int) -> None:
        engine.execute(works[i], temperature=TEMPERATURE, policy="off")

    first = threading.Thread(target=one, args=(0,))
    first.start()
    wait_until(lambda: _started(engine))  # in a pass, held at the gate
    second = threading.Thread(target=one, args=(1,))
    second.start()
    wait_until(lambda: engine.scheduler.depth == 2)  # waiting for the only segment slot
    with pytest.raises(QueueFull, match="1 waiting"):
        engine.execute(works[0], temperature=TEMPERATURE, policy="off")
    gate.set()
    first.join(30)
    second.join(30)
    # arrival order: the passes' order as the runner got them (the threads may return either way)
    assert [p[0][0] for p in log.passes] == [3, 4], log.passes


def test_a_full_queue_refuses_before_planning(torch_runner, monkeypatch):
    """Planning thousands of candidates takes seconds and holds the GIL the passes need: a full
    queue refuses before it (a 16,384-candidate request was refused after 8-11 s, slowing the
    running request 2.5x), and a caller already gone is not planned for either."""
    gate = threading.Event()
    engine = Engine(
        PassLog(torch_runner, gate),
        cost_model=CPU_COST_MODEL,
        queue_capacity=0,
        pack_limits=PackLimits(max_sequences=1, max_tokens=4096),
    )
    planned = []
    real_plan = engine.plan
    monkeypatch.setattr(engine, "plan", lambda *a, **k: planned.append(1) or real_plan(*a, **k))
    work = [QuestionWork("noul", ((1, 2, 3),))]
    busy = threading.Thread(target=lambda: engine.execute(work, temperature=TEMPERATURE, policy="off"))
    busy.start()
    wait_until(lambda: _started(engine))  # held at the gate; capacity 0 refuses the next one
    assert planned == [1]
    with pytest.raises(QueueFull, match="0 waiting"):
        engine.execute(work, temperature=TEMPERATURE, policy="off")
    gate.set()
    busy.join(30)
    with pytest.raises(Cancelled, match="before its request was planned"):
        engine.execute(work, temperature=TEMPERATURE, policy="off", should_stop=lambda: True)
    assert planned == [1]  # neither refused request was planned
    engine.close()


@pytest.mark.parametrize("seen_by", ["the loop", "its own thread"])
def test_a_request_that_leaves_while_queued_is_logged_as_queued(torch_runner, seen_by):
    """Whichever thread sees the client gone first (the request's own, or the scheduler's loop
    before its next pass), a request that never entered a pass left the queue; seen by its own
    thread it leaves at once, not at the end of the pass that runs meanwhile, so its place is free
    for others."""
    gate = threading.Event()
    engine = Engine(
        PassLog(torch_runner, gate),
        cost_model=CPU_COST_MODEL,
        pack_limits=PackLimits(max_sequences=1, max_tokens=4096),
    )
    # 60 s: the waiting thread does not look, the loop must
    engine.scheduler._poll_seconds = 60.0 if seen_by == "the loop" else 0.01
    work = [QuestionWork("noul", ((1, 2, 3),))]
    first = threading.Thread(target=lambda: engine.execute(work, temperature=TEMPERATURE, policy="off"))
    first.start()
    try:
        wait_until(lambda: _started(engine))  # in a pass, held at the gate
        gone = threading.Event()
        errors: list[Exception] = []

        def queued() -> None:
            try:
                engine.execute(work, temperature=TEMPERATURE, policy="off", should_stop=gone.is_set)
            except Cancelled as error:
                errors.append(error)

        second = threading.Thread(target=queued)
        second.start()
        wait_until(lambda: engine.scheduler.depth == 2)
        gone.set()
        if seen_by == "the loop":
            gate.set()
        second.join(30)
        assert [str(e) for e in errors] == ["cancelled while queued"]
        assert seen_by == "the loop" or engine.scheduler.depth == 1  # while the first's pass still runs
    finally:
        gate.set()
        first.join(30)


def test_a_queued_request_leaving_while_a_pass_is_chosen_fails_no_one_else(torch_runner, monkeypatch):
    """A queued request that hangs on cached states, whose client leaves just as the scheduler
    chooses the next pass: the request beside it in that pass still gets its answer (the race
    once failed the whole pass with a KeyError for the leaving request's freed state)."""
    from openjev.worker import scheduler as scheduler_module

    gate = threading.Event()
    gate.set()
    engine = _cached_engine(torch_runner, gate, "scheduler-race")
    engine.execute(_noul(CONTEXT + [7, 8, 9]), temperature=TEMPERATURE, policy=CACHED)
    gate.clear()
    answers: dict[str, object] = {}
    threads = [_send(engine, answers, "busy", [5, 6, 7])]
    wait_until(lambda: _started(engine))  # its pass is held at the gate
    threads += [
        _send(engine, answers, "leaving", CONTEXT + [4, 5, 6]),
        _send(engine, answers, "staying", [3000, 3001, 3002, 3003]),
    ]
    wait_until(lambda: engine.scheduler.depth == 3)
    leaving = next(j for j in engine.scheduler._jobs if j.prepared is not None and j.prepared.hit_tokens)
    real_fill_pass = scheduler_module.fill_pass

    def client_leaves_meanwhile(*args, **kwargs):
        monkeypatch.setattr(scheduler_module, "fill_pass", real_fill_pass)
        cancel = threading.Thread(target=engine.scheduler._cancel, args=(leaving,))
        cancel.start()
        cancel.join(0.5)  # done at once unless the scheduler holds its lock while choosing
        return real_fill_pass(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "fill_pass", client_leaves_meanwhile)
    gate.set()
    for thread in threads:
        thread.join(60)
    alone = engine.execute(_noul([3000, 3001, 3002, 3003]), temperature=TEMPERATURE, policy=CACHED)
    assert isinstance(answers["staying"], ExecutionResult), answers["staying"]
    assert answers["staying"].head_scores == alone.head_scores
    # the leaving request either left before the pass was chosen or ran in it to the end
    assert isinstance(answers["leaving"], Cancelled | ExecutionResult), answers["leaving"]


def _cached_engine(runner, gate: threading.Event, name: str, **kwargs) -> Engine:
    from openjev.worker.cache.sizing import build_state_cache

    return Engine(
        PassLog(runner, gate),
        cost_model=CPU_COST_MODEL,
        state_cache=build_state_cache(runner, 64 << 20, name),
        **kwargs,
    )


CONTEXT = list(range(1000, 1200))  # a request's context: the cache deposits its states at 64, 128, 192
CACHED = "default"  # a policy that uses the cache (`off` never does); one candidate: off's plan


def _noul(tokens: list[int]) -> list[QuestionWork]:
    return [QuestionWork("noul", (tuple(tokens),))]


def _send(engine: Engine, answers: dict, name: str, tokens: list[int]) -> threading.Thread:
    def one() -> None:
        try:
            answers[name] = engine.execute(_noul(tokens), temperature=TEMPERATURE, policy=CACHED)
        except Exception as error:
            answers[name] = error

    thread = threading.Thread(target=one)
    thread.start()
    return thread


def test_a_request_refused_for_a_full_queue_is_no_cache_hit(torch_runner):
    gate = threading.Event()
    gate.set()
    engine = _cached_engine(torch_runner, gate, "refused-hit", queue_capacity=0)
    cache = engine.state_cache
    assert cache is not None
    engine.execute(_noul(CONTEXT + [7, 8, 9]), temperature=TEMPERATURE, policy=CACHED)
    gate.clear()
    answers: dict[str, object] = {}
    busy = _send(engine, answers, "busy", [5, 6, 7])
    wait_until(lambda: _started(engine))  # held at the gate; capacity 0 refuses the next one
    with pytest.raises(QueueFull):
        engine.execute(_noul(CONTEXT + [4, 5, 6]), temperature=TEMPERATURE, policy=CACHED)
    assert (cache.num_hits, cache.hit_tokens) == (0, 0)
    gate.set()
    busy.join(30)
    engine.execute(_noul(CONTEXT + [4, 5, 6]), temperature=TEMPERATURE, policy=CACHED)  # admitted: counted
    assert (cache.num_hits, cache.hit_tokens) == (1, 192)


def test_a_failed_request_frees_its_inputs_and_shares_no_exception(torch_runner):
    """Requests failed together each get an exception of their own (a shared one grew every
    raising thread's frames, other requests' tokens among them), and a failed request's inputs
    are freed when the caller drops the error, without waiting for the cycle collector."""
    import gc
    import weakref

    class Ids(list):  # token ids a weak reference can watch
        pass

    gate = threading.Event()

    class Failing(PassLog):
        def run_launch(self, runs):
            if not self.passes:  # the first request's pass: the others queue and share the next
                self.passes.append([])
                gate.wait(30)
                return self.inner.run_launch(runs)
            raise RuntimeError("device lost")

    engine = Engine(Failing(torch_runner), cost_model=CPU_COST_MODEL)
    caught: dict[int, BaseException] = {}
    refs = []

    def one(i: int) -> None:
        ids = Ids([100 + i] * 20)
        refs.append(weakref.ref(ids))
        try:
            engine.execute([QuestionWork("noul", (ids,))], temperature=TEMPERATURE, policy="off")
        except InferenceError as error:
            caught[i] = error

    collecting = gc.isenabled()
    gc.disable()
    try:
        first = threading.Thread(target=lambda: engine.execute(_noul([5, 6, 7]), temperature=TEMPERATURE, policy="off"))
        first.start()
        wait_until(lambda: _started(engine))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: engine.scheduler.depth == 3)
        gate.set()
        for t in [first, *threads]:
            t.join(30)
        assert sorted(caught) == [0, 1] and caught[0] is not caught[1]
        assert "device lost" in str(caught[0]) and str(caught[0]) == str(caught[1])
        caught.clear()
        assert [ref() for ref in refs] == [None, None]
    finally:
        if collecting:
            gc.enable()
        engine.close()


def test_a_failure_in_a_pass_fails_that_pass_only(torch_runner, monkeypatch):
    """A fault in a pass (here the runner raises on the context's second piece) fails the
    requests of that pass; one waiting for the next pass is answered. (One segment of at most 64
    tokens a pass: the context runs as pieces, a pass each.)"""
    gate = threading.Event()
    limits = PackLimits(max_sequences=1, max_tokens=64, chunk_tokens=64)
    engine = _cached_engine(torch_runner, gate, "failing-pass", pack_limits=limits)
    runner = engine.scheduler.runner
    real_run, passes = runner.run_launch, []

    def out_of_memory(runs):
        passes.append(1)
        if len(passes) == 2:  # the context's second piece: its second pass, the other one waiting
            raise MemoryError("injected: no memory for the pass")
        return real_run(runs)

    answers: dict[str, object] = {}
    threads = [_send(engine, answers, "failing", CONTEXT)]
    wait_until(lambda: _started(engine))
    threads.append(_send(engine, answers, "queued", [3000, 3001, 3002]))  # one segment a pass: next pass
    wait_until(lambda: engine.scheduler.depth == 2)
    monkeypatch.setattr(runner, "run_launch", out_of_memory)
    gate.set()
    for thread in threads:
        thread.join(60)
    assert isinstance(answers["failing"], InferenceError) and "MemoryError" in str(answers["failing"])
    assert isinstance(answers["queued"], ExecutionResult), answers["queued"]


def test_a_state_the_cache_cannot_keep_fails_no_request(torch_runner, monkeypatch):
    """Keeping a state is best effort: when the cache's copy fails (out of memory), the request
    that deposits it and one sharing its pass are both answered, with their own bits."""
    gate = threading.Event()
    engine = _cached_engine(torch_runner, gate, "failing-insert")
    cache = engine.state_cache
    assert cache is not None
    alone = Engine(torch_runner, cost_model=CPU_COST_MODEL)
    want = {
        "depositing": alone.execute(_noul(CONTEXT), temperature=TEMPERATURE, policy=CACHED),
        "sharing": alone.execute(_noul([3000, 3001, 3002]), temperature=TEMPERATURE, policy="off"),
    }

    def out_of_memory(*args, **kwargs):
        raise MemoryError("injected: no memory for the cache's copy of a state")

    answers: dict[str, object] = {}
    blocker = _send(engine, answers, "blocker", [9, 9, 9])
    wait_until(lambda: _started(engine))
    threads = [blocker, _send(engine, answers, "depositing", CONTEXT)]
    sharing = threading.Thread(
        target=lambda: answers.setdefault(
            "sharing", engine.execute(_noul([3000, 3001, 3002]), temperature=TEMPERATURE, policy="off")
        )
    )
    sharing.start()
    threads.append(sharing)
    wait_until(lambda: engine.scheduler.depth == 3)
    monkeypatch.setattr(cache, "insert", out_of_memory)
    gate.set()
    for thread in threads:
        thread.join(60)
    for name, result in want.items():
        got = answers[name]
        assert isinstance(got, ExecutionResult), got
        assert got.head_scores == result.head_scores
    assert len(cache) == 0


def _engine_with_deposits(runner, name: str):
    """An engine with a cache (no gate held) that one request of CONTEXT has filled."""
    gate = threading.Event()
    gate.set()
    engine = _cached_engine(runner, gate, name)
    assert engine.state_cache is not None
    engine.execute(_noul(CONTEXT + [7, 8, 9]), temperature=TEMPERATURE, policy=CACHED)
    return engine, engine.state_cache


def test_an_idle_scheduler_holds_no_cached_state_of_finished_requests(torch_runner):
    import gc
    import weakref

    engine, cache = _engine_with_deposits(torch_runner, "idle-pins")
    with cache._lock:
        (state,) = [e.state for k, e in cache._entries.items() if k.position == 192]
    deepest = weakref.ref(state.layers[0].recurrent)
    del state
    hit = engine.execute(_noul(CONTEXT + [4, 5, 6]), temperature=TEMPERATURE, policy=CACHED)
    assert hit.cache_hit_tokens == 192  # it hung on that state
    cache.clear()  # as if evicted
    wait_until(lambda: gc.collect() >= 0 and deepest() is None, timeout=5)


def test_a_runner_result_count_error_pins_no_state_by_refcount(torch_runner, monkeypatch):
    """A pass failed for its result count: the jobs kept the raised error, whose traceback held the
    pass's running frame (its runs, the cached states they hung from) in a cycle until the
    garbage collector ran."""
    import gc
    import weakref

    engine, cache = _engine_with_deposits(torch_runner, "count-error")
    with cache._lock:
        refs = [weakref.ref(e.state.layers[0].recurrent) for e in cache._entries.values()]
    real = torch_runner.run_launch
    monkeypatch.setattr(torch_runner, "run_launch", lambda runs: real(runs)[:-1])
    gc.disable()
    try:
        with pytest.raises(InferenceError, match="results for"):
            engine.execute(_noul(CONTEXT + [4, 5, 6]), temperature=TEMPERATURE, policy=CACHED)
        cache.clear()
        assert sum(r() is not None for r in refs) == 0, "cached states alive after the failed request"
    finally:
        gc.enable()
        engine.close()


def test_a_scheduler_thread_that_cannot_start_leaves_nothing_admitted(torch_runner, monkeypatch):
    """The job was admitted and the thread recorded before it started: one failed start (a pids
    limit) left a request queued for good and no loop ever again, while health said SERVING."""
    engine = Engine(torch_runner, cost_model=CPU_COST_MODEL)
    real_start = threading.Thread.start
    failed: list[bool] = []

    def start_once_failing(thread: threading.Thread) -> None:
        if thread.name == "scheduler" and not failed:
            failed.append(True)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    with pytest.raises(RuntimeError):
        engine.execute(_noul([5, 6, 7]), temperature=TEMPERATURE, policy="off")
    assert engine.scheduler.depth == 0
    deadline = time.monotonic() + 10
    result = engine.execute(
        _noul([5, 6, 7]), temperature=TEMPERATURE, policy="off", should_stop=lambda: time.monotonic() > deadline
    )
    assert len(result.head_scores) == 1
    engine.close()


def _started(engine: Engine) -> bool:
    return any(job.started_at is not None for job in engine.scheduler._jobs)


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def _long_then_short(torch_runner, limits: PackLimits) -> tuple[dict[str, ExecutionResult], PassLog]:
    """A 2,000-token prompt, then a 3-token request sent while the prompt's first pass is held:
    their results and the passes run."""
    gate = threading.Event()
    log = PassLog(torch_runner, gate)
    engine = Engine(log, cost_model=CPU_COST_MODEL, pack_limits=limits)
    work = {"long": [QuestionWork("noul", (tuple(range(1000, 3000)),))], "short": [QuestionWork("noul", ((5, 6, 7),))]}
    results: dict[str, ExecutionResult] = {}

    def send(name: str) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: results.setdefault(name, engine.execute(work[name], temperature=TEMPERATURE, policy="off"))
        )
        thread.start()
        return thread

    long_thread = send("long")
    wait_until(lambda: _started(engine))  # its first pass is held at the gate
    short_thread = send("short")
    wait_until(lambda: engine.scheduler.depth == 2)
    gate.set()
    short_thread.join(60)
    long_thread.join(60)
    return results, log


def test_a_long_prompt_leaves_room_for_short_requests(torch_runner):
    """A prompt longer than a chunk runs over several passes; a short request sent meanwhile
    rides in one of them instead of waiting for the long one to finish."""
    results, log = _long_then_short(torch_runner, PackLimits(max_sequences=8, max_tokens=512, chunk_tokens=256))
    short, long = results["short"], results["long"]
    assert short.num_launches == 1 and short.num_shared_passes == 1
    assert long.num_launches >= 4  # 8 chunks
    # the short request rode in the second pass, beside one chunk, not after the last chunk
    assert next(i for i, p in enumerate(log.passes) if (3, None) in p) == 1
    assert log.passes[1] == [(256, None), (3, None)]


def test_a_shared_pass_is_shorter_beside_a_long_prompt(torch_runner):
    """With shared_tokens, a long prompt alone fills the whole budget with its chunks, and a pass
    it shares with a short request holds at most shared_tokens: one chunk and the short request."""
    limits = PackLimits(max_sequences=8, max_tokens=512, chunk_tokens=128, shared_tokens=256)
    results, log = _long_then_short(torch_runner, limits)
    assert results["short"].num_shared_passes == 1
    assert sum(n for n, _ in log.passes[0]) == 512  # alone: four chunks chained in one pass
    assert log.passes[1] == [(128, None), (3, None)]  # shared: within 256 tokens
    assert sum(n for n, _ in log.passes[2]) == 512  # alone again


def test_a_pass_with_nothing_to_run_fails_its_requests_rather_than_spinning(torch_runner, monkeypatch):
    """A filler that picks nothing while requests wait (a bug, injected here) fails them at once
    instead of running empty passes until their deadlines; the runner sees no empty pass."""
    from openjev.worker import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "fill_pass", lambda *args: [])
    engine = Engine(torch_runner, cost_model=CPU_COST_MODEL)
    passes: list[int] = []
    real_run = torch_runner.run_launch
    monkeypatch.setattr(torch_runner, "run_launch", lambda runs: passes.append(len(runs)) or real_run(runs))
    answers: dict[str, object] = {}
    thread = _send(engine, answers, "stuck", [3000, 3001, 3002])
    thread.join(30)
    engine.close()
    assert not thread.is_alive(), f"the request still waits; the runner saw {len(passes)} passes"
    assert isinstance(answers["stuck"], InferenceError), answers["stuck"]
    assert "no segment of 1 waiting requests fits a pass" in str(answers["stuck"])
    assert passes == []


def _noul_into(out: dict, name: str, engine: Engine, tokens, **options) -> None:
    """A thread's target: a one-candidate request under policy off; its result or error in out[name]."""
    try:
        work = [QuestionWork("noul", (tuple(tokens),))]
        out[name] = engine.execute(work, temperature=TEMPERATURE, policy="off", **options)
    except Exception as error:
        out[name] = error


def test_a_liveness_check_that_raises_cancels_its_own_request_only(torch_runner):
    """A caller's should_stop that raises (the in-process API) ran on the scheduler's thread too
    and ended it: every other request, and any later one, then waited for good."""
    gate = threading.Event()
    engine = Engine(PassLog(torch_runner, gate), cost_model=CPU_COST_MODEL, pack_limits=PackLimits())
    calls = {"n": 0}

    def broken() -> bool:
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("the caller's check broke")
        return False

    out: dict[str, object] = {}

    def send(name: str, tokens, should_stop) -> None:
        _noul_into(out, name, engine, tokens, should_stop=should_stop)

    try:
        a = threading.Thread(target=send, args=("a", range(1000, 1100), lambda: False))
        b = threading.Thread(target=send, args=("b", range(2000, 2050), broken))
        a.start()
        b.start()
        deadline = time.monotonic() + 30
        while calls["n"] < 2:  # b's check has raised (the passes wait at the gate)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        gate.set()
        a.join(60)
        b.join(60)
        assert isinstance(out["a"], ExecutionResult) and isinstance(out["b"], Cancelled), out
        later = engine.execute([QuestionWork("noul", (tuple(range(3000, 3010)),))], temperature=TEMPERATURE)
        assert later.probabilities and engine.scheduler.depth == 0
    finally:
        gate.set()
        engine.close()


def test_a_start_notice_that_raises_fails_no_request(torch_runner):
    """on_start ran inside the pass's own try: one caller's raising notice failed every request
    that started in the same pass ("scheduler failed"), its own and its neighbours'."""
    gate = threading.Event()
    log = PassLog(torch_runner, gate)
    engine = Engine(log, cost_model=CPU_COST_MODEL, pack_limits=PackLimits())
    out: dict[str, object] = {}

    def broken() -> None:
        raise RuntimeError("the caller's notice broke")

    def send(name: str, tokens, on_start) -> None:
        _noul_into(out, name, engine, tokens, on_start=on_start)

    threads = [threading.Thread(target=send, args=("first", range(1000, 1050), lambda: None))]
    try:
        threads[0].start()
        wait_until(lambda: _started(engine))  # its pass waits at the gate; the next two queue
        threads += [
            threading.Thread(target=send, args=("broken", range(2000, 2050), broken)),
            threading.Thread(target=send, args=("beside", range(3000, 3050), lambda: None)),
        ]
        for thread in threads[1:]:
            thread.start()
        wait_until(lambda: engine.scheduler.depth == 3)
        gate.set()
        for thread in threads:
            thread.join(60)
        assert all(isinstance(out[name], ExecutionResult) for name in ("first", "broken", "beside")), out
        assert [len(p) for p in log.passes] == [1, 2]  # the two started in one pass
        alone = engine.execute(
            [QuestionWork("noul", (tuple(range(3000, 3050)),))], temperature=TEMPERATURE, policy="off"
        )
        assert out["beside"].head_scores == alone.head_scores  # type: ignore[attr-defined]
    finally:
        gate.set()
        engine.close()


def test_a_refusal_by_the_admitted_cap_says_so(torch_runner):
    """Few waiting but as many admitted as the worker holds (queue capacity plus a pass's
    sequences, every one started): the refusal named the waiting capacity, which was not full."""
    from types import SimpleNamespace

    engine = Engine(torch_runner, cost_model=CPU_COST_MODEL, queue_capacity=2, pack_limits=PackLimits(max_sequences=3))
    scheduler = engine.scheduler
    scheduler._jobs = [SimpleNamespace(started_at=1.0) for _ in range(scheduler.max_admitted)]  # all running
    with pytest.raises(QueueFull, match=r"^worker queue is full \(5 admitted, the most it holds\)$"):
        scheduler.check_room()
    scheduler._jobs = [SimpleNamespace(started_at=None) for _ in range(2)]
    with pytest.raises(QueueFull, match=r"^worker queue is full \(2 waiting\)$"):
        scheduler.check_room()
    scheduler._jobs = []
    engine.close()


def test_a_request_the_cache_answers_whole_runs_no_pass(torch_runner):
    """Every candidate's state kept: answered at admission with no pass, its start notice given
    once, the bits of a cold engine's answer; once closed, refused like any other request."""
    gate = threading.Event()
    gate.set()
    engine = _cached_engine(torch_runner, gate, "whole-hit")
    node = CONTEXT + [7, 8, 9]  # 203 tokens: states kept at 64, 128, 192 and at its end
    engine.execute(
        [QuestionWork("choice", (tuple(node), tuple(node + [10, 11])))], temperature=TEMPERATURE, policy=CACHED
    )
    passes = len(engine.runner.passes)
    started: list[int] = []
    work = [QuestionWork("choice", (tuple(node), tuple(node)))]
    again = engine.execute(work, temperature=TEMPERATURE, policy=CACHED, on_start=lambda: started.append(1))
    cold = Engine(torch_runner, cost_model=CPU_COST_MODEL).execute(work, temperature=TEMPERATURE, policy=CACHED)
    assert len(engine.runner.passes) == passes and again.num_launches == 0
    assert again.cache_hit_tokens == len(node) and started == [1]
    assert again.head_scores == cold.head_scores
    engine.scheduler.close()
    with pytest.raises(QueueFull, match="shutting down"):
        engine.execute(work, temperature=TEMPERATURE, policy=CACHED)


def test_a_request_over_several_passes_starts_once(torch_runner):
    """Its start notice once and its queue time up to its first pass, not its last: a 2,000-token
    prompt in chunks of 256 runs 8 passes, each held 50 ms."""

    class Slow(PassLog):
        def run_launch(self, runs):
            time.sleep(0.05)
            return super().run_launch(runs)

    engine = Engine(
        Slow(torch_runner),
        cost_model=CPU_COST_MODEL,
        pack_limits=PackLimits(max_sequences=8, max_tokens=256, chunk_tokens=256),
    )
    started: list[int] = []
    work = [QuestionWork("noul", (tuple(range(1000, 3000)),))]
    result = engine.execute(work, temperature=TEMPERATURE, policy="off", on_start=lambda: started.append(1))
    assert result.num_launches >= 8 and started == [1]
    assert result.queue_seconds < 0.05 < result.inference_seconds / 8
