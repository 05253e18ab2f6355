"""A graph is never replayed against memory that moved (issue 30).

FastDeploy's lifecycle re-creates some of what a decode graph reads (the weights, the KV cache,
``rope_emb``, the MTP draft's inputs) and recaptures only on some paths. One test per row of the
lifecycle table (docs/modes.md, "Lifecycle"), each over the releases that have the call, with and
without the MTP draft: after the event every decode step served (target, and each draft substep)
equals eager on the same inputs. The models (``graph_reads.py``) read those tensors as a CUDA graph
does, so a graph that replays the old memory gives NaN (the stand-in fills what it frees with it).

Rows where FastDeploy moves memory without recapturing are where the plugin recaptures itself
(``core/lifecycle.py``); without it each of them fails (every step NaN). The last parts show that
FastDeploy's own backend replays stale memory after ``wakeup("kv_cache")``, and pin what the
stand-in moves per release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle
import pytest
from conftest import make_config
from fastdeploy.worker.gpu_model_runner import GPUModelRunner
from fastdeploy.worker.gpu_worker import GpuWorker
from graph_reads import (
    FASTDEPLOY_BACKEND,
    DecoratedKV,
    DecoratedKVDraft,
    fastdeploy_backend_class,
    prefill,
)

MTP = {"method": "mtp", "num_speculative_tokens": 1, "num_model_steps": 1}
#: Releases with sleep(), wakeup() and update_weights() (2.4 has none of them).
SLEEP_RELEASES = ("2.5", "2.6", "develop")
ALL_RELEASES = ("2.4", "2.5", "2.6", "develop")
#: Decode steps served after each event, as tokens (MTP: two per request).
STEPS = {False: (4, 2, 3), True: (4, 2, 6)}


@dataclass
class Deployment:
    runner: GPUModelRunner
    worker: GpuWorker
    target: DecoratedKV
    draft: DecoratedKVDraft | None

    def backends(self) -> list[Any]:
        models = [self.target] + ([self.draft] if self.draft is not None else [])
        return [m.graph_opt_backend.cudagraph_piecewise_backend for m in models]

    def replays(self) -> int:
        return sum(sum(b.stats()["replays"].values()) for b in self.backends())

    def captures(self) -> int:
        return sum(b.captures for b in self.backends())

    def prefill(self, seed: int) -> None:
        """New requests' prefill: write the (current) caches in place."""
        prefill(self.runner.share_inputs["caches"], seed)
        if self.draft is not None:
            prefill(self.runner.proposer.model_inputs["caches"], seed + 100)

    def new_weights(self, scale: float) -> None:
        """What a trainer publishes: every weight scaled (the next load reads it)."""
        checkpoint = self.runner.dynamic_weight_manager.checkpoint
        for name, value in checkpoint.items():
            checkpoint[name] = value * scale


def start(
    mtp: bool, prefill: bool = True, graph: dict | None = None, weights: bool = True, **load: Any
) -> Deployment:
    """FastDeploy's start-up: profile run, KV caches for the final block count, capture.
    ``graph``: graph-optimization settings; ``weights``: FastDeploy's dynamic weight manager
    (the stand-in runs level 0 with it, as ``dynamic_load_weight`` needs)."""
    config = make_config(
        4, speculative=MTP if mtp else None, dynamic_load_weight=weights, **(graph or {})
    )
    config.graph_opt_config.draft_model_use_cudagraph = True
    for name, value in load.items():
        setattr(config.load_config, name, value)
    target = DecoratedKV(fd_config=config)
    draft = DecoratedKVDraft(fd_config=config) if mtp else None
    runner = GPUModelRunner(config, target, draft_model=draft)
    worker = GpuWorker(config, runner)
    runner.profile_run()
    worker.initialize_cache(num_gpu_blocks=4)
    worker.graph_optimize_and_warm_up_model()
    deployment = Deployment(runner, worker, target, draft)
    if prefill:
        deployment.prefill(seed=1)
    return deployment


def mismatches(d: Deployment, steps: tuple[int, ...]) -> list[str]:
    """Serve ``steps``; every output (target, each draft substep) that is not eager's on the same
    inputs, said with its step and the largest difference."""
    found = []
    for tokens in steps:
        out = d.runner.execute_step(tokens)
        ids = d.runner.share_inputs["ids"][:tokens]
        eager = d.target.forward(ids_remove_padding=ids, forward_meta=d.runner.forward_meta)
        found += _differs(f"target, {tokens} tokens", out, eager[:tokens])
        for substep, step in enumerate(d.runner.proposer.steps if d.draft is not None else []):
            eager = d.draft.forward(
                ids_remove_padding=step["ids"],
                previous_hidden_states=step["previous_hidden_states"],
                forward_meta=step["forward_meta"],
            )
            found += _differs(f"draft substep {substep}, {tokens} tokens", step["output"], eager)
    return found


def _differs(what: str, served: paddle.Tensor, eager: paddle.Tensor) -> list[str]:
    if paddle.allclose(served, eager).item():
        return []
    worst = float((served - eager).abs().max())
    return [f"{what}: served differs from eager (max abs difference {worst})"]


def serves_like_eager_on_graphs(d: Deployment, mtp: bool) -> None:
    """Every step equals eager, and graphs served them (the check can see a stale graph)."""
    before = d.replays()
    assert mismatches(d, STEPS[mtp]) == []
    assert d.replays() > before


MODELS = pytest.mark.parametrize("mtp", [False, True], ids=["target", "target+draft"])


# ------------------------------------------------------------------ one test per row


@pytest.mark.parametrize("fd_version", SLEEP_RELEASES, indirect=True)
@MODELS
def test_rsync_update_weights_moves_nothing_so_graphs_are_kept_and_read_the_new_values(
    fd_version, plugin_registered, mtp
):
    d = start(mtp, load_strategy="rsync")
    serves_like_eager_on_graphs(d, mtp)
    before = d.runner.execute_step(4).clone()
    captures = d.captures()
    d.new_weights(1.5)
    d.worker.update_weights(version="v2")  # set_value: the same addresses
    assert d.captures() == captures  # FastDeploy recaptures nothing, and nothing needs it
    serves_like_eager_on_graphs(d, mtp)
    assert d.captures() == captures
    assert not paddle.allclose(d.runner.execute_step(4), before).item()  # the weights changed


@pytest.mark.parametrize("fd_version", ALL_RELEASES, indirect=True)
@MODELS
def test_legacy_clear_and_update_parameters_recapture_on_the_new_memory(
    fd_version, plugin_registered, mtp
):
    d = start(mtp)
    serves_like_eager_on_graphs(d, mtp)
    captures = d.captures()
    d.runner.clear_requests()
    d.runner.clear_parameters(pid=0)
    d.new_weights(0.5)
    d.runner.update_parameters(pid=0)  # new weights, new KV (and 2.5+ rope_emb, draft inputs)
    assert d.captures() > captures
    d.prefill(seed=3)
    serves_like_eager_on_graphs(d, mtp)


@pytest.mark.parametrize("fd_version", SLEEP_RELEASES, indirect=True)
@MODELS
def test_sleep_and_wakeup_of_weight_and_kv_cache_recapture_on_the_new_memory(
    fd_version, plugin_registered, mtp
):
    d = start(mtp)
    serves_like_eager_on_graphs(d, mtp)
    captures = d.captures()
    d.worker.sleep(tags="weight,kv_cache")
    d.worker.wakeup(tags="weight,kv_cache")  # FastDeploy captures in the "weight" part
    assert d.captures() > captures
    d.prefill(seed=3)
    serves_like_eager_on_graphs(d, mtp)


@pytest.mark.parametrize("fd_version", SLEEP_RELEASES, indirect=True)
@MODELS
def test_sleep_and_wakeup_of_weight_alone_recapture_on_the_new_memory(
    fd_version, plugin_registered, mtp
):
    d = start(mtp)
    serves_like_eager_on_graphs(d, mtp)
    d.worker.sleep(tags="weight")
    d.worker.wakeup(tags="weight")  # new rope_emb and draft inputs, reloaded weights, capture
    serves_like_eager_on_graphs(d, mtp)


@pytest.mark.parametrize("fd_version", SLEEP_RELEASES, indirect=True)
@MODELS
def test_after_sleep_and_wakeup_of_the_kv_cache_every_step_served_equals_eager(
    fd_version, plugin_registered, mtp
):
    d = start(mtp)
    serves_like_eager_on_graphs(d, mtp)
    d.worker.sleep(tags="kv_cache")  # the caches are freed: the plugin releases the graphs
    assert not any(b.has_graphs() for b in d.backends())
    captures = d.captures()
    d.worker.wakeup(tags="kv_cache")  # new caches, rope_emb, draft inputs; FastDeploy: no capture
    assert d.captures() > captures  # the plugin captured on the new memory
    d.prefill(seed=3)
    serves_like_eager_on_graphs(d, mtp)


@pytest.mark.parametrize("fd_version", SLEEP_RELEASES, indirect=True)
@MODELS
def test_a_wakeup_with_nothing_asleep_still_moves_rope_emb_and_steps_equal_eager(
    fd_version, plugin_registered, mtp
):
    d = start(mtp)
    serves_like_eager_on_graphs(d, mtp)
    captures = d.captures()
    d.worker.wakeup(tags="kv_cache")
    assert d.captures() > captures
    serves_like_eager_on_graphs(d, mtp)


@pytest.mark.parametrize("fd_version", ["2.6", "develop"], indirect=True)
@MODELS
def test_in_deterministic_mode_the_first_steps_after_start_up_equal_eager(
    fd_version, plugin_registered, mtp, monkeypatch
):
    monkeypatch.setenv("FD_DETERMINISTIC_MODE", "1")
    after_reset = _inputs_after_each_reset(monkeypatch)
    d = start(mtp, prefill=False)
    # The plugin captured again on the new rope_emb, and then put back what FastDeploy's reset
    # had left in the inputs (its own dummy runs wrote them).
    assert _values(d.runner.share_inputs) == after_reset[-1]
    d.prefill(seed=1)
    serves_like_eager_on_graphs(d, mtp)


def _values(share_inputs: Any) -> dict[str, list]:
    """The values of the target's input buffers, but the KV caches'."""
    return {
        name: value.numpy().tolist()
        for name, value in share_inputs.items()
        if isinstance(value, paddle.Tensor)
    }


def _inputs_after_each_reset(monkeypatch) -> list[dict[str, list]]:
    from fastdeploy.worker import input_batch

    seen: list[dict[str, list]] = []
    reset = input_batch.InputBatch.reset_share_inputs

    def reset_share_inputs(batch):
        reset(batch)
        seen.append(_values(batch))

    monkeypatch.setattr(input_batch.InputBatch, "reset_share_inputs", reset_share_inputs)
    return seen


@pytest.mark.parametrize("fd_version", SLEEP_RELEASES, indirect=True)
def test_waking_up_the_weights_alone_while_the_kv_cache_sleeps_is_refused_as_fastdeploy_does(
    fd_version, plugin_registered
):
    d = start(mtp=False)
    d.worker.sleep(tags="weight,kv_cache")
    with pytest.raises(RuntimeError, match=r"Please wake up \[kv_cache\] first"):
        d.worker.wakeup(tags="weight")


# ------------------------------------------------------------------ Paddle-managed graphs, failures

STATIC_FULL = {"graph_opt_level": 1, "full_cuda_graph": True}
STATIC_SPLIT = {"graph_opt_level": 1, "full_cuda_graph": False, "max_capture_shape_prefill": 16}


@pytest.mark.parametrize("fd_version", SLEEP_RELEASES, indirect=True)
def test_paddle_managed_decode_graphs_are_released_at_sleep_and_captured_again_at_wakeup(
    fd_version, plugin_registered
):
    d = start(mtp=False, graph=STATIC_FULL, weights=False)
    (backend,) = d.backends()
    assert backend.stats()["static_full_decode"] == "static"  # Paddle-managed graphs
    captures = backend.captures
    d.worker.sleep(tags="kv_cache")
    assert not backend.has_graphs()  # they read the freed caches, as the plugin's own would
    d.worker.wakeup(tags="kv_cache")
    assert backend.captures > captures and backend.has_graphs()
    captures = backend.captures
    d.worker.wakeup(tags="kv_cache")  # nothing asleep: rope_emb moves all the same
    assert backend.captures > captures


@pytest.mark.parametrize("fd_version", SLEEP_RELEASES, indirect=True)
def test_static_split_prefill_graphs_released_at_sleep_are_captured_again_at_wakeup(
    fd_version, plugin_registered
):
    d = start(mtp=False, graph=STATIC_SPLIT, weights=False)
    (backend,) = d.backends()
    assert backend.has_graphs(prefill=True)
    d.worker.sleep(tags="kv_cache")
    assert not backend.has_graphs(prefill=True)
    d.worker.wakeup(tags="kv_cache")
    assert backend.has_graphs(prefill=True)
    d.runner.execute_step(8, exist_prefill=True)
    assert "late_capture" not in backend.stats()["eager_fallbacks"]


@pytest.mark.parametrize("fd_version", ["develop"], indirect=True)
def test_an_interrupt_inside_a_lifecycle_call_leaves_the_next_calls_checked(
    fd_version, plugin_registered, monkeypatch
):
    d = start(mtp=False)
    reset = d.runner.share_inputs.reset_share_inputs
    calls = []

    def interrupted_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        reset()

    monkeypatch.setattr(d.runner.share_inputs, "reset_share_inputs", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        d.worker.wakeup(tags="kv_cache")
    d.worker.sleep(tags="kv_cache")
    assert not any(b.has_graphs() for b in d.backends())  # the check after sleep still ran
    d.worker.wakeup(tags="kv_cache")
    d.prefill(seed=3)
    serves_like_eager_on_graphs(d, mtp=False)


@pytest.mark.parametrize("fd_version", ["develop"], indirect=True)
@MODELS
def test_a_recapture_that_fails_leaves_steps_eager_and_a_retried_wakeup_captures(
    fd_version, plugin_registered, mtp, monkeypatch
):
    from fd_cudagraph_plugin.core import seam

    d = start(mtp)
    d.worker.sleep(tags="kv_cache")
    loops = seam.capture_loops

    def failing(runner, prefill):
        def capture_model() -> None:
            raise RuntimeError("CUDA error(2): out of memory")

        return [capture_model]

    monkeypatch.setattr(seam, "capture_loops", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        d.worker.wakeup(tags="kv_cache")
    d.prefill(seed=3)
    replays = d.replays()
    assert mismatches(d, STEPS[mtp]) == [] and d.replays() == replays  # eager, and right
    monkeypatch.setattr(seam, "capture_loops", loops)
    d.worker.wakeup(tags="kv_cache")  # the operator retries
    serves_like_eager_on_graphs(d, mtp)


@pytest.mark.parametrize("fd_version", ["develop"], indirect=True)
def test_a_lifecycle_call_that_fails_releases_the_graphs_whatever_it_moved_first(
    fd_version, plugin_registered, monkeypatch
):
    d = start(mtp=False)

    def out_of_memory(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("CUDA error(2): out of memory")

    # update_parameters without the clear before it: new weights and inputs, then the KV cache
    # fails; FastDeploy never gets to its capture, and the graphs would read the old weights.
    monkeypatch.setattr(d.runner, "initialize_kv_cache", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        d.runner.update_parameters(pid=0)
    assert not any(b.has_graphs() for b in d.backends())
    replays = d.replays()
    assert mismatches(d, STEPS[False]) == [] and d.replays() == replays
    monkeypatch.undo()
    d.runner.update_parameters(pid=0)
    d.prefill(seed=3)
    serves_like_eager_on_graphs(d, mtp=False)


# ------------------------------------------------------------------ what no lifecycle call names


@pytest.mark.parametrize("fd_version", ["develop"], indirect=True)
def test_an_input_moved_after_a_lifecycle_call_is_caught_at_its_first_step_and_run_eagerly(
    fd_version, plugin_registered, caplog
):
    d = start(mtp=False, load_strategy="rsync")
    d.worker.update_weights(version="v2")  # moves nothing: graphs kept, each checked at its step
    share_inputs = d.runner.share_inputs
    share_inputs["rope_emb"] = share_inputs["rope_emb"].clone()  # no call the plugin wraps
    replays = d.replays()
    assert mismatches(d, STEPS[False]) == []
    assert d.replays() == replays  # not one replay on the moved rope_emb
    (backend,) = d.backends()
    assert backend.stats()["eager_fallbacks"] == {"memory_moved": len(STEPS[False])}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len([w for w in warnings if "forward_meta.rotary_embs" in w]) == 1, warnings
    d.runner.capture_model()  # FastDeploy's next capture serves from graphs again
    serves_like_eager_on_graphs(d, mtp=False)


@pytest.mark.parametrize("fd_version", ["develop"], indirect=True)
def test_the_summary_line_says_whether_a_recapture_fastdeploy_asked_for_found_memory_moved(
    fd_version, plugin_registered
):
    d = start(mtp=False)
    (backend,) = d.backends()
    d.target.clear_graph_opt_backend(fd_config=d.runner.fd_config)
    d.runner.capture_model()  # nothing moved: FastDeploy re-made the graphs all the same
    assert "nothing a graph reads moved" in backend.capture_report.summary()
    d.runner.clear_parameters(pid=0)
    d.runner.update_parameters(pid=0)
    summary = backend.capture_report.summary()
    assert "since the last capture moved: target " in summary
    assert "share_inputs.caches[0]" in str(backend.capture_report.moved)


# ------------------------------------------------------------------ FastDeploy's own backend


@pytest.fixture
def fastdeploys_backend(monkeypatch):
    """FastDeploy's ``CudaGraphPiecewiseBackend`` bound where ``GraphOptBackend`` builds one."""
    if not FASTDEPLOY_BACKEND.exists():
        pytest.skip(f"needs {FASTDEPLOY_BACKEND} (FastDeploy's backend)")
    from fastdeploy.model_executor.graph_optimization import graph_optimization_backend

    monkeypatch.setattr(paddle.device, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(
        graph_optimization_backend, "CudaGraphPiecewiseBackend", fastdeploy_backend_class()
    )


@pytest.mark.parametrize("fd_version", ["2.6", "develop"], indirect=True)
@MODELS
def test_fastdeploys_own_backend_replays_stale_memory_after_wakeup_of_the_kv_cache(
    fd_version, fastdeploys_backend, mtp
):
    d = start(mtp)
    entries = [
        entry
        for backend in d.backends()
        for (_, is_prefill), entry in backend.concrete_size_entries.items()
        if not is_prefill
    ]
    graphs = [e.cuda_graph for e in entries if e.cuda_graph is not None]
    assert len(graphs) == len(entries)  # every decode size captured, by FastDeploy's backend

    def replays() -> int:
        return sum(g.replays for g in graphs)

    before = replays()
    assert mismatches(d, STEPS[mtp]) == []  # its graphs are right until the wake-up
    assert replays() > before
    d.worker.sleep(tags="kv_cache")
    d.worker.wakeup(tags="kv_cache")
    d.prefill(seed=3)
    before = replays()
    wrong = mismatches(d, STEPS[mtp])
    assert replays() > before  # the same graphs, replayed on the freed memory
    served = len(STEPS[mtp]) * (2 if mtp else 1)
    assert len(wrong) == served and all(w.endswith("(max abs difference nan)") for w in wrong)


# ------------------------------------------------------------------ what the stand-in moves


def addresses(d: Deployment) -> dict[str, tuple[int, ...]]:
    """``data_ptr()``s of what a decode graph reads, by kind."""
    runner = d.runner
    found = {
        "weights": tuple(p.data_ptr() for p in d.target.parameters()),
        "caches": tuple(t.data_ptr() for t in runner.share_inputs["caches"]),
        "rope_emb": (runner.share_inputs["rope_emb"].data_ptr(),),
        "ids": (runner.share_inputs["ids"].data_ptr(),),
    }
    if d.draft is not None:
        inputs = runner.proposer.model_inputs
        found["draft weights"] = tuple(p.data_ptr() for p in d.draft.parameters())
        found["draft caches"] = tuple(t.data_ptr() for t in inputs["caches"])
        found["draft rope_emb"] = (inputs["rope_emb"].data_ptr(),)
        found["draft ids"] = (inputs["ids"].data_ptr(),)
    return found


def _clear_and_update(d: Deployment) -> None:
    d.runner.clear_parameters(pid=0)
    d.runner.update_parameters(pid=0)


def _sleep_and_wake(tags: str):
    def run(d: Deployment) -> None:
        d.worker.sleep(tags=tags)
        d.worker.wakeup(tags=tags)

    return run


EVENTS = {
    "update_weights": lambda d: d.worker.update_weights(version="v2"),
    "clear+update_parameters": _clear_and_update,
    "sleep+wakeup weight,kv_cache": _sleep_and_wake("weight,kv_cache"),
    "sleep+wakeup kv_cache": _sleep_and_wake("kv_cache"),
}
#: What each event moves (new data_ptr), per release, from gpu_model_runner.py, input_batch.py,
#: mtp.py and dynamic_weight_manager.py of each branch (docs/modes.md, "Lifecycle").
_INPUTS = {"rope_emb", "draft ids", "draft rope_emb"}
_KV = {"caches", "draft caches"}
_WEIGHTS = {"weights", "draft weights"}
MOVES = {
    ("update_weights", "2.5"): set(),
    ("clear+update_parameters", "2.4"): {"weights", "caches"},
    ("clear+update_parameters", "2.5"): _WEIGHTS | _KV | _INPUTS,
    ("sleep+wakeup weight,kv_cache", "2.5"): _WEIGHTS | _KV | _INPUTS,
    ("sleep+wakeup kv_cache", "2.5"): _KV | _INPUTS,
}


@pytest.mark.parametrize("fd_version", ALL_RELEASES, indirect=True)
@pytest.mark.parametrize("event", list(EVENTS))
def test_the_stand_in_moves_what_each_release_of_fastdeploy_moves(
    fd_version, plugin_registered, event
):
    d = start(mtp=True)
    if fd_version == "2.4" and event != "clear+update_parameters":
        with pytest.raises(AttributeError, match=r"'GpuWorker' object has no attribute"):
            EVENTS[event](d)  # 2.4 has no update_weights, sleep or wakeup
        return
    before = addresses(d)
    EVENTS[event](d)
    after = addresses(d)
    moved = {kind for kind in before if before[kind] != after[kind]}
    expected = MOVES.get((event, fd_version), MOVES.get((event, "2.5")))
    assert moved == expected
