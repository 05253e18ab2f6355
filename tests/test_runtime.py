"""The simulated runtime behaves like a CUDA graph where the backend's correctness depends on it."""

from __future__ import annotations

import ast
from pathlib import Path

import paddle
import pytest
from simulated import TestRuntime

from fd_cudagraph_plugin.core.errors import ConfigError
from fd_cudagraph_plugin.core.runtime import make_runtime


def _captured_double(runtime, pool, source):
    inputs = {"x": source}
    return runtime.capture(lambda: inputs["x"] * 2.0, pool)


def test_replay_reads_the_captured_input_memory_updated_in_place():
    runtime = TestRuntime()
    pool = runtime.new_pool()
    buffer = paddle.ones([4])
    graph, out = _captured_double(runtime, pool, buffer)
    buffer[:] = paddle.full([4], 3.0)
    graph.replay()
    assert out.tolist() == [6.0] * 4


def test_replay_writes_outputs_in_place_at_the_same_address():
    runtime = TestRuntime()
    buffer = paddle.ones([4])
    graph, out = _captured_double(runtime, runtime.new_pool(), buffer)
    pointer = out.data_ptr()
    buffer[:] = paddle.full([4], 5.0)
    graph.replay()
    assert out.data_ptr() == pointer and out.tolist() == [10.0] * 4


def test_pool_bytes_are_charged_at_capture_and_returned_on_release():
    runtime = TestRuntime()
    pool = runtime.new_pool()
    graph, _ = _captured_double(runtime, pool, paddle.ones([16]))
    assert runtime.pool_bytes(pool) == 16 * 4 and runtime.live_graphs == 1
    graph.release()
    graph.release()
    assert runtime.pool_bytes(pool) == 0 and runtime.live_graphs == 0
    with pytest.raises(RuntimeError, match="released"):
        graph.replay()


def test_injected_capture_failure_leaves_nothing_alive():
    runtime = TestRuntime()
    runtime.fail_next_capture(MemoryError("out of memory"))
    with pytest.raises(MemoryError):
        _captured_double(runtime, runtime.new_pool(), paddle.ones([4]))
    assert runtime.live_graphs == 0 and not runtime.capturing


def test_after_a_failed_capture_no_capture_works_as_on_paddle():
    runtime = TestRuntime()
    pool = runtime.new_pool()
    graph, _ = _captured_double(runtime, pool, paddle.ones([4]))
    runtime.fail_next_capture(RuntimeError("operation not permitted when stream is capturing"))
    with pytest.raises(RuntimeError, match="not permitted"):
        _captured_double(runtime, pool, paddle.ones([4]))
    with pytest.raises(RuntimeError, match="CUDA Graph can only captured one by one"):
        _captured_double(runtime, pool, paddle.ones([4]))
    graph.replay()  # graphs captured earlier still replay


def test_cuda_runtime_refuses_cpu_paddle_with_the_fix():
    if paddle.is_compiled_with_cuda():
        pytest.skip("this Paddle has CUDA")
    with pytest.raises(ConfigError, match="FD_CUDAGRAPH_RUNTIME=simulated"):
        make_runtime("cuda")


def _touches_graph_api(source: str) -> bool:
    """Imports ``paddle.device.cuda.graphs`` (any spelling) or names Paddle's ``CUDAGraph``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any("cuda.graphs" in a.name for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if "cuda.graphs" in node.module or (node.module.endswith("cuda") and "graphs" in names):
                return True
            if "CUDAGraph" in names:
                return True
        if isinstance(node, ast.Attribute) and (
            node.attr == "CUDAGraph"
            or (node.attr == "graphs" and getattr(node.value, "attr", None) == "cuda")
        ):
            return True
    return False


def test_only_the_cuda_runtime_module_touches_paddles_graph_api():
    package = Path(__file__).resolve().parent.parent / "fd_cudagraph_plugin"
    touching = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if _touches_graph_api(path.read_text(encoding="utf-8"))
    )
    assert touching == ["core/runtime/cuda.py"]
    assert _touches_graph_api("import paddle\npaddle.device.cuda.graphs.CUDAGraph()")
