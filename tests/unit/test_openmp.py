"""The process's OpenMP rules (cluster/host/openmp.py): serial_torch makes a thread's torch ops
make no OpenMP team; workers whose threads outnumber the cores wait passively."""

import os
import threading

import pytest
import torch

from cluster.config import ClusterConfig, EngineConfig, TierConfig
from cluster.host.openmp import WAIT_SETTINGS, _libgomp, serial_torch, usable_cpus, wait_settings, waiting_env
from cluster.launch.app import tier_options
from cluster.launch.serve import compute_threads, on_this_machine

needs_libgomp = pytest.mark.skipif(_libgomp() is None, reason="torch runs on another OpenMP runtime than libgomp")


def _threads_made_by_a_thread_that_copies(serial: bool) -> int:
    """How many threads a fresh thread that does a large parallel copy (in serial_torch or
    not) adds to the process, itself included, counted while it is still alive."""
    before = set(os.listdir("/proc/self/task"))
    counted, done = [], threading.Event()

    def side():
        src, idx = torch.randn(2048, 2048), torch.arange(2048)
        out = torch.empty_like(src)
        if serial:
            with serial_torch():
                torch.index_select(src, 0, idx, out=out)
        else:
            torch.index_select(src, 0, idx, out=out)
        counted.append(len(set(os.listdir("/proc/self/task")) - before))
        done.wait()

    thread = threading.Thread(target=side)
    thread.start()
    while not counted:
        threading.Event().wait(0.01)
    done.set()
    thread.join()
    return counted[0]


@needs_libgomp
def test_serial_torch_makes_no_team_and_restores_the_thread_count(two_torch_threads):
    assert _threads_made_by_a_thread_that_copies(serial=False) > 1  # a team of its own
    assert _threads_made_by_a_thread_that_copies(serial=True) == 1  # itself alone
    with serial_torch():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2  # this thread's count is back


def test_serial_torch_computes_the_same_copy():
    src, idx = torch.randn(300, 64), torch.tensor([5, 0, 299, 17])
    with serial_torch():
        got = torch.index_select(src, 0, idx)
    assert torch.equal(got, src[idx])


def test_workers_wait_passively_only_when_their_threads_outnumber_the_cores():
    assert waiting_env(compute_threads=2, cpus=2, environ={}) == {}
    assert waiting_env(compute_threads=4, cpus=2, environ={}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    for users_choice in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}):
        assert waiting_env(compute_threads=4, cpus=2, environ=users_choice) == {}


def test_a_process_reports_the_wait_settings_of_its_environment(monkeypatch):
    for name in WAIT_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert wait_settings() == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # not a wait setting
    assert wait_settings() == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_local_cluster_that_oversubscribes_the_cores_gives_its_workers_passive_waiting(monkeypatch):
    for name in WAIT_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    cpus = usable_cpus()
    engine = EngineConfig(model="unused")
    fits = ClusterConfig(engine=engine, decode=TierConfig(torch_threads=cpus), colocated=True)
    assert compute_threads(fits) == cpus and on_this_machine(fits) == fits
    tier = TierConfig(torch_threads=cpus, env={"KEEP": "1"})
    over = on_this_machine(ClusterConfig(engine=engine, prefill=tier, decode=tier))  # 2 x cpus threads
    for t in (over.prefill, over.decode):
        assert tier_options(t)["ray_actor_options"]["runtime_env"] == {
            "env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "KEEP": "1"}}
    scaled = TierConfig(torch_threads=1, autoscaling={"min_replicas": 1, "max_replicas": 3})
    assert compute_threads(ClusterConfig(engine=engine, prefill=scaled, decode=TierConfig())) == 4
