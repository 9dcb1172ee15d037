"""API keys: optional; when set, every route and RPC but liveness, metrics and gRPC
health requires one. Keys are compared in constant time and never logged."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from router.errors import Unauthorized

ENV_VAR = "PDSERVE_API_KEY"  # one key, or several separated by commas


def load_api_keys(keys: list[str] | None = None, key_file: str | None = None, env: dict | None = None) -> tuple[str, ...]:
    """Keys from the command line, a file (one per line, # comments) and $PDSERVE_API_KEY."""
    found = list(keys or ())
    if key_file:
        in_file = [line.strip() for line in Path(key_file).expanduser().read_text().splitlines()]
        in_file = [k for k in in_file if k and not k.startswith("#")]
        if not in_file:  # an empty secret must not silently turn auth off
            raise ValueError(f"API key file {key_file} holds no keys")
        found += in_file
    found += [k.strip() for k in (env if env is not None else os.environ).get(ENV_VAR, "").split(",") if k.strip()]
    return tuple(dict.fromkeys(found))


class ApiKeyAuth:
    def __init__(self, api_keys: tuple[str, ...]):
        self._keys = [k.encode() for k in api_keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> str:
        """The caller's key from an `Authorization: Bearer <key>` value (HTTP header or
        gRPC metadata); raises Unauthorized. Without configured keys everyone passes."""
        if not self._keys:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode()
        if scheme.lower() != "bearer" or not presented:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        # Compare with every key (no early exit) so timing does not reveal which matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key)
        if not matched:
            raise Unauthorized("invalid API key")
        return token.strip()
