"""llama.cpp's side of `pdserve bench engine --llama-cpp-python PYTHON`: run by that Python
(a venv with llama-cpp-python, apart from pdserve's), so this file imports nothing of
pdserve's. argv: the GGUF file, threads, context length. On stdin, one JSON line per run:
{"prompt": [token ids], "output_len": n}; on stdout one JSON line each: the prompt's eval
time and the time of each following one-token eval (greedy: the argmax of the last
logits, as pdserve's greedy decode), which is llama.cpp's batch-1 decode step."""

import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def main() -> None:
    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=n_ctx,
                logits_all=False, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        llm.reset()
        start = time.perf_counter()
        llm.eval(job["prompt"])
        prefill_s = time.perf_counter() - start
        steps = []
        for _ in range(job["output_len"] - 1):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            t = time.perf_counter()
            llm.eval([token])
            steps.append(time.perf_counter() - t)
        print(json.dumps({"prefill_s": prefill_s, "steps_s": steps}), flush=True)


if __name__ == "__main__":
    main()
