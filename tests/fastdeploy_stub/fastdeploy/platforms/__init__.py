"""Platform detection. Set ``current_platform.device_name`` (e.g. "xpu") to pretend a device."""

from __future__ import annotations


class Platform:
    def __init__(self) -> None:
        self.device_name: str | None = None  # None: detect from the installed paddle

    def _name(self) -> str:
        if self.device_name is not None:
            return self.device_name
        import paddle

        if paddle.is_compiled_with_xpu():
            return "xpu"
        return "cuda" if paddle.is_compiled_with_cuda() else "cpu"

    def is_cuda(self) -> bool:
        return self._name() == "cuda"

    def is_xpu(self) -> bool:
        return self._name() == "xpu"

    def is_iluvatar(self) -> bool:
        return self._name() == "iluvatar"

    def is_maca(self) -> bool:
        return self._name() == "maca"

    # The rest of the predicates every release's Platform has.
    def is_dcu(self) -> bool:
        return self._name() == "dcu"

    def is_gcu(self) -> bool:
        return self._name() == "gcu"

    def is_npu(self) -> bool:
        return self._name() == "npu"

    def is_intel_hpu(self) -> bool:
        return self._name() == "intel_hpu"

    def is_cpu(self) -> bool:
        return self._name() == "cpu"


current_platform = Platform()
