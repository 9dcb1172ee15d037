"""Clients of the Redis that holds the prefix index and the rate-limit buckets.

The URL is redis-py's, with one addition: `?password_file=PATH` names a file holding the
password (a mounted secret on every node, as deploy/cluster.yaml does), so that the
password never travels in a config or an actor's arguments. `~` is the process's home.

    redis://10.0.0.5:6380/0?password_file=~/.pdserve/redis-password
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis

PASSWORD_FILE = "password_file"


def connect(url: str, **options) -> aioredis.Redis:
    """An asyncio client of `url` (not connected yet: the first command connects)."""
    address, password = split_password_file(url)
    return aioredis.Redis.from_url(address, **options, **({"password": password} if password is not None else {}))


def connect_sync(url: str, **options) -> redis.Redis:
    """A blocking client of `url`, for scripts and tests."""
    address, password = split_password_file(url)
    return redis.Redis.from_url(address, **options, **({"password": password} if password is not None else {}))


def split_password_file(url: str) -> tuple[str, str | None]:
    """(`url` without its password_file, the password read from it, or None)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    files = [value for key, value in query if key == PASSWORD_FILE]
    if not files:
        return url, None
    path = Path(files[-1]).expanduser()
    try:
        password = path.read_text().strip()
    except OSError as e:
        raise ValueError(f"the Redis password file {path} cannot be read: {e.strerror}") from None
    if not password:
        raise ValueError(f"the Redis password file {path} is empty")
    rest = urlencode([(key, value) for key, value in query if key != PASSWORD_FILE])
    return urlunsplit(parts._replace(query=rest)), password
