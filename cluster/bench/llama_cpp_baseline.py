"""llama.cpp as a baseline beside the pdserve engine (`pdserve bench engine
--llama-cpp-python PYTHON`): the same GGUF file, the same threads, the same token ids,
batch 1. llama-cpp-python builds llama.cpp from source and pins its own dependencies, so it
lives in a venv of its own; its Python runs llama_cpp_worker.py, kept alive across rounds
(the model loads once) and asked for one run at a time."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

WORKER = Path(__file__).with_name("llama_cpp_worker.py")


class LlamaCppBaseline:
    def __init__(self, python: str, model: str, threads: int, n_ctx: int):
        if Path(model).suffix != ".gguf":
            raise ValueError("the llama.cpp baseline reads GGUF files only")
        self.process = subprocess.Popen([python, str(WORKER), model, str(threads), str(n_ctx)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self._read()  # {"ready": true}, once the model is loaded

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker exited ({self.process.wait()}): its error is above")
        return json.loads(line)

    def run(self, prompt: list[int], output_len: int) -> dict:
        """One batch-1 run: the same fields as engine_bench.bench_pdserve's."""
        self.process.stdin.write(json.dumps({"prompt": prompt, "output_len": output_len}) + "\n")
        self.process.stdin.flush()
        result = self._read()
        steps = result["steps_s"]
        total = result["prefill_s"] + sum(steps)
        return {
            "total_s": total,
            "prefill_s": result["prefill_s"],
            "decode_step_ms_mean": 1e3 * statistics.mean(steps),
            "decode_step_ms_median": 1e3 * statistics.median(steps),
            "output_tokens": output_len,
            "output_throughput": output_len / total,
            "decode_throughput": 1 / statistics.mean(steps),
        }

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)
