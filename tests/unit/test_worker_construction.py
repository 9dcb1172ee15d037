"""A worker replica whose constructor failed: Serve still stops it (awaits its __del__)."""

import asyncio
import gc

import pytest

from cluster.config import EngineConfig, TransportConfig
from cluster.model.loader import ModelLoadError
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker


# Python's own __del__ call when the object is collected makes a coroutine nobody awaits.
@pytest.mark.filterwarnings("ignore:coroutine 'EngineWorker.__del__' was never awaited:RuntimeWarning")
@pytest.mark.parametrize("tier", [DecodeWorker, PrefillWorker])
def test_a_worker_whose_constructor_failed_stops_cleanly(tmp_path, tier):
    worker = object.__new__(tier)
    with pytest.raises(ModelLoadError):
        worker.__init__(EngineConfig(model=str(tmp_path / "missing")), TransportConfig())
    asyncio.run(worker.__del__())  # nothing was started: nothing to stop, and no AttributeError
    del worker
    gc.collect()  # here, where the warning filter applies
