"""The committed gRPC stubs are what `make protos` generates from the .proto now."""

import subprocess
import sys
from pathlib import Path

from protos.pdserve.v1 import generation_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
PROTO = "protos/pdserve/v1/generation.proto"
GENERATED = ["generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"]


def test_stubs_are_current(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", PROTO],
        cwd=ROOT, check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "protos/pdserve/v1" / name).read_text()
        committed = (ROOT / "protos/pdserve/v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run `make protos`"


def test_the_contract_names_its_package_service_and_methods():
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "pdserve.v1.Generation"
    assert {m.name for m in service.methods} == {"Generate", "Abort", "ListModels"}
    assert service.methods_by_name["Generate"].server_streaming
