"""What must be equal on every tensor-parallel rank for captures to line up, and how they differ.

Each backend describes its own plan (``CudaGraphBackend.plan_fingerprint``); a session adds what
is process-wide (the plugin version, the pool, the custom all-reduce) and the warm-up decision of
this session (``warmups.py``), and the ranks compare the whole at the ``plan`` point. Lists too
long to print usefully are replaced by their length and a digest, so that a post stays small
whatever the sizes (``channel.MAX_POST_BYTES``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

#: Lists up to this long are compared (and shown in a mismatch) in full.
FULL_LIST = 64


def compact(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and len(value) > FULL_LIST:
        text = json.dumps(list(value), separators=(",", ":"), default=str)
        return f"{len(value)} entries, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if isinstance(value, (list, tuple)):
        return list(value)
    return value


def backends_plan(fingerprints: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each backend's fingerprint, its keys prefixed with the backend's place."""
    return {
        f"backend{index}.{key}": compact(value)
        for index, fingerprint in enumerate(fingerprints)
        for key, value in fingerprint.items()
    }


def plan_diff(fingerprints: list[dict[str, Any]]) -> list[str]:
    """One line per rank whose plan differs from rank 0's, naming each differing key."""
    lines = []
    reference = fingerprints[0]
    for rank, fingerprint in enumerate(fingerprints[1:], start=1):
        keys = sorted(set(reference) | set(fingerprint))
        diffs = [
            f"{key}: rank 0 {_short(reference.get(key))} vs rank {rank} "
            f"{_short(fingerprint.get(key))}"
            for key in keys
            if reference.get(key) != fingerprint.get(key)
        ]
        if diffs:
            lines.append(f"rank {rank}: " + "; ".join(diffs[:8]) + ("; ..." if diffs[8:] else ""))
    return lines


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
