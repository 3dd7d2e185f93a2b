"""The generated gRPC code is current, and the worker ABI version follows the schema."""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

from openjev import abi
from openjev.worker.v1 import worker_pb2

REPO = Path(__file__).resolve().parents[1]
# protoc's output path -> where the package keeps it
GENERATED = {
    f"openjev/{sub}v1/{name}{ext}": f"{folder}/v1/{name}{ext}"
    for sub, folder, name in (("", "common", "decision_pb2"), ("worker/", "worker", "worker_pb2"))
    for ext in (".py", "_grpc.py", ".pyi")
}
BASELINE = REPO / "protos" / "worker_abi_baseline.json"


def test_generated_code_is_current(tmp_path):
    protos = ["openjev/v1/decision.proto", "openjev/worker/v1/worker.proto"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iprotos",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *protos,
        ],
        cwd=REPO,
        check=True,
    )
    stale = [kept for out, kept in GENERATED.items() if not filecmp.cmp(REPO / kept, tmp_path / out, shallow=False)]
    assert not stale, f"run `make protos`: {stale} differ from protos/"


Wire = tuple[str, int, str, int, str, int, str]


def wire_fields(file_descriptor) -> set[Wire]:
    """Everything an old peer relies on: (message, field number, name, type, type name, label,
    oneof) for each field; (enum, number, name, 0, "", 0, "") for each enum value; and (service,
    0, method, streaming as client * 2 + server, "input -> output", 0, "") for each method."""
    proto = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(proto)
    fields: set[Wire] = set()

    def walk(messages, prefix):
        for message in messages:
            name = f"{prefix}{message.name}"
            for field in message.field:
                oneof = message.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else ""
                fields.add((name, field.number, field.name, field.type, field.type_name, field.label, oneof))
            walk(message.nested_type, name + ".")

    walk(proto.message_type, "")
    for enum in proto.enum_type:
        for value in enum.value:
            fields.add((enum.name, value.number, value.name, 0, "", 0, ""))
    for service in proto.service:
        for method in service.method:
            streaming = 2 * method.client_streaming + method.server_streaming
            fields.add((service.name, 0, method.name, streaming, f"{method.input_type} -> {method.output_type}", 0, ""))
    return fields


def incompatible_changes(baseline: set, current: set) -> set:
    """Fields (or enum values) of the released schema that are gone or changed."""
    return baseline - current


def test_worker_abi_version_bumps_on_incompatible_change():
    baseline = json.loads(BASELINE.read_text())
    released = {tuple(f) for f in baseline["fields"]}
    broken = incompatible_changes(released, wire_fields(worker_pb2.DESCRIPTOR))
    if broken:
        assert abi.ABI_VERSION > baseline["abi_version"], (
            f"the worker schema changed incompatibly ({sorted(broken)[:3]}...) but ABI_VERSION is still "
            f"{abi.ABI_VERSION}: bump it in common/abi.py and refresh {BASELINE.name}"
        )
    else:
        assert abi.ABI_VERSION == baseline["abi_version"], f"refresh {BASELINE.name} for ABI {abi.ABI_VERSION}"


def test_the_rule_catches_a_removed_and_a_renumbered_field():
    current = wire_fields(worker_pb2.DESCRIPTOR)
    removed = {f for f in current if not (f[0] == "Candidate" and f[2] == "token_ids")}
    assert incompatible_changes(current, removed) == {f for f in current if f[0] == "Candidate" and f[2] == "token_ids"}
    renumbered = {(f[0], f[1] + 100 if f[2] == "request_id" else f[1], *f[2:]) for f in current}
    assert incompatible_changes(current, renumbered)
    assert not incompatible_changes(current, current | {("Candidate", 9, "new_field", 9, "", 1, "")})


def test_the_rule_catches_a_changed_label_oneof_or_method():
    """The snapshot once held (message, number, name, type, type name) only: a repeated field made
    singular, a field moved out of its oneof, a removed RPC or one made unary passed unseen."""
    current = wire_fields(worker_pb2.DESCRIPTOR)
    token_ids = next(f for f in current if f[0] == "Candidate" and f[2] == "token_ids")
    item = next(f for f in current if f[0] == "ExecuteResponse" and f[6] == "item")
    execute = next(f for f in current if f[0] == "WorkerService" and f[2] == "Execute")
    assert execute[3] == 3 and token_ids[5] == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    for old, new in (
        (token_ids, (*token_ids[:5], descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL, "")),
        (item, (*item[:6], "")),
        (execute, (*execute[:3], 1, *execute[4:])),
        (next(f for f in current if f[2] == "ExecuteUnary" and f[0] == "WorkerService"), None),
    ):
        changed = (current - {old}) | ({new} if new else set())
        assert incompatible_changes(current, changed) == {old}


if __name__ == "__main__":
    # `python tests/test_protos.py` writes the baseline for the current ABI version (at release).
    BASELINE.write_text(
        json.dumps({"abi_version": abi.ABI_VERSION, "fields": sorted(wire_fields(worker_pb2.DESCRIPTOR))}, indent=0)
        + "\n"
    )


def test_the_fleet_digest_without_a_weights_fingerprint_is_an_older_workers():
    """A worker from before `weights_fingerprint` (Describe leaves it empty) computes the fleet
    digest from the revision and the policy alone; a frontend that met one expects that digest,
    which newer workers accept beside their own (a rolling upgrade keeps serving)."""
    import hashlib

    older = hashlib.sha256(b"rev\n2").hexdigest()[:32]
    assert abi.expected_fleet("rev", 2) == abi.expected_fleet("rev", 2, "") == older
    assert abi.expected_fleet("rev", 2, "w1") not in (older, abi.expected_fleet("rev", 2, "w2"))
    head = (0.5, -1.0)
    assert abi.weights_fingerprint("cfg", head, 0.25) != abi.weights_fingerprint("cfg", head, 3.0)
    assert abi.weights_fingerprint("cfg", head, 0.25) != abi.weights_fingerprint("cfg2", head, 0.25)
