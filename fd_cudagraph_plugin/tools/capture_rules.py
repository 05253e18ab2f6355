"""FastDeploy's capture-size rules and limits, as ``plan`` and ``tune`` apply them.

Written from FastDeploy's ``fastdeploy/config.py`` (develop ``r3_mm_dev`` and 2.6 ``r3_eos_2.6``)
so the tools run on any machine, FastDeploy installed or not. See ``plan.py`` for the order in
which ``FDConfig`` applies them.
"""

from __future__ import annotations

#: FastDeploy never captures a decode size above this many requests.
DECODE_CAP = 512
#: ``FDConfig.check`` asserts ``max_num_seqs <= 512``.
MAX_NUM_SEQS = 512
#: ``SpeculativeConfig.check_legality_parameters`` asserts k in 1..5 for every method but naive.
MAX_SPECULATIVE_TOKENS = 5
#: FastDeploy sets no bound on ``max_capture_shape_prefill``, but its prefill padding map holds one
#: entry per token up to it in every process; past this the plan (which prints that map) refuses
#: rather than allocate gigabytes. It is 8x the V1 scheduler's default ``max_num_batched_tokens``.
MAX_PREFILL_SHAPE = 65536
SPLITWISE_ROLES = ("mixed", "prefill", "decode")
#: ``--spec-method`` values FastDeploy accepts; the first three scale the decode sizes.
SPEC_METHODS = ("mtp", "ngram", "suffix", "naive")
SCALING_METHODS = ("mtp", "ngram", "suffix")
#: ``cudagraph_capture_sizes_prefill`` when the decode sizes are given by the user.
DEFAULT_PREFILL_SIZES = (1, 2, 4, 8)


def auto_candidates() -> list[int]:
    """FastDeploy's ``_set_cudagraph_sizes`` candidates, ascending (the code's ``range(9, 33)``)."""
    return [1, 2, 4, *(8 * i for i in range(1, 17)), *(16 * i for i in range(9, 17))] + [
        32 * i for i in range(9, 33)
    ]


def default_capture_sizes(max_size: int) -> list[int]:
    """The automatic decode list for a cap of ``max_size`` tokens, descending and deduplicated.

    Equal to FastDeploy's derived list for ``max_num_seqs = max_size`` when ``max_size <= 512``
    and no speculative decoding.
    """
    return sorted({s for s in auto_candidates() if s <= max_size} | {max_size}, reverse=True)


def fastdeploy_padding_map(sizes_desc: list[int]) -> dict[int, int]:
    """``real_shape_to_captured_size`` as FastDeploy builds it from a descending list.

    Each descending pair ``(end, start)``, with 0 after the last size, maps ``start`` to itself and
    ``start + 1 .. end - 1`` to ``end``; then the largest size (0 for an empty list) maps to
    itself.
    """
    mapping: dict[int, int] = {}
    for end, start in zip(sizes_desc, [*sizes_desc[1:], 0]):  # noqa: B905 (empty: no pairs)
        mapping[start] = start
        for shape in range(start + 1, end):
            mapping[shape] = end
    largest = sizes_desc[0] if sizes_desc else 0
    mapping[largest] = largest
    return dict(sorted(mapping.items()))


def fastdeploy_bsz_map(sizes_desc: list[int], k: int) -> dict[int, int]:
    """``real_bsz_to_captured_size``: running requests -> captured token size (k != 0 only).

    Each size c maps ``int(c / (k + 1))`` to c; walking the descending list, the smallest size of
    a request count is the one kept. Missing counts take the next larger count's size.
    """
    if k == 0:
        return {}
    mapping: dict[int, int] = {}
    for size in sizes_desc:
        mapping[int(size / (k + 1))] = size
    if not mapping:
        return {}
    top = max(mapping)
    larger = mapping[top]
    for bsz in range(top, 0, -1):
        larger = mapping.setdefault(bsz, larger)
    return dict(sorted(mapping.items()))
