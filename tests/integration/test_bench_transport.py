"""`pdserve bench transport` as an operator runs it: both paths measured between real
processes, each the path it names (the sender checks which one the transport takes)."""

import json
import subprocess

import pytest

from tests.helpers import PDSERVE


def test_both_paths_are_measured_and_saved_with_their_payloads(tmp_path):
    proc = subprocess.run(
        [*PDSERVE, "bench", "transport", "--blocks", "1,4", "--transfers", "2", "--layers", "2", "--result-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "transport.json").read_text())
    block_bytes = 2 * 2 * 16 * 3 * 64 * 2  # layers, K and V, block size, KV heads, head dim, bf16
    assert result["geometry"]["block_bytes"] == block_bytes and result["cpu"]
    runs = {(r["path"], r["blocks"]): r for r in result["runs"]}
    assert set(runs) == {(p, n) for p in ("shared_memory", "sockets") for n in (1, 4)}
    for (_, n), r in runs.items():
        assert r["payload_mb"] == n * block_bytes / 1e6 and r["transfers"] == 2
        assert r["gb_per_s"] == pytest.approx(r["payload_mb"] / r["median_ms"]) and r["gb_per_s"] > 0
    assert (tmp_path / "transport.png").stat().st_size > 0
