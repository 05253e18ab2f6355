"""The execution mode: one type answering every question of which steps get which graphs.

FastDeploy spreads the mode over ``graph_opt_level``, ``full_cuda_graph``,
``cudagraph_only_prefill``, the speculative method and the release (2.4 hands the backend no
dygraph runnable and its ``ForwardMeta`` has no ``exist_prefill``). ``Mode.of(settings)`` reads
them once, and everything else asks the mode: which phases are graphed and at which sizes, who
captures decode graphs, what the hot path's key is, what ``check_capture_successful`` requires.
docs/modes.md has the table:

* dynamic: the plugin captures decode from the dygraph model; prefill runs eagerly;
* static split (2.5+, ``graph_opt_level`` >= 1, ``full_cuda_graph`` false): prefill as
  Paddle-managed graphs of the SOT program at the prefill sizes; decode as in dynamic mode;
* static full (2.5+, ``graph_opt_level`` >= 1, ``full_cuda_graph`` true): decode as Paddle-managed
  graphs where the SOT program is one clean graph on every rank, else as in dynamic mode: undecided
  until the ranks agree it at the first decode capture (``decided``);
* static on 2.4 (``graph_opt_level`` >= 1): every graphed step is a Paddle-managed graph;
* ``cudagraph_only_prefill``: graphs hold prefill kernels, at the decode list's sizes (as
  FastDeploy's own backend keys them) unless static split gives prefill sizes; decode runs eagerly.

Under speculative decoding with a ``real_bsz_to_captured_size`` map, decode steps are keyed by
running requests instead of tokens (``keyed_by_running``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from fd_cudagraph_plugin.core.sizes import padding_table

DECODE = "decode"
PREFILL = "prefill"


class Configured(Protocol):
    """What the mode is read from: ``settings.Settings``, FastDeploy's config read once."""

    graph_opt_level: int
    full_cuda_graph: bool
    only_prefill: bool
    fastdeploy_2_4: bool
    speculative_method: str | None
    capture_sizes: tuple[int, ...]
    prefill_sizes: tuple[int, ...]
    decode_table: tuple[int, ...]
    bsz_table: tuple[int, ...]


class Kind(Enum):
    DYNAMIC = "dynamic"
    STATIC_SPLIT = "static_split"
    STATIC_FULL = "static_full"
    STATIC_2_4 = "static (FastDeploy 2.4)"


@dataclass(frozen=True)
class Mode:
    kind: Kind
    #: ``cudagraph_only_prefill``: graphs hold prefill kernels; a decode step must not replay them.
    only_prefill: bool
    #: Paddle-managed graphs exist in this mode (``graph_opt_level`` >= 1): a ``dy2st`` driver.
    paddle_graphs: bool
    #: Who captures decode graphs: Paddle inside its SOT program (True) or the plugin from the
    #: dygraph model (False); None until every rank agrees it at the static probe (static full).
    decode_static: bool | None
    #: Decode steps are keyed by running requests (a speculative method with a non-empty
    #: ``real_bsz_to_captured_size``; ngram on 2.5 and 2.6 has none and is keyed by tokens).
    keyed_by_running: bool
    #: FastDeploy 2.4 in only-prefill mode: it routes to the backend exactly the steps its runner
    #: flagged as prefill-only, and its ForwardMeta cannot say so: every such step is prefill.
    flagged_prefill: bool
    #: Sizes of decode graphs (none in only-prefill mode) and of prefill graphs.
    decode_sizes: tuple[int, ...]
    prefill_sizes: tuple[int, ...]
    #: Index = the step's tokens, value = the decode (prefill) graph size it pads to (0: none).
    decode_table: tuple[int, ...] = field(repr=False)
    prefill_table: tuple[int, ...] = field(repr=False)
    #: Index = the hot path's key (token count, or running requests), value = graph size.
    key_table: tuple[int, ...] = field(repr=False)
    #: What FastDeploy was given, for the words of a failure.
    graph_opt_level: int = 0
    full_cuda_graph: bool = True
    speculative: bool = False
    #: ``key_table`` as FastDeploy's list pads, where a fit captures fewer sizes (else empty).
    unfitted_key_table: tuple[int, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, settings: Configured) -> Mode:
        level, full = settings.graph_opt_level, settings.full_cuda_graph
        v24 = settings.fastdeploy_2_4
        if level > 0 and v24:
            kind = Kind.STATIC_2_4
        elif level > 0:
            kind = Kind.STATIC_FULL if full else Kind.STATIC_SPLIT
        else:
            kind = Kind.DYNAMIC
        only_prefill = settings.only_prefill
        if kind is Kind.STATIC_SPLIT:
            prefill = settings.prefill_sizes
        else:
            prefill = settings.capture_sizes if only_prefill else ()
        keyed_by_running = settings.speculative_method is not None and any(settings.bsz_table)
        return cls(
            kind=kind,
            only_prefill=only_prefill,
            paddle_graphs=level > 0,
            decode_static={Kind.STATIC_2_4: True, Kind.STATIC_FULL: None}.get(kind, False),
            keyed_by_running=keyed_by_running,
            flagged_prefill=only_prefill and v24,
            decode_sizes=() if only_prefill else settings.capture_sizes,
            prefill_sizes=prefill,
            decode_table=settings.decode_table,
            prefill_table=tuple(padding_table(prefill)),
            key_table=settings.bsz_table if keyed_by_running else settings.decode_table,
            graph_opt_level=level,
            full_cuda_graph=full,
            speculative=settings.speculative_method is not None,
        )

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def fittable(self) -> bool:
        """Decode graphs the plugin captures one per size, from the dygraph model: the ones a
        fit to traffic may capture fewer of (``fit.py``)."""
        return self.kind is Kind.DYNAMIC and not self.only_prefill and bool(self.decode_sizes)

    def fitted(self, sizes: tuple[int, ...]) -> Mode:
        """This mode capturing only ``sizes`` of its decode sizes (its largest among them): a
        step pads to the next size kept, never past the largest, so none runs eagerly that did
        not before."""
        table = padding_table(sizes)
        up = tuple(table[size] if size else 0 for size in self.key_table)
        return dataclasses.replace(
            self,
            decode_sizes=tuple(sorted(sizes, reverse=True)),
            decode_table=tuple(table[size] if size else 0 for size in self.decode_table),
            key_table=up,
            unfitted_key_table=self.unfitted_key_table or self.key_table,
        )

    @property
    def undecided(self) -> bool:
        """Static full mode before the static probe: who captures decode is not known yet."""
        return self.decode_static is None

    def decided(self, static: bool) -> Mode:
        """The mode once every rank agreed who captures decode (the static probe's verdict)."""
        return dataclasses.replace(self, decode_static=static)

    @property
    def static_decode_verdict(self) -> str | None:
        """``stats()["static_full_decode"]``: "static" or "dynamic" once decided in static full
        mode, else None."""
        if self.kind is not Kind.STATIC_FULL or self.decode_static is None:
            return None
        return "static" if self.decode_static else "dynamic"

    def static(self, phase: str) -> bool:
        """Whether graphs of ``phase`` are Paddle-managed (a decode still undecided: not yet)."""
        return bool(self.decode_static) if phase == DECODE else self.paddle_graphs

    @property
    def recorded_phases(self) -> tuple[str, ...]:
        """The capture loops whose sessions capture graphs: each has its graph-memory record."""
        return (PREFILL, DECODE) if self.kind is Kind.STATIC_SPLIT else (DECODE,)

    def expected_phases(self, saw_prefill_step: bool) -> tuple[str, ...]:
        """The phases ``check_capture_successful`` requires graphs of. From 2.5 FastDeploy routes
        prefill steps to the backend in static split mode only, so in only-prefill mode it
        captures nothing elsewhere, unless such a step did come (2.4 routes them)."""
        if self.only_prefill and not (self.kind is Kind.STATIC_SPLIT or self.flagged_prefill):
            return (PREFILL,) if saw_prefill_step else ()
        return (DECODE, PREFILL)

    @property
    def probe_capturable(self) -> bool:
        """A probe capture of three decode sizes estimates this mode's graph memory: plain dynamic
        decode, where the sizes are independent graphs of one runnable."""
        return self.kind is Kind.DYNAMIC and not self.speculative and not self.only_prefill

    def oversized_prefill_reason(self) -> str:
        """Why a prefill step above the largest prefill graph runs eagerly: above the graphs, or
        (no prefill graphs in this mode, or ``max_capture_shape_prefill: 0``) plain prefill."""
        return "oversized_prefill" if self.prefill_sizes else "prefill"

    def describe(self, static: bool | None = None) -> str:
        """The mode as a failure names it: a graph's own kind where one is given."""
        kind = self.name if static is None else ("static" if static else "dynamic")
        return (
            f"{kind} mode, graph_opt_level={self.graph_opt_level}, "
            f"full_cuda_graph={self.full_cuda_graph}"
        )
