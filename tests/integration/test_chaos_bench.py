"""`pdserve bench chaos` end to end, as an operator runs it: a local 1P2D cluster on a
small random checkpoint, a real fault of the busiest decode replica under streaming load
(its whole Ray node, or its process), a quarter of the requests dropped by the client. Its
verdict must be right both ways: a pass when migration hides the fault, a fail when
migration is switched off."""

import json
import subprocess

from tests.helpers import PDSERVE


def run_chaos(model, out_dir, *extra) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(
        [
            # a cache that holds the load's streams at once: at 0.02 GiB the surviving decode
            # replica ran them one or two at a time, and the run took twice as long
            *PDSERVE, "bench", "chaos", "--target", "1p2d", "--local-model", str(model), "--kv-cache-gib", "0.1",
            # Arrivals spread over seconds (4/s) and 400-token streams of the wide model (seconds
            # each; the tiny one's could all end between the stats call that picks the victim
            # and the kill): at the kill (1.5 s) every request sent so far is still streaming.
            "--dataset-name", "random", "--random-input-len", "48", "--random-output-len", "400", "--ignore-eos",
            "--request-rate", "4", "--result-dir", str(out_dir), "--disable-tqdm",
            # A kill breaks the streams at once; the stall timeout is for hung replicas, and a
            # migrated stream that waits for its re-prefill on 2 busy cores must not move again.
            "--stall-timeout-s", "60",
            *extra,
            *([] if "--kill" in extra else ["--kill", "decode:SIGKILL@1.5s"]),
        ],
        capture_output=True, text=True, timeout=600,
    )
    return proc, json.loads((out_dir / "chaos.json").read_text())


def test_a_decode_node_lost_under_load_costs_no_request_and_no_block(wide_model, tmp_path):
    """--nodes: each replica on a Ray node of its own; the busiest decode replica's whole
    node dies (raylet and all), and a fresh node takes its replacement. (A killed replica
    process, SIGKILL: the next test, and tests/e2e/test_faults.py.)"""
    proc, chaos = run_chaos(wide_model, tmp_path, "--num-prompts", "16", "--abort-ratio", "0.25", "--nodes",
                            "--kill", "decode:NODE@1.5s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (fault,) = chaos["faults"]
    assert fault["tier"] == "decode" and fault["signal"] == "NODE" and fault["requests"] > 0
    assert fault["node"] != fault["replacement"]
    assert chaos["failed"] == 0 and chaos["mismatched"] == 0 and chaos["leaked_blocks"] == {}
    assert chaos["aborted"] > 0 and chaos["completed"] + chaos["aborted"] == 16
    assert chaos["migrated"] >= 1
    assert chaos["replicas_at_end"] == {"prefill": 1, "decode": 2}  # the replacement runs on the new node
    assert "PASS" in proc.stdout and (tmp_path / "chaos.png").stat().st_size > 0


def test_without_migration_the_same_kill_is_reported_as_failed_requests(wide_model, tmp_path):
    proc, chaos = run_chaos(wide_model, tmp_path, "--num-prompts", "8", "--migration-limit", "0")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert chaos["faults"][0]["requests"] > 0
    assert chaos["failed"] >= 1 and chaos["migrated"] == 0
    assert chaos["leaked_blocks"] == {}  # the broken streams' blocks were freed all the same
    assert "FAIL" in proc.stdout
