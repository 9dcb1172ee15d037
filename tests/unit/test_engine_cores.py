"""Decode engines' own cores, yielding prefill engines (cluster/host/engine_cores.py): the
plan, the claims (real lock files, a real process killed while it holds one) and engine
threads placing themselves, on whatever cores this machine has."""

import os
import subprocess
import sys
import threading

import pytest

from cluster.config import ClusterConfig, EngineConfig, TierConfig
from cluster.host.engine_cores import (
    CORES_ENV,
    HOST_CORES,
    HOST_CORES_ENV,
    YIELDS_ENV,
    CorePlan,
    claim_cores,
    keep_off,
    place_engine_thread,
    plan,
    share_decode_cores,
)
from cluster.launch.serve import engine_cores_of, on_this_machine

several_cores = pytest.mark.skipif(len(HOST_CORES) < 2, reason="needs 2 cores")


def test_the_decode_engines_take_the_last_cores_only_if_one_is_left_for_the_rest():
    assert plan(1, 2, cores=[0, 1]) == CorePlan(decode=(1,), host=(0, 1))
    assert plan(2, 4, cores=[5, 3, 4, 2]) == CorePlan(decode=(4, 5), host=(2, 3, 4, 5))
    assert plan(2, 4, cores=[5, 3, 4, 2]).rest == (2, 3)  # for everything else
    assert plan(2, 2, "own", [0, 1]) is None  # nothing left for the gateway, Ray, the prefill engines
    assert plan(3, 3, "own", [0, 1]) is None
    assert plan(0, 1, "own", [0, 1]) is None
    assert plan(1, 2, cores=[0, 1]).decode_env == {CORES_ENV: "1", HOST_CORES_ENV: "0,1"}
    assert plan(1, 2, cores=[0, 1]).prefill_env == {YIELDS_ENV: "1", HOST_CORES_ENV: "0,1"}


@several_cores
def test_the_driver_keeps_what_it_starts_off_the_decode_cores_and_engine_threads_widen_back(tmp_path):
    cores = plan(1, 2, "own")

    def driver():
        before = keep_off(cores)
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        started = _in_thread(lambda: os.sched_getaffinity(0))  # a thread it starts: the gateway's, the client's
        yielding = _in_thread(lambda: (place_engine_thread(1, environ=cores.prefill_env, lock_dir=str(tmp_path)),
                                       os.sched_getaffinity(0))[1])
        decode = _in_thread(lambda: (place_engine_thread(1, environ=cores.decode_env, lock_dir=str(tmp_path)).release(),
                                     os.sched_getaffinity(0))[1])
        return before, os.sched_getaffinity(0), child, started, yielding, decode

    before, narrowed, child, started, yielding, decode = _in_thread(driver)
    assert before == set(HOST_CORES) and narrowed == started == set(cores.rest)
    assert child == str(sorted(cores.rest))  # a process it starts inherits it
    assert yielding == set(HOST_CORES)  # a prefill engine: every core again, at SCHED_IDLE
    assert decode == set(cores.decode)  # a decode engine: its own core
    assert keep_off(None) == os.sched_getaffinity(0) == set(HOST_CORES)  # no plan: nothing changes


def test_auto_places_only_when_every_engine_thread_has_a_core():
    # 1P1D with a thread each on 2 cores: placed. 2P1D: three engine threads on two cores,
    # where a reserved core would leave two yielding prefill engines one core's leftovers.
    assert plan(1, 3, "auto", [0, 1]) is None
    assert plan(1, 3, "own", [0, 1]).decode == (1,)
    assert plan(1, 3, "auto", [0, 1, 2]).decode == (2,)
    assert plan(1, 2, "shared", [0, 1]) is None


def test_a_claimed_core_is_nobody_elses_until_released(tmp_path):
    first = claim_cores(1, [3, 4], str(tmp_path))
    assert first.cores == (3,)
    second = claim_cores(1, [3, 4], str(tmp_path))
    assert second.cores == (4,)
    assert claim_cores(1, [3, 4], str(tmp_path)) is None  # both held
    assert claim_cores(2, [3, 4, 5], str(tmp_path)) is None  # one free is not two: and the one is left free
    assert claim_cores(1, [5], str(tmp_path)).cores == (5,)
    first.release()
    assert claim_cores(1, [3, 4], str(tmp_path)).cores == (3,)


def test_the_core_of_a_killed_engine_process_is_free_again(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from cluster.host.engine_cores import claim_cores; "
         f"c = claim_cores(1, [7], {str(tmp_path)!r}); print(c.cores, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "(7,)"
        assert claim_cores(1, [7], str(tmp_path)) is None
    finally:
        holder.kill()
        holder.wait()
    assert claim_cores(1, [7], str(tmp_path)).cores == (7,)  # the kernel dropped the dead process's lock


def _in_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=fn()))
    thread.start()
    thread.join()
    return out["result"]


@several_cores
def test_a_decode_engine_thread_binds_itself_and_the_threads_it_starts(tmp_path):
    engine_core = HOST_CORES[-1]

    def engine_thread():
        placement = place_engine_thread(1, environ={CORES_ENV: str(engine_core)}, lock_dir=str(tmp_path))
        mine = os.sched_getaffinity(0)
        team = _in_thread(lambda: os.sched_getaffinity(0))  # as its OpenMP team would be
        second = place_engine_thread(1, environ={CORES_ENV: str(engine_core)}, lock_dir=str(tmp_path))  # another engine finds it held
        placement.release()
        return placement, mine, team, second, os.sched_getscheduler(0)

    placement, mine, team, second, policy = _in_thread(engine_thread)
    assert placement.cores == [engine_core] and not placement.yields and policy == os.SCHED_OTHER
    assert mine == team == {engine_core}
    assert second.cores is None  # unbound: it runs on any core
    assert os.sched_getaffinity(0) == set(HOST_CORES)  # other threads stay where they were


def test_a_prefill_engine_thread_yields_and_so_do_the_threads_it_starts(tmp_path):
    def engine_thread():
        placement = place_engine_thread(1, environ={YIELDS_ENV: "1"}, lock_dir=str(tmp_path))
        team = _in_thread(lambda: os.sched_getscheduler(0))
        return placement, os.sched_getscheduler(0), team, os.sched_getaffinity(0)

    placement, policy, team, cores = _in_thread(engine_thread)
    assert placement.yields and placement.cores is None
    assert policy == team == os.SCHED_IDLE
    assert cores == set(HOST_CORES)  # on every core
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # only that thread


def test_without_the_variables_an_engine_thread_stays_as_it_was(tmp_path):
    placement, cores, policy = _in_thread(
        lambda: (place_engine_thread(1, environ={}, lock_dir=str(tmp_path)), os.sched_getaffinity(0), os.sched_getscheduler(0)))
    assert (placement.cores, placement.yields, cores, policy) == (None, False, set(HOST_CORES), os.SCHED_OTHER)
    on_gpu = place_engine_thread(1, "cuda", environ={CORES_ENV: str(HOST_CORES[-1]), YIELDS_ENV: "1"}, lock_dir=str(tmp_path))
    assert on_gpu.info() == {"cores": None, "yields": False}  # the GPU's host threads are left alone


@several_cores
def test_a_kv_receive_thread_started_off_the_decode_cores_runs_on_every_core_under_its_name():
    cores = plan(1, 2, "own")

    def driver():
        keep_off(cores)  # the decode worker's process starts on the other cores

        def receiver():
            share_decode_cores("kv-recv", cores.decode_env)
            with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
                return f.read().strip(), os.sched_getaffinity(0)

        plain = _in_thread(lambda: share_decode_cores("plain", {}) or os.sched_getaffinity(0))  # no plan: only named
        return _in_thread(receiver), plain

    (name, receiving), plain = _in_thread(driver)
    assert name == "kv-recv" and receiving == set(HOST_CORES)
    assert plain == set(cores.rest)


def _config(threads: int, replicas: int = 1, engine_cores: str = "own", colocated: bool = False,
            prefill_replicas: int = 1) -> ClusterConfig:
    return ClusterConfig(engine=EngineConfig(model="unused"), colocated=colocated, engine_cores=engine_cores,
                         prefill=TierConfig(num_replicas=prefill_replicas, torch_threads=threads),
                         decode=TierConfig(num_replicas=replicas, torch_threads=threads))


def test_the_serve_driver_plans_for_every_engine_thread_and_only_on_cpu():
    n = len(HOST_CORES)
    assert engine_cores_of(_config(1)) == plan(1, 2, "own")
    assert engine_cores_of(_config(1, replicas=n)) is None  # every core a decode thread's: none to spare
    assert engine_cores_of(_config(1, engine_cores="shared")) is None
    assert ClusterConfig(engine=EngineConfig(model="unused")).engine_cores == "auto"
    # auto counts the prefill tier's threads too (none when colocated).
    assert engine_cores_of(_config(1, engine_cores="auto", prefill_replicas=n)) is None
    assert engine_cores_of(_config(1, engine_cores="auto", prefill_replicas=n, colocated=True)) == plan(1, 1, "auto")
    gpu = _config(1)
    gpu = ClusterConfig(engine=EngineConfig(model="unused", device="cuda"), decode=gpu.decode)
    assert engine_cores_of(gpu) is None
    with pytest.raises(ValueError, match="engine_cores must be one of"):
        _config(1, engine_cores="mine")


@several_cores
def test_the_decode_tier_is_told_its_cores_and_the_prefill_tier_to_yield():
    config = on_this_machine(_config(1))
    assert config.decode.env[CORES_ENV] == str(HOST_CORES[-1]) and YIELDS_ENV not in config.decode.env
    assert config.prefill.env[YIELDS_ENV] == "1" and CORES_ENV not in config.prefill.env
    shared = on_this_machine(_config(1, engine_cores="shared"))
    assert not {CORES_ENV, YIELDS_ENV} & {*(shared.decode.env or {}), *(shared.prefill.env or {})}
