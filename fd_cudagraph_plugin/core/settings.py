"""A frozen, validated view of the FastDeploy config fields the backend uses, read once.

FastDeploy's config objects are mutable and, across 2.4 .. develop, not all fields exist. Reading
them once at construction gives the hot path plain attributes and gives the operator one error,
naming the field, the value and the fix, instead of a ``KeyError`` in the middle of serving.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.mode import Mode
from fd_cudagraph_plugin.core.options import PluginOptions
from fd_cudagraph_plugin.core.sizes import padding_table, table_disagreements

_GRAPH_CONFIG_FIX = "set it in --graph-optimization-config"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _size_list(name: str, value: object, *, required: bool) -> tuple[int, ...]:
    """Positive sizes, descending and deduplicated. A size 0 is dropped: FastDeploy itself puts
    one there (2.4 prepends 0 under expert parallelism; ``max_capture_shape_prefill: 0`` leaves
    a prefill list of [0]), and a 0-token step needs no graph."""
    if value is None and not required:
        return ()
    if not isinstance(value, (list, tuple)) or (required and not value):
        raise ConfigError(
            f"{name} must be a non-empty list of positive integers; got {value!r}. "
            f'{_GRAPH_CONFIG_FIX}, e.g. "{name.split(".")[-1]}": [1, 2, 4, 8].'
        )
    bad = [v for v in value if not _is_int(v) or v < 0]
    if bad:
        raise ConfigError(
            f"{name} must be positive integers (a 0 is ignored); got {list(value)!r} "
            f"(bad: {bad!r}). Remove or correct those entries."
        )
    sizes = tuple(sorted({v for v in value if v}, reverse=True))
    if required and not sizes:
        raise ConfigError(
            f"{name} holds no size above 0; got {list(value)!r}. {_GRAPH_CONFIG_FIX}, e.g. "
            f'"{name.split(".")[-1]}": [1, 2, 4, 8], or turn CUDA graphs off with '
            f'"use_cudagraph": false.'
        )
    return sizes


def _count(name: str, value: object, *, minimum: int, fix: str) -> int:
    if not _is_int(value) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}; got {value!r}. {fix}")
    return value


@dataclass(frozen=True)
class Ranks:
    """Where this process sits: read from ``fd_config`` once (``read_ranks``), for the backend's
    settings, the session's agreement link, file names and metric labels alike."""

    tp_rank: int
    tp_size: int
    #: The tensor-parallel group's global ranks (``paddle.distributed`` ranks).
    tp_group: tuple[int, ...]
    dp_rank: int
    dp_size: int


def read_ranks(fd_config: Any) -> Ranks:
    """``parallel_config``'s tensor- and data-parallel place. ``tp_group`` is a
    ``paddle.distributed`` group made with ``new_group(range(dp_rank * tp, (dp_rank + 1) * tp))``
    on every release; its ``rank`` is this process's rank in it."""
    parallel = getattr(fd_config, "parallel_config", None)
    tp_size = _count(
        "parallel_config.tensor_parallel_size",
        getattr(parallel, "tensor_parallel_size", 1),
        minimum=1,
        fix="Pass --tensor-parallel-size with a positive value.",
    )
    group = getattr(parallel, "tp_group", None)
    members = getattr(group, "ranks", None)
    if not isinstance(members, (list, tuple)) or len(members) != tp_size:
        members = range(tp_size)
    tp_rank = getattr(group, "rank", None)
    if not _is_int(tp_rank) or not 0 <= tp_rank < tp_size:
        tp_rank = getattr(parallel, "tensor_parallel_rank", 0)
    tp_rank = tp_rank if _is_int(tp_rank) and 0 <= tp_rank < tp_size else 0
    # 2.4 .. develop all have these two (worker_process.py sets the rank from the worker index).
    dp_rank = getattr(parallel, "data_parallel_rank", 0)
    dp_size = getattr(parallel, "data_parallel_size", 1)
    return Ranks(
        tp_rank=tp_rank,
        tp_size=tp_size,
        tp_group=tuple(int(r) for r in members),
        dp_rank=dp_rank if _is_int(dp_rank) and dp_rank >= 0 else 0,
        dp_size=dp_size if _is_int(dp_size) and dp_size >= 1 else 1,
    )


def _flag(value: object) -> bool:
    """FastDeploy reads its boolean settings by truth value and checks none of them; so do we."""
    return bool(value)


def _method_name(method: object) -> str | None:
    if method is None:
        return None
    # FastDeploy converts the method string to its SpecMethod enum; accept both.
    raw = getattr(method, "value", method)
    return str(raw).strip().lower() or None


@dataclass(frozen=True)
class Settings:
    """Everything the backend reads from ``fd_config`` and the environment."""

    capture_sizes: tuple[int, ...]
    prefill_sizes: tuple[int, ...]
    num_warmups: int
    graph_opt_level: int
    full_cuda_graph: bool
    only_prefill: bool
    max_capture_shape_prefill: int
    use_unique_memory_pool: bool
    speculative_method: str | None
    num_speculative_tokens: int
    max_num_seqs: int
    ranks: Ranks
    custom_allreduce_disabled: bool
    #: ``cache_config.gpu_memory_utilization``: FastDeploy's KV-cache budget, a share of the GPU.
    gpu_memory_utilization: float | None
    #: ``model_config.model``, its dtype and quantization: what the graphs are of (the
    #: graph-memory record is keyed by them).
    model_name: str
    dtype: str
    quantization: str
    #: FastDeploy 2.4: it hands the backend no dygraph runnable, its ForwardMeta has no
    #: ``exist_prefill``, and with ``graph_opt_level`` >= 1 it runs every graphed step as a
    #: Paddle-managed static graph (``run_static_model``), whatever ``full_cuda_graph`` says.
    fastdeploy_2_4: bool
    options: PluginOptions
    #: Index = a decode step's tokens, value = the captured size it pads to (0: none).
    decode_table: tuple[int, ...] = field(repr=False)
    #: Index = running requests, value = the captured size FastDeploy maps them to (speculative).
    bsz_table: tuple[int, ...] = field(repr=False)
    padding_disagreements: tuple[tuple[int, int, int], ...] = field(repr=False)
    #: The mode these settings configure (``mode.py``); a backend's may then be decided further.
    mode: Mode = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.of(self))

    @property
    def tp_rank(self) -> int:
        return self.ranks.tp_rank

    @property
    def tp_size(self) -> int:
        return self.ranks.tp_size

    @property
    def dp_rank(self) -> int:
        return self.ranks.dp_rank

    @property
    def dp_size(self) -> int:
        return self.ranks.dp_size

    @classmethod
    def from_fd_config(
        cls,
        fd_config: Any,
        options: PluginOptions | None = None,
        *,
        fastdeploy_2_4: bool = False,
    ) -> Settings:
        """``options``: the process's, read once (a worker's backends pass them); without them,
        the environment's now."""
        options = options if options is not None else PluginOptions.from_env()
        graph = getattr(fd_config, "graph_opt_config", None)
        if graph is None:
            raise ConfigError(
                "fd_config.graph_opt_config is missing; the backend must be built by FastDeploy's "
                "GraphOptBackend with a complete FDConfig."
            )
        sizes = _size_list(
            "graph_opt_config.cudagraph_capture_sizes",
            getattr(graph, "cudagraph_capture_sizes", None),
            required=True,
        )
        prefill = _size_list(
            "graph_opt_config.cudagraph_capture_sizes_prefill",
            getattr(graph, "cudagraph_capture_sizes_prefill", None),
            required=False,
        )
        warmups = getattr(graph, "cudagraph_num_of_warmups", 2)
        if not _is_int(warmups):
            raise ConfigError(
                f"graph_opt_config.cudagraph_num_of_warmups must be an integer; got {warmups!r}. "
                f"Use 0 or more; FastDeploy's default is 2. {_GRAPH_CONFIG_FIX}."
            )
        warmups = max(warmups, 0)  # FastDeploy runs range(n) warm-ups: none for n < 0
        level = getattr(graph, "graph_opt_level", 0)
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise ConfigError(
                f"graph_opt_config.graph_opt_level must be 0, 1 or 2; got {level!r}. "
                f"{_GRAPH_CONFIG_FIX}."
            )
        level = int(level)
        max_prefill = _count(
            "graph_opt_config.max_capture_shape_prefill",
            getattr(graph, "max_capture_shape_prefill", max(prefill, default=0)),
            minimum=0,
            fix=f"0 captures no prefill graph. {_GRAPH_CONFIG_FIX}.",
        )

        spec = getattr(fd_config, "speculative_config", None)
        method = _method_name(getattr(spec, "method", None))
        k = 0
        if method is not None and method != "naive":
            k = _count(
                "speculative_config.num_speculative_tokens",
                getattr(spec, "num_speculative_tokens", 0),
                minimum=0,
                fix="Set it in --speculative-config.",
            )

        scheduler = getattr(fd_config, "scheduler_config", None)
        max_num_seqs = _count(
            "scheduler_config.max_num_seqs",
            getattr(scheduler, "max_num_seqs", sizes[0]),
            minimum=1,
            fix="Pass --max-num-seqs with a positive value.",
        )
        parallel = getattr(fd_config, "parallel_config", None)
        model = getattr(fd_config, "model_config", None)

        decode_table = padding_table(sizes)
        bsz_table = _bsz_table(getattr(graph, "real_bsz_to_captured_size", None), decode_table)
        return cls(
            capture_sizes=sizes,
            prefill_sizes=prefill,
            num_warmups=warmups,
            graph_opt_level=level,
            full_cuda_graph=_flag(getattr(graph, "full_cuda_graph", True)),
            only_prefill=_flag(getattr(graph, "cudagraph_only_prefill", False)),
            max_capture_shape_prefill=max_prefill,
            use_unique_memory_pool=_flag(getattr(graph, "use_unique_memory_pool", True)),
            speculative_method=method,
            num_speculative_tokens=k,
            max_num_seqs=max_num_seqs,
            ranks=read_ranks(fd_config),
            custom_allreduce_disabled=bool(getattr(parallel, "disable_custom_all_reduce", False)),
            gpu_memory_utilization=_utilization(getattr(fd_config, "cache_config", None)),
            model_name=str(getattr(model, "model", "") or ""),
            dtype=str(getattr(model, "dtype", "") or ""),
            quantization=_quantization(fd_config),
            fastdeploy_2_4=fastdeploy_2_4,
            options=options,
            decode_table=tuple(decode_table),
            bsz_table=tuple(bsz_table),
            padding_disagreements=tuple(
                table_disagreements(
                    decode_table, getattr(graph, "real_shape_to_captured_size", None)
                )
            ),
        )


def _quantization(fd_config: object) -> str:
    """The quantization the weights run with: FastDeploy's ``quant_config`` (its ``name()``),
    else ``model_config.quantization``; "" for none."""
    quant = getattr(fd_config, "quant_config", None)
    name = getattr(quant, "name", None)
    if callable(name):
        try:
            return str(name())
        except Exception:
            return type(quant).__name__
    raw = getattr(getattr(fd_config, "model_config", None), "quantization", None)
    return "" if raw is None else str(raw)[:200]


def _utilization(cache_config: object) -> float | None:
    value = getattr(cache_config, "gpu_memory_utilization", None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        return None  # FastDeploy checks it; the memory figures then leave the advice out
    return float(value)


def _bsz_table(mapping: object, decode_table: list[int]) -> list[int]:
    """Index = running requests, value = captured token size (0 where none fits).

    Values are re-padded through the decode table, so a size removed by ``filter_capture_size``
    moves up to the next captured size instead of naming a graph that does not exist.
    """
    if not mapping:
        return []
    if not isinstance(mapping, Mapping):
        raise ConfigError(
            "graph_opt_config.real_bsz_to_captured_size must be a dict; "
            f"got {reprlib.repr(mapping)}. Leave the map to FastDeploy; it computes it."
        )
    pairs = []
    for raw_key, raw_value in mapping.items():
        try:
            bsz, size = int(raw_key), int(raw_value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"graph_opt_config.real_bsz_to_captured_size has a non-integer entry "
                f"{raw_key!r}: {raw_value!r} in {reprlib.repr(mapping)}. Leave the map to "
                "FastDeploy; it computes it."
            ) from None
        if bsz < 0 or size < 0:
            raise ConfigError(
                f"graph_opt_config.real_bsz_to_captured_size has a negative entry {bsz}: {size} "
                f"in {reprlib.repr(mapping)}. Leave the map to FastDeploy; it computes it."
            )
        pairs.append((bsz, size))
    table = [0] * (max(b for b, _ in pairs) + 1)
    for bsz, size in pairs:
        table[bsz] = decode_table[size] if size < len(decode_table) else 0
    return table
