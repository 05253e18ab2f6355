"""``core/runtime/cuda.py`` against a fake of Paddle's CUDA-graph API built from Paddle's source
(``fake_paddle_cuda.py``): the module that calls Paddle's graph API, tested without a GPU."""

from __future__ import annotations

import paddle
import pytest
from conftest import Buffers, MixingBackbone, make_config
from fake_paddle_cuda import FakePaddleCuda

from fd_cudagraph_plugin.core.backend import CudaGraphBackend
from fd_cudagraph_plugin.core.errors import CaptureError, ConfigError
from fd_cudagraph_plugin.core.runtime.cuda import CudaRuntime


@pytest.fixture
def api() -> FakePaddleCuda:
    return FakePaddleCuda()


def allocating(api, nbytes):
    """A captured function that allocates ``nbytes`` (its output) and returns a marker."""

    def run():
        api.malloc(nbytes)
        return f"outputs of {nbytes} bytes"

    return run


def test_a_capture_begins_and_ends_one_paddle_graph_in_the_given_pool(api):
    runtime = CudaRuntime(api)
    pool = runtime.new_pool()
    graph, outputs = runtime.capture(allocating(api, 4096), pool)
    assert outputs == "outputs of 4096 bytes"
    assert api.calls == [
        "gen_new_memory_pool_id",
        "synchronize",
        f"begin_capture_with_pool_id(mode=thread_local, pool={pool})",
        "end_capture",
        "synchronize",
    ]
    assert api.pools[pool].graphs == 1 and api.pools[pool].bytes == 4096
    graph.replay()
    graph.replay()
    assert api.graphs[0].replays == 2


def test_graphs_of_one_pool_share_it_and_its_memory_goes_with_the_last_one(api):
    runtime = CudaRuntime(api)
    pool = runtime.new_pool()
    before = runtime.pool_bytes(pool)
    large, _ = runtime.capture(allocating(api, 8192), pool)
    small, _ = runtime.capture(allocating(api, 1024), pool)
    assert runtime.pool_bytes(pool) - before == 8192 + 1024 and len(api.pools) == 1
    large.release()
    runtime.empty_cache()
    assert api.live_graphs == 1 and api.memory_reserved() == 8192 + 1024  # still held
    small.release()
    runtime.release_pool(pool)
    runtime.empty_cache()
    assert api.pools == {} and api.memory_reserved() == 0


def test_without_a_pool_each_graph_gets_paddles_private_pool(api):
    runtime = CudaRuntime(api)
    runtime.capture(allocating(api, 10), None)
    runtime.capture(allocating(api, 20), None)
    assert sorted(p.bytes for p in api.pools.values()) == [10, 20]


def test_a_replay_after_release_is_paddles_permission_denied(api):
    runtime = CudaRuntime(api)
    graph, _ = runtime.capture(allocating(api, 8), runtime.new_pool())
    replay = graph.replay  # what an entry holds; it drops it on release
    graph.release()
    graph.release()  # twice is harmless
    with pytest.raises(RuntimeError, match="Cannot replay the CUDA Graph after reset"):
        replay()


def test_an_error_inside_the_capture_ends_it_and_drops_the_half_built_graph(api):
    runtime = CudaRuntime(api)
    pool = runtime.new_pool()

    def fails():
        api.malloc(512)
        raise MemoryError("out of memory")

    with pytest.raises(MemoryError):
        runtime.capture(fails, pool)
    assert api.calls[-1] == "end_capture" and api.capturing is None and api.live_graphs == 0
    graph, _ = runtime.capture(allocating(api, 8), pool)  # the capture ended cleanly: go on
    graph.replay()


def test_an_invalidated_capture_leaves_paddle_unable_to_capture_again(api):
    runtime = CudaRuntime(api)
    pool = runtime.new_pool()
    earlier, _ = runtime.capture(allocating(api, 8), pool)

    def host_sync():
        api.invalidate()  # e.g. a .numpy() in the model
        return None

    with pytest.raises(OSError, match="cudaErrorStreamCaptureInvalidated"):
        runtime.capture(host_sync, pool)
    with pytest.raises(RuntimeError, match="CUDA Graph can only captured one by one"):
        runtime.capture(allocating(api, 8), pool)
    earlier.replay()  # graphs captured before still replay


def test_dot_files_are_written_by_paddle(api, tmp_path):
    runtime = CudaRuntime(api)
    graph, _ = runtime.capture(allocating(api, 8), runtime.new_pool())
    assert runtime.dump_dot(graph, str(tmp_path / "dot")) is True
    assert list((tmp_path / "dot").glob("*.dot"))


def test_a_paddle_without_cuda_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="FD_CUDAGRAPH_RUNTIME=simulated"):
        CudaRuntime(FakePaddleCuda(compiled_with_cuda=False))


class Allocating(MixingBackbone):
    """Each run allocates its output in device memory, as a kernel would."""

    def __init__(self, api) -> None:
        super().__init__()
        self.api = api

    def forward(self, ids_remove_padding, forward_meta):
        out = super().forward(ids_remove_padding, forward_meta)
        self.api.malloc(int(out.numel()) * 4)
        return out


def test_the_backend_captures_replays_and_clears_through_paddles_api(api):
    runtime = CudaRuntime(api)
    runtime.warmed = True  # as after FastDeploy's profile run
    model = Allocating(api)
    backend = CudaGraphBackend(
        fd_config=make_config(8, cudagraph_capture_sizes=[4, 2, 1]),
        dy_runnable=model.forward,
        runnable=model.forward,
        runtime=runtime,
    )
    buffers = Buffers()
    for size in (4, 2, 1):
        backend(**buffers.step(size))
    stats = backend.stats()
    assert stats["graph_bytes"] == {4: 4 * 8 * 4, 2: 2 * 8 * 4, 1: 8 * 4}
    assert len(api.pools) == 1 and api.live_graphs == 3  # one pool for the backend
    replays = [g.replays for g in api.graphs]
    backend(**buffers.step(3))  # pads to the size-4 graph
    assert [g.replays for g in api.graphs] == [replays[0] + 1, *replays[1:]]
    backend.clear_graph()
    assert api.live_graphs == 0 and api.pools == {} and api.memory_reserved() == 0


def test_a_failed_capture_through_the_backend_says_to_restart(api):
    runtime = CudaRuntime(api)
    runtime.warmed = True

    class SyncsInCapture(MixingBackbone):
        def forward(self, ids_remove_padding, forward_meta):
            api.invalidate()
            return super().forward(ids_remove_padding, forward_meta)

    model = SyncsInCapture()
    backend = CudaGraphBackend(
        fd_config=make_config(8), dy_runnable=model.forward, runnable=model.forward, runtime=runtime
    )
    with pytest.raises(CaptureError, match=r"capture failed .*cudaErrorStreamCapture.*restart"):
        backend(**Buffers().step(8))
    assert api.live_graphs == 0
    out = backend(**Buffers().step(5))  # eager still serves
    assert paddle.allclose(out, model.forward(**Buffers().step(5))).item()
