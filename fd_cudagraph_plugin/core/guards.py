"""Replay guards: input addresses (``FD_CUDAGRAPH_CHECK_ADDRESSES``) and the startup self-check
(``FD_CUDAGRAPH_SELF_CHECK``).

A CUDA graph reads its inputs at the addresses it saw at capture. A runner that rebinds an input
to a new tensor after capture gets garbage silently (FastDeploy #6746, SGLang #6998): the address
guard turns that into an error naming the input. The self-check replays each new graph and runs
eager on the same inputs, which catches an op whose captured form differs from its eager one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

import paddle

from fd_cudagraph_plugin.core.errors import AddressGuardError, SelfCheckError

__all__ = [
    "AddressGuardError",
    "SelfCheckError",
    "check_addresses",
    "input_addresses",
    "moved_inputs",
    "self_check",
]


def _tensors(name: str, value: Any) -> Iterator[tuple[str, paddle.Tensor]]:
    if isinstance(value, paddle.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if isinstance(item, paddle.Tensor):
                yield f"{name}[{index}]", item


def input_addresses(kwargs: dict) -> tuple[tuple[str, int], ...]:
    """``(name, data_ptr)`` of each tensor a graph may read: kwargs and ``forward_meta`` fields."""
    found: list[tuple[str, int]] = []
    for name, value in kwargs.items():
        if name == "forward_meta" and value is not None:
            names = [f.name for f in fields(value)] if is_dataclass(value) else list(vars(value))
            for field_name in names:
                found += _tensors(f"forward_meta.{field_name}", getattr(value, field_name, None))
        else:
            found += _tensors(name, value)
    return tuple((name, tensor.data_ptr()) for name, tensor in found)


def _current_pointer(kwargs: dict, name: str) -> int | None:
    base, _, index = name.partition("[")
    if base.startswith("forward_meta."):
        value = getattr(kwargs.get("forward_meta"), base[len("forward_meta.") :], None)
    else:
        value = kwargs.get(base)
    if index and isinstance(value, (list, tuple)):
        position = int(index[:-1])
        value = value[position] if position < len(value) else None
    return value.data_ptr() if isinstance(value, paddle.Tensor) else None


def moved_inputs(captured: tuple[tuple[str, int], ...], kwargs: dict) -> list[str]:
    """The inputs recorded at capture (only those) that this call has elsewhere, or not at all."""
    return [name for name, pointer in captured if _current_pointer(kwargs, name) != pointer]


def check_addresses(captured: tuple[tuple[str, int], ...], kwargs: dict, size: int) -> None:
    """Compare the inputs recorded at capture (only those) with this call's."""
    for name, pointer in captured:
        current = _current_pointer(kwargs, name)
        if current != pointer:
            where = "is gone" if current is None else f"is now at {current:#x}"
            raise AddressGuardError(
                f"CUDA graph of size {size} reads input {name!r} at {pointer:#x}, but that input "
                f"{where}: the graph would read stale memory. Keep graph inputs in persistent "
                f"buffers and update them in place (tensor.copy_(new, False)) instead of passing "
                f"new tensors (FastDeploy #6746)."
            )


# Replay and eager run the same kernels, so they normally agree bit for bit; the margins only
# absorb reductions whose order may differ. Integer outputs must match exactly.
_TOLERANCE = {
    paddle.float32: (1e-4, 1e-5),
    paddle.float64: (1e-7, 1e-9),
    paddle.float16: (1e-2, 1e-3),
    paddle.bfloat16: (2e-2, 1e-2),
}


def first_mismatch(replayed: Any, eager: Any) -> str | None:
    """None when both results agree within the dtype's tolerance, else what differs."""
    left = replayed if isinstance(replayed, (list, tuple)) else [replayed]
    right = eager if isinstance(eager, (list, tuple)) else [eager]
    if len(left) != len(right):
        return f"{len(left)} outputs replayed, {len(right)} eager"
    for index, (a, b) in enumerate(zip(left, right, strict=True)):
        if a is None or b is None:
            if a is not b:
                return f"output {index} is None in only one of them"
            continue
        if list(a.shape) != list(b.shape):
            return f"output {index} shape {list(a.shape)} vs {list(b.shape)}"
        tolerance = _TOLERANCE.get(a.dtype)
        if tolerance is None:
            same = bool(paddle.equal_all(a, b))
        else:
            rtol, atol = tolerance
            same = bool(paddle.allclose(a.astype("float32"), b.astype("float32"), rtol, atol))
        if not same:
            worst = float((a.astype("float32") - b.astype("float32")).abs().max())
            return f"output {index} differs (max abs difference {worst:.3g}, dtype {a.dtype})"
    return None


def clone(result: Any) -> Any:
    if isinstance(result, paddle.Tensor):
        return result.clone()
    if isinstance(result, (list, tuple)):
        return [t.clone() if isinstance(t, paddle.Tensor) else t for t in result]
    return result


def self_check(entry: Any, eager: Any) -> str | None:
    """Replay ``entry``'s new graph and compare with ``eager()`` on the same inputs; None when
    they agree, else the graph's phase and size and what differs (one session's post carries
    every graph's, so what it means is said once, by ``capture.self_checks``)."""
    entry.replay()
    problem = first_mismatch(clone(entry.result), eager())
    return None if problem is None else f"{entry.phase} size {entry.size}: {problem}"
