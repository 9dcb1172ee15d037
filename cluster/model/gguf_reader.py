"""GGUFReader (the `gguf` package's), with its metadata parsed over a plain ndarray view
of the file's map.

GGUFReader slices its np.memmap once per value it parses, and every memmap slice costs
microseconds of Python (memmap.__getitem__ and __array_finalize__). A 49k-token vocabulary
with its merges is ~250k slices: opening the built-in model took 5 s, in every process
that opens it (the serve driver, each worker replica, each gateway). Over a plain view of
the same map the parse takes a third of that; fields and tensors are the same, tensor
data still mapped from the file (tests/integration/test_gguf.py checks both readers agree).
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader


class MappedGGUFReader(GGUFReader):
    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        # GGUFReader._get (gguf 0.19), on `self.data` viewed as a plain ndarray.
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        values = plain[offset:end].view(dtype=dtype)[:count]
        return values.view(values.dtype.newbyteorder(self.byte_order if override_order is None else override_order))
