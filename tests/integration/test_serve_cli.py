"""`pdserve serve` as an operator runs it: a local Ray, a private redis-server, both
tiers up; `pdserve status` reports them; Ctrl-C stops everything."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time

import grpc
import openai
import psutil
import pytest

from cluster.host import engine_cores
from cluster.host.bind_policy import is_loopback
from cluster.host.openmp import usable_cpus, waiting_env
from cluster.launch.ingress import resolve
from cluster.launch.lifetime import POLL_S
from cluster.launch.ports import free_port, port_free
from decode_worker.worker import RECEIVER_NAME
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import PDSERVE, wait_until


def read_until(proc, pattern, timeout_s):
    """Lines of the process's stderr up to the first matching `pattern`."""
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"no {pattern!r} within {timeout_s}s:\n{''.join(lines[-40:])}")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening socket of the process `pid` and its descendants."""
    tree = {pid} | {p.pid for p in psutil.Process(pid).children(recursive=True)}
    return {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in tree}


def stream_text(client, out: dict) -> None:
    """A long greedy stream; `out` gets its chunks, then "finish" or the error it ended with."""
    out["chunks"] = 0
    try:
        for chunk in client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=400,
                                               temperature=0.0, stream=True, extra_body={"ignore_eos": True}):
            out["chunks"] += 1
            out["finish"] = chunk.choices[0].finish_reason or out.get("finish")
    except Exception as e:  # noqa: BLE001 - what the client saw is the result
        out["error"] = e


def _threads(process: psutil.Process) -> list:
    try:
        return process.threads()
    except psutil.Error:  # it ended meanwhile
        return []


# A decode worker's KV receives run on every core (cluster/host/engine_cores.py): its receiver
# threads, and gloo's I/O threads, which the first receive of a pair starts and which inherit its cores.
KV_RECEIVE_THREADS = {RECEIVER_NAME, "gloo_tcp_loop", "pt_gloo_runloop"}


def _thread_name(pid: int, thread_id: int) -> str | None:
    try:
        with open(f"/proc/{pid}/task/{thread_id}/comm") as f:
            return f.read().strip()
    except OSError:  # it ended meanwhile
        return None


def _placement(thread_id: int) -> tuple[set[int], int] | None:
    """A thread's cores and scheduling policy (None: it ended meanwhile)."""
    try:
        return os.sched_getaffinity(thread_id), os.sched_getscheduler(thread_id)
    except OSError:
        return None


@pytest.mark.parametrize(
    ("stop_signal", "ingress", "host", "torch_threads", "kv_cache_dtype"),
    [(signal.SIGINT, "auto", "127.0.0.1", 1, "auto"), (signal.SIGTERM, "proxy", "0.0.0.0", 2, "bfloat16")],
    ids=["SIGINT-default-ingress", "SIGTERM-proxy-ingress-public-bf16-kv"],
)
def test_serve_status_and_clean_stop(tiny_llama, tmp_path, stop_signal, ingress, host, torch_threads, kv_cache_dtype):
    """Ctrl-C (SIGINT, even when it arrives ignored) or SIGTERM stops everything and exits
    0; a stream running at that moment drains: it ends with its finish reason. Through
    either ingress: the default (direct, where Serve ships HAProxy) and Serve's proxies; the
    second with a bf16 KV cache under the float32 model, its prompts handed off between tiers.
    Nothing listens beyond --host: by default every socket of the process tree is on
    loopback; with --host 0.0.0.0 only the HTTP and gRPC API ports are public.
    Replicas whose torch threads outnumber the cores wait passively at OpenMP barriers; by
    default (`--engine-cores auto`), where every engine thread has a core and the decode
    engine's leave one to spare, the decode engine gets cores of its own, and the prefill
    engine yields."""
    http_port, grpc_port = free_port(), free_port()
    key_file = tmp_path / "keys"
    key_file.write_text("sk-from-file\n")
    proc = subprocess.Popen(
        [*PDSERVE, "serve", "--model", str(tiny_llama), "--dtype", "float32", "--http-port", str(http_port),
         "--grpc-port", str(grpc_port), "--served-model-name", "tiny", "--api-key-file", str(key_file), "--ingress", ingress,
         "--torch-threads", str(torch_threads), "--kv-cache-dtype", kv_cache_dtype, "--host", host],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        # As `pdserve serve &` from a script: SIGINT arrives ignored; Ctrl-C must still stop it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        lines = read_until(proc, r"Ctrl-C stops it", timeout_s=240)
        assert f"ingress: {resolve(ingress)}." in lines[-1]
        reach = "this host only (loopback)" if host == "127.0.0.1" else "the network (0.0.0.0)"
        assert f"API reachable from {reach}, every other port of the cluster on loopback; auth: API key required (1 key)" in lines[-2]
        public = {(address, port) for address, port in listeners(proc.pid) if not is_loopback(address)}
        assert {port for _, port in public} == (set() if host == "127.0.0.1" else {http_port, grpc_port}), public
        # Ready for the openai SDK, with the key from the file.

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="sk-from-file", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="wrong", max_retries=0).models.list()
        assert port_open(grpc_port)
        redis_port = int(re.search(r"redis://127\.0\.0\.1:(\d+)", "".join(lines)).group(1))
        assert port_open(redis_port)
        status = subprocess.run([*PDSERVE, "status"], capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        stats = json.loads(status.stdout)
        assert len(stats["prefill"]) == 1 and len(stats["decode"]) == 1
        (decode,) = stats["decode"].values()
        assert decode["used_blocks"] == 0 and decode["num_blocks"] > 0
        assert decode["kv_cache_dtype"] == {"auto": "float32", "bfloat16": "bfloat16"}[kv_cache_dtype]  # auto: the model's
        if ingress == "proxy":
            # Serve's gRPC proxy may lose a cancel that lands while it writes a message (README
            # Limitations): the request may then run to its end, but no block is lost either way.
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                call = pb_grpc.GenerationStub(channel).Generate(
                    pb.GenerateRequest(text="Hi", params=pb.SamplingParameters(max_tokens=400, temperature=0, ignore_eos=True)),
                    metadata=(("authorization", "Bearer sk-from-file"),))
                next(call)
                call.cancel()

            def blocks_in_use() -> int:
                out = subprocess.run([*PDSERVE, "status"], capture_output=True, text=True, timeout=120)
                return sum(w["used_blocks"] for tier in json.loads(out.stdout).values() for w in tier.values())

            assert wait_until(lambda: blocks_in_use() == 0, timeout_s=120, interval_s=1)
        # A reader that stops before the output comes (`pdserve status | head`) is no error.
        piped = subprocess.run(f"{shlex.join(PDSERVE)} status | head -c 0", shell=True, capture_output=True, text=True,
                               timeout=120)
        assert "error" not in piped.stderr.lower() and "Traceback" not in piped.stderr, piped.stderr
        # One prefill and one decode replica: through Ray's runtime_env into each worker process.
        wait = waiting_env(2 * torch_threads, usable_cpus())
        ranks = [rank for tier in ("prefill", "decode") for worker in stats[tier].values() for rank in worker["ranks"]]
        assert [(r["torch_threads"], r["openmp_wait"]) for r in ranks] == [(torch_threads, wait)] * 2
        # Where every engine thread has a core and the decode engine's leave one to spare, the
        # decode engine's thread has its own, and the prefill engine's yields to everything
        # else (cluster/host/engine_cores.py).
        cores = engine_cores.plan(torch_threads, 2 * torch_threads)
        assert [(r["cores"], r["yields"]) for r in ranks] == [(None, bool(cores)), (list(cores.decode) if cores else None, False)]
        prefill, decode = (psutil.Process(r["pid"]) for r in ranks)
        assert decode.cpu_affinity() == list(cores.rest if cores else engine_cores.HOST_CORES)  # the main thread: off them
        assert any(cores and os.sched_getaffinity(t.id) == set(cores.decode) for t in decode.threads()) == bool(cores)
        assert any(os.sched_getscheduler(t.id) == os.SCHED_IDLE for t in prefill.threads()) == bool(cores)
        if cores:  # nothing else of the cluster may run there: the decode engine's, its KV receives and yielding threads
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            placed = [(p.pid, _thread_name(p.pid, t.id), t.id, _placement(t.id)) for p in tree for t in _threads(p)]
            receivers = [pl for pid, name, _, pl in placed if pid == decode.pid and name == RECEIVER_NAME]
            assert receivers and all(pl is None or pl[0] == set(cores.host) for pl in receivers)  # ("hi" was handed off)
            stray = [(pid, name, tid, pl) for pid, name, tid, pl in placed if pl and pl[0] & set(cores.decode)
                     and pl[0] != set(cores.decode) and pl[1] != os.SCHED_IDLE
                     and not (pid == decode.pid and name in KV_RECEIVE_THREADS)]
            assert stray == [] and len(placed) > 100, stray
        # A hung worker does not hang the status: it lists the others and names what is missing.
        prefill.suspend()
        try:
            status = subprocess.run([*PDSERVE, "status"], capture_output=True, text=True, timeout=120)
        finally:
            prefill.resume()
        assert status.returncode == 0, status.stderr
        stats = json.loads(status.stdout)
        assert stats["prefill"] == {} and len(stats["decode"]) == 1
        assert "1 running prefill replica(s) did not answer within" in status.stderr
        running: dict = {}
        streaming = threading.Thread(target=stream_text, args=(client, running))
        streaming.start()
        deadline = time.monotonic() + 60
        while running.get("chunks", 0) < 3 and time.monotonic() < deadline and streaming.is_alive():
            time.sleep(0.01)
        started = psutil.Process(proc.pid).children(recursive=True)  # Ray's, HAProxy, redis-server, the reaper
        proc.send_signal(stop_signal)
        streaming.join(timeout=120)
        assert "error" not in running and running.get("finish") == "length", running  # drained, not cut
        assert proc.wait(timeout=120) == 0
        assert not port_open(redis_port)  # the private redis-server went with it
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]  # and everything else it had started
    finally:
        if proc.poll() is None:
            proc.kill()
            pytest.fail(f"pdserve serve did not stop on {stop_signal.name}")


def test_ctrl_c_while_starting_stops_everything_without_a_traceback(tiny_llama):
    """Interrupted while Serve deploys the app: the same clean stop (the private redis-server
    and the HTTP port are freed), exit 130 as a shell reports Ctrl-C."""
    http_port = free_port()
    proc = subprocess.Popen(
        [*PDSERVE, "serve", "--model", str(tiny_llama), "--dtype", "float32", "--http-port", str(http_port),
         "--grpc-port", str(free_port())],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    try:
        lines = read_until(proc, r"Deploying new version of Deployment", timeout_s=120)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
    finally:
        proc.kill()
    stderr = "".join(lines) + rest
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "pdserve is up" not in stderr
    redis_port = int(re.search(r"redis://127\.0\.0\.1:(\d+)", stderr).group(1))
    assert not port_open(redis_port) and not port_open(http_port)


@pytest.mark.parametrize("kill", ["SIGKILL", "group-SIGTERM"])
def test_a_killed_serve_leaves_no_process_behind(tiny_llama, kill):
    """kill -9 of `pdserve serve`: every process it had started goes (Ray's, Serve's HAProxy
    holding the ports, the private redis-server, the reaper itself; cluster/launch/lifetime.py).
    SIGTERM to its whole process group (systemd's KillMode=control-group, a container
    runtime), which kills Ray's own processes under it at once: it stops by itself, with
    status 143, and leaves nothing either (it once waited on the dead GCS for a minute, then
    exited 1)."""
    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [*PDSERVE, "serve", "--model", str(tiny_llama), "--dtype", "float32", "--http-port", str(http_port),
         "--grpc-port", str(grpc_port), "--drain-timeout-s", "5"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    try:
        read_until(proc, r"Ctrl-C stops it", timeout_s=240)
        time.sleep(2 * POLL_S)  # the reaper has noted every process of the running cluster
        started = psutil.Process(proc.pid).children(recursive=True)
        assert any("haproxy" in p.name() for p in started)  # the default ingress: the one that stayed before
        if kill == "SIGKILL":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGTERM)
            _, rest = proc.communicate(timeout=120)  # a stop that waits on the dead GCS would run into this
            assert proc.returncode == 128 + signal.SIGTERM, rest[-3000:]
    finally:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(started, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert not port_open(http_port) and not port_open(grpc_port)


def test_serve_refuses_a_public_host_without_api_keys():
    """An API on the network needs keys, or the operator's explicit word; refused before
    anything starts."""
    result = subprocess.run([*PDSERVE, "serve", "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--host 0.0.0.0 puts the API on the network: give it API keys" in result.stderr
    assert "--allow-unauthenticated" in result.stderr


def test_serve_refuses_an_empty_api_key_file(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# no keys yet\n")
    result = subprocess.run([*PDSERVE, "serve", "--api-key-file", str(empty)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "holds no keys" in result.stderr


def test_serve_refuses_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([*PDSERVE, "serve", "--http-port", str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"HTTP port {port} is in use" in result.stderr


def test_a_port_whose_server_just_stopped_is_free():
    """A server stopped a moment ago leaves its accepted connections in TIME_WAIT for a
    minute; `pdserve serve` restarted at once must not call its port in use (a fresh
    server binds it, with SO_REUSEADDR as servers set it)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not port_free("127.0.0.1", port)  # listening: in use
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server closes first: its end of the connection stays in TIME_WAIT
        client.recv(1)
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):  # the TIME_WAIT is there: a plain bind is refused
        plain.bind(("127.0.0.1", port))
    assert port_free("127.0.0.1", port)


def test_serve_refuses_a_tensor_parallel_size_the_model_cannot_split():
    """The built-in SmolLM2 has 9 attention heads and 3 KV heads: not over 2 ranks."""
    result = subprocess.run([*PDSERVE, "serve", "--decode-tp", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "cannot split 9 attention heads, 3 KV heads (neither divides the other) over 2 tensor-parallel ranks" in result.stderr
