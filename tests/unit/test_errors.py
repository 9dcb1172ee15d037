"""Which failures a request survives by migrating, and which reach the client."""

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from cluster.errors import (
    EngineDeadError,
    InvalidRequestError,
    KVCacheFullError,
    StalledError,
    TransferFailedError,
)
from cluster.serving.faults import can_migrate, is_worker_fault
from tests.helpers import fresh_imports


@pytest.mark.parametrize("error", [ActorDiedError(), ActorUnavailableError("gone", None), EngineDeadError("x"),
                                   KVCacheFullError("x"), StalledError("x")])
def test_worker_faults_migrate(error):
    assert is_worker_fault(error) and can_migrate(error)


def test_a_transfer_failure_under_policy_fail_reaches_the_client_as_a_fault():
    assert is_worker_fault(TransferFailedError("x")) and not can_migrate(TransferFailedError("x"))


@pytest.mark.parametrize("error", [InvalidRequestError("bad"), ValueError("bug"), RuntimeError("bug")])
def test_request_errors_and_bugs_do_not_migrate(error):
    assert not is_worker_fault(error) and not can_migrate(error)


def test_the_offline_engine_and_its_errors_import_no_serve():
    """`pdserve generate` and `bench engine` raise cluster/errors.py's errors without Ray
    Serve, whose import cost each of them ~1 s: it comes with cluster/serving/faults.py, in the tiers."""
    assert fresh_imports("import cluster.engine.engine", ("ray.serve",))[0] == []
