"""pdserve's shared core: configuration, engine, model, KV cache, transport, index.

Importing it first applies PDSERVE_CPU_DISABLE to torch (cluster/host/cpu_features.py): oneDNN
and ATen read their ISA caps once, when torch first needs them, so the caps must be in
the environment before any module here imports torch; processes started afterwards
(Ray's workers) inherit them.
"""

from cluster.host.cpu_features import CpuCapabilityError, apply_isa_limits

try:
    apply_isa_limits()
except CpuCapabilityError:
    pass  # reported where the capabilities are first read (cpu_features.detect), e.g. as the CLI's one-line error
