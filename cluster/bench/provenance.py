"""Where a benchmark result came from, saved in every result JSON: the CPU (its model and
the capabilities pdserve chooses by), the commit, and the command line. Figures from
different machines and commits must never be mistaken for one another."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cluster.host.cpu_features import cpu_summary

REPO = Path(__file__).resolve().parents[2]


def write_result(path: Path, result: dict) -> Path:
    """`result` as JSON at `path`, with its provenance (CPU, commit, command line) first."""
    path.write_text(json.dumps({**provenance(), **result}, indent=2, default=str))
    return path


def provenance() -> dict:
    return {"cpu": cpu_summary(), "commit": commit(), "command": command_line(sys.argv[1:])}


def command_line(argv: list[str]) -> str:
    """`pdserve ...` as run, with every secret's value (a --*key* or --*token* flag's) elided."""
    words, secret_next = ["pdserve"], False
    for word in argv:
        flag, eq, _ = word.partition("=")
        is_secret = flag.startswith("--") and ("key" in flag or "token" in flag)
        if secret_next:
            words.append("***")
        elif is_secret and eq:
            words.append(f"{flag}=***")
        else:
            words.append(word)
        secret_next = is_secret and not eq
    return " ".join(words)


def commit() -> str:
    """The checkout's commit, with `+changes` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
