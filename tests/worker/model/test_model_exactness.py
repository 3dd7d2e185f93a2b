"""Gaps found by mutation testing of the CPU model path, on the demo export: every candidate of
a tree pass (children of a parent in the same pass, grandchildren, children of two earlier
passes' states, unrelated prompts beside them) scores what its full prompt scores run alone; a
prompt cut on the 64-token grid scores the same bits as uncut; a candidate's bits do not depend
on how many others read the head; a model ending on a Gated DeltaNet layer matches transformers;
and a state made cacheable owns exactly the bytes it is counted for."""

from __future__ import annotations

import pytest
import torch

from openjev.worker.model.state import AttentionState
from openjev.worker.runner_api import SegmentRun

VOCAB = 248320
TOLERANCE = 1e-5
GENERATOR = torch.Generator()


@pytest.fixture(autouse=True)
def fixed_ids():
    """Ids from a fixed seed, whatever ran before in the process, so a failure reproduces."""
    GENERATOR.manual_seed(5)


def random_ids(length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=GENERATOR).tolist()


def score_alone(runner, ids: list[int]) -> float:
    [result] = runner.run_launch([SegmentRun(ids, 0, None, keep_state=False, read_head=True)])
    return result.head_score


def assert_close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= TOLERANCE * max(1.0, abs(want)), (what, got, want)


def test_a_tree_in_one_pass_scores_each_full_prompt_alone(runner):
    """Children and a grandchild whose parents run in the same pass, packed after other segments
    (so a row before a segment's first row is another segment's), with lengths across the 64-token
    chunk, a chain of segments shorter than the conv window (whose windows reach back into their
    ancestors'), beside children of two earlier passes' states and an unrelated prompt."""
    root, earlier = random_ids(70), random_ids(40)
    other = random_ids(25)
    # two states from an earlier pass, so the pass reads two windows and two recurrent states
    held, held_other = runner.run_launch(
        [SegmentRun(ids, 0, None, keep_state=True, read_head=False) for ids in (earlier, other)]
    )
    lengths = {"a": 5, "b": 66, "bb": 3, "u": 9, "uu": 1, "x": 2, "y": 4, "e": 130, "f": 7}
    tails = {name: random_ids(n) for name, n in lengths.items()}
    runs = [
        SegmentRun(tails["u"], 0, None, keep_state=False, read_head=True),  # 0: an unrelated prompt first
        SegmentRun(root, 0, None, keep_state=False, read_head=True),  # 1
        SegmentRun(tails["a"], 70, None, keep_state=False, read_head=True, parent_in_pass=1),  # 2
        SegmentRun(tails["e"], 40, held.state, keep_state=False, read_head=True),  # 3: between parent and child
        SegmentRun(tails["b"], 70, None, keep_state=False, read_head=True, parent_in_pass=1),  # 4
        SegmentRun(tails["bb"], 136, None, keep_state=False, read_head=True, parent_in_pass=4),  # 5
        SegmentRun(tails["uu"], 9, None, keep_state=False, read_head=True, parent_in_pass=0),  # 6
        SegmentRun(tails["x"], 10, None, keep_state=False, read_head=True, parent_in_pass=6),  # 7
        SegmentRun(tails["y"], 12, None, keep_state=False, read_head=True, parent_in_pass=7),  # 8
        SegmentRun(tails["f"], 25, held_other.state, keep_state=False, read_head=True),  # 9
    ]
    prompts = {
        "u": tails["u"],
        "root": root,
        "a": root + tails["a"],
        "e": earlier + tails["e"],
        "b": root + tails["b"],
        "bb": root + tails["b"] + tails["bb"],
        "uu": tails["u"] + tails["uu"],
        "x": tails["u"] + tails["uu"] + tails["x"],
        "y": tails["u"] + tails["uu"] + tails["x"] + tails["y"],
        "f": other + tails["f"],
    }
    results = runner.run_launch(runs)
    for name, result in zip(["u", "root", "a", "e", "b", "bb", "uu", "x", "y", "f"], results, strict=True):
        assert_close(result.head_score, score_alone(runner, prompts[name]), name)


@pytest.mark.parametrize("in_pass", [False, True])
def test_a_prompt_cut_on_the_chunk_grid_scores_the_same_bits(runner, in_pass):
    """GDN chunks and attention blocks count from a segment's start, every 64 tokens: a prompt cut
    at multiples of 64 runs the same chunks and blocks as uncut, so the same bits (what lets the
    state cache cut there, runner.state_cut_anywhere), parents in an earlier pass or in the same."""
    ids = random_ids(150)
    cuts = [(0, 64), (64, 128), (128, 150)]
    if in_pass:
        runs = [
            SegmentRun(ids[a:b], a, None, keep_state=False, read_head=b == 150, parent_in_pass=i - 1 if i else None)
            for i, (a, b) in enumerate(cuts)
        ]
        score = runner.run_launch(runs)[-1].head_score
    else:
        state = None
        for a, b in cuts:
            [result] = runner.run_launch([SegmentRun(ids[a:b], a, state, keep_state=b < 150, read_head=b == 150)])
            state = result.state
        score = result.head_score
    assert score == score_alone(runner, ids)


def test_a_candidate_scores_the_same_bits_among_any_number_of_readers(runner):
    """The head rows are padded to a multiple of 16 (backbone.ROW_QUANTUM) so that the rows after
    the last layer's mixer (its MLP, the final norm) are the same products whatever number of
    candidates a pass reads: one candidate's score is the same bits among 1 to 40 readers."""
    parent, mine = random_ids(30), random_ids(4)
    [held] = runner.run_launch([SegmentRun(parent, 0, None, keep_state=True, read_head=False)])
    alone = runner.run_launch([SegmentRun(mine, 30, held.state, keep_state=False, read_head=True)])[0].head_score
    others = [random_ids(1 + n % 5) for n in range(40)]
    for count in (1, 2, 5, 15, 16, 17, 31, 40):
        runs = [SegmentRun(ids, 30, held.state, keep_state=False, read_head=True) for ids in others[: count - 1]]
        runs.insert(count // 2, SegmentRun(mine, 30, held.state, keep_state=False, read_head=True))
        assert runner.run_launch(runs)[count // 2].head_score == alone, count


def test_a_model_whose_last_layer_is_linear_attention_matches_transformers(model_export, tmp_path):
    """config.json may end on a Gated DeltaNet layer (layer_types are free): then the head rows are
    picked after its mixer, not by a last attention layer's query rows, a path the demo (ending
    on full attention) never takes. The demo cut to its first 7 layers, against transformers on
    the same weights, each reading prompt packed after others so that its head row is not the
    pass's first."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    from openjev.worker.model.runner import TorchRunner

    prefix = "model.language_model."
    config = json.loads((model_export / "config.json").read_text())
    text = config["text_config"]
    text |= {"num_hidden_layers": 7, "layer_types": text["layer_types"][:7]}
    assert text["layer_types"][-1] == "linear_attention"
    export = tmp_path / "export"
    export.mkdir()
    for name in ("open_jev_export.json", "tokenizer.json"):
        (export / name).write_bytes((model_export / name).read_bytes())
    (export / "config.json").write_text(json.dumps(config))
    tensors = {n: t for n, t in load_file(model_export / "model.safetensors").items() if ".layers.7." not in n}
    save_file(tensors, str(export / "model.safetensors"), metadata={"format": "pt"})
    oracle = Qwen3_5TextModel(Qwen3_5TextConfig(**text)).float().eval()
    oracle.load_state_dict({n.removeprefix(prefix): t.float() for n, t in tensors.items()}, strict=True)

    runner = TorchRunner(export, num_threads=2)
    prompts = [random_ids(n) for n in (20, 3, 70)]
    runs = [SegmentRun(prompts[0], 0, None, keep_state=False, read_head=False)]
    runs += [SegmentRun(ids, 0, None, keep_state=False, read_head=True) for ids in prompts[1:]]
    runs.append(SegmentRun(prompts[2][:5], 20, None, keep_state=False, read_head=True, parent_in_pass=0))
    hidden, _ = runner.final_hidden(runs)
    wanted = [prompts[1], prompts[2], prompts[0] + prompts[2][:5]]
    assert hidden.shape == (len(wanted), runner.config.hidden_size)
    for row, ids in zip(hidden, wanted, strict=True):
        with torch.no_grad():
            want = oracle(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        assert ((row - want).abs().max() / want.abs().max()).item() < 1e-4


def test_a_cacheable_state_owns_exactly_its_bytes(runner):
    """The state cache keeps what cacheable_state returns and counts the bytes it says: a state
    from a pass of several segments holds views of that pass's buffers (a root's keys, a slice of
    the batched delta-rule state, of the windows), which would pin the whole buffers behind a
    count of the view's bytes alone. Each tensor is copied to its own storage, same bits."""
    runs = [SegmentRun(random_ids(n), 0, None, keep_state=True, read_head=False) for n in (40, 70, 9)]
    state = runner.run_launch(runs)[1].state
    kept, nbytes = runner.cacheable_state(state)
    assert kept.num_tokens == state.num_tokens == 70
    total = 0
    for got, want in zip(kept.layers, state.layers, strict=True):
        for name in ("keys", "values") if isinstance(got, AttentionState) else ("conv_window", "recurrent"):
            tensor = getattr(got, name)
            assert torch.equal(tensor, getattr(want, name)), name
            storage_bytes = tensor.untyped_storage().nbytes()
            assert storage_bytes == tensor.nbytes, name
            total += tensor.nbytes
    assert nbytes == total
