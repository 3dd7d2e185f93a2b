"""`buf breaking` (run by `make test` via `make proto-check`) catches incompatible schema edits."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUF = REPO / ".tools" / "node_modules" / ".bin" / "buf"


@pytest.fixture
def edited_tree(tmp_path):
    if not BUF.exists():
        pytest.fail("buf is not installed: run `make proto-check` (make test does)")
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    return tmp_path


def breaking(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BUF), "breaking", "--against", str(REPO / "protos" / "released.binpb")],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )


def edit(tree: Path, old: str, new: str) -> None:
    path = tree / "protos" / "openjev" / "worker" / "v1" / "worker.proto"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_unchanged_schema_passes(edited_tree):
    result = breaking(edited_tree)
    assert result.returncode == 0, result.stdout + result.stderr


def test_removed_field_is_caught(edited_tree):
    edit(edited_tree, "  repeated uint32 token_ids = 3;\n", "")
    result = breaking(edited_tree)
    assert result.returncode != 0
    assert "token_ids" in result.stdout + result.stderr


def test_renumbered_field_is_caught(edited_tree):
    edit(edited_tree, "repeated uint32 token_ids = 3;", "repeated uint32 token_ids = 4;")
    result = breaking(edited_tree)
    assert result.returncode != 0
