"""Capture-size lists and the padding tables derived from them.

FastDeploy hands over ``real_shape_to_captured_size`` as a dict, but after
``filter_capture_size`` (sequence-parallel MoE with TP > 1) that dict still maps token counts to
sizes that were removed from the list. The tables here are derived from the size lists alone, so
they can only name sizes that will really be captured.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def padding_table(sizes: Iterable[int]) -> list[int]:
    """Index ``n`` (0..max) gives the smallest size >= n; index 0 gives 0.

    Building it once makes padding a single list index on the replay path.
    """
    ascending = sorted(set(sizes))
    if not ascending:
        return [0]
    table = [0] * (ascending[-1] + 1)
    lower = 0
    for size in ascending:
        for n in range(lower + 1, size + 1):
            table[n] = size
        lower = size
    return table


def table_disagreements(
    table: list[int], upstream: Mapping[int, int] | None
) -> list[tuple[int, int, int]]:
    """Return ``(tokens, upstream_size, our_size)`` where FastDeploy's map differs from ours."""
    if not upstream:
        return []
    found = []
    for raw_key, raw_value in upstream.items():
        tokens, size = int(raw_key), int(raw_value)
        ours = table[tokens] if 0 <= tokens < len(table) else -1
        if ours != size:
            found.append((tokens, size, ours))
    return sorted(found)
