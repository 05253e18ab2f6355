"""A rank's end of the agreement (``ranks/link.py``) over an in-memory store, ranks in threads,
ordered by events: what it writes before it posts, what it reads back, and a rank that leaves a
call. The rule itself is ``test_verdict.py``'s; real processes over Paddle's store are
``test_liveness.py``'s."""

from __future__ import annotations

import threading

from fd_cudagraph_plugin.core.ranks.agreement import agreed_error
from fd_cudagraph_plugin.core.ranks.link import StoreLink
from fd_cudagraph_plugin.core.ranks.messages import Failure, Posted, Status, encode


class Store:
    """Paddle's store as the link sees it, in memory. ``get`` of a key nobody wrote fails (Paddle's
    blocks for ever). ``hold`` stops the rank whose add sets that bit right after it, until
    ``release``."""

    def __init__(self, hold: int | None = None) -> None:
        self.values: dict[str, object] = {}
        self.lock = threading.Lock()
        self.hold = hold
        self.held = threading.Event()
        self.release = threading.Event()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            value = int(self.values.get(key, 0)) + amount
            self.values[key] = value
        if self.hold is not None and key.endswith("/c") and amount & self.hold:
            self.held.set()
            self.release.wait(60)
        return value

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.values[key] = bytes(value)

    def get(self, key: str) -> bytes:
        with self.lock:
            if key not in self.values:
                raise KeyError(f"{key} was read before anyone wrote it")
            return self.values[key]


def _failure(rank: int, stage: str, error: str, where: str = "") -> Failure:
    return Failure(
        rank=rank,
        stage=stage,
        where=where,
        mode="m",
        error=error,
        out_of_memory="out of memory" in error,
        explained=False,
        advice="",
    )


def _in_thread(call):
    box: list = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    return thread, box


def test_a_status_is_in_the_store_before_its_post_counts():
    """Rank 1 stands still right after its post; rank 0 completes the point and reads rank 1's
    status. Planted: a post made before the status is written fails here (the status is read
    before it exists)."""
    store = Store(hold=1 << 1)
    zero, one = (StoreLink(store, "g", rank, 2) for rank in (0, 1))
    thread, late = _in_thread(lambda: one.agree("c1.s1.0", "plan", Status(payload="one"), 300))
    assert store.held.wait(60)
    first = zero.agree("c1.s1.0", "plan", Status(payload="zero"), 300)
    store.release.set()
    thread.join(60)
    assert first.complete and first.shared() == ["zero", "one"]
    assert late[0].complete and late[0].shared() == ["zero", "one"]


def test_a_status_that_is_not_its_ranks_is_that_ranks_failure_on_every_rank():
    """Bytes in the store are from outside: rank 1's entry is overwritten with a post of another
    point claiming rank 0's failure. Every rank reads the same failure of rank 1."""
    store = Store(hold=1 << 1)
    zero, one = (StoreLink(store, "g", rank, 2) for rank in (0, 1))
    thread, late = _in_thread(lambda: one.agree("c1.s1.0", "plan", Status(payload=True), 300))
    assert store.held.wait(60)
    forged = _failure(0, "x", "")
    store.set(
        "g/c1.s1.0/s1", encode(Posted(point="c1.s9.9", label="plan", status=Status(failure=forged)))
    )
    first = zero.agree("c1.s1.0", "plan", Status(), 300)
    store.release.set()
    thread.join(60)
    errors = [str(agreed_error(a, 2, 300)) for a in (first, late[0])]
    assert errors[0] == errors[1] and "MalformedStatus: rank 1" in errors[0], errors


def test_a_rank_that_leaves_a_call_releases_the_others_waiting_anywhere_in_it():
    """Rank 1 failed at another point of the same call and left it: rank 0, waiting with a 300 s
    timeout, gives up at once and reads why; a point of the next call is not touched."""
    store = Store()
    zero, one = (StoreLink(store, "g", rank, 2) for rank in (0, 1))
    thread, found = _in_thread(lambda: zero.agree("c4.after.0", "after wakeup", Status(), 300))
    failure = _failure(1, "capture", "RuntimeError: out of memory", where="decode size 4")
    one.stop("c4.s1.3", "capture decode size 4", Status(failure=failure))
    thread.join(60)
    assert not thread.is_alive()
    agreed = found[0]
    assert not agreed.complete and agreed.outcome.stopped[1].failure == failure
    message = str(agreed_error(agreed, 2, 300))
    assert "capture failed on tensor-parallel rank 1 of 2 for decode size 4" in message
    assert "that rank 1 will not join" in message
    thread, later = _in_thread(lambda: zero.agree("c5.after.0", "after sleep", Status(), 300))
    one.agree("c5.after.0", "after sleep", Status(), 300)
    thread.join(60)
    assert later[0].complete


def test_an_interrupt_while_a_rank_waits_at_a_point_is_handed_back_with_the_outcome():
    """SIGINT reaches rank 0 while it waits for rank 1: the point still completes on both (the
    interrupt cannot lose a post or a read), and rank 0's outcome says it was interrupted, for
    the agreement to post at its next point. Planted: without the held signal, the interrupt
    escapes from inside the wait."""
    import os
    import signal

    store = Store()
    zero, one = (StoreLink(store, "g", rank, 2) for rank in (0, 1))
    waiting = threading.Event()
    reads = store.add

    def add(key, amount):
        if amount == 0 and key.endswith("/c"):
            waiting.set()
        return reads(key, amount)

    store.add = add

    def interrupt_then_post():
        waiting.wait(60)
        os.kill(os.getpid(), signal.SIGINT)
        one.agree("c2.after.0", "after sleep", Status(payload="one"), 300)

    thread = threading.Thread(target=interrupt_then_post, daemon=True)
    thread.start()
    agreed = zero.agree("c2.after.0", "after sleep", Status(payload="zero"), 300)
    thread.join(60)
    assert agreed.complete and agreed.interrupted
    assert agreed.shared() == ["zero", "one"]


# ------------------------------------------------------------------- what a post may weigh


def _posts(store: Store) -> dict[str, bytes]:
    """Every post (status or 'left' mark) written to ``store``, by key."""
    return {key: value for key, value in store.values.items() if isinstance(value, bytes)}


def test_the_largest_posts_a_capture_session_makes_fit_under_the_cap(plugin_registered):
    """A session of a target and an MTP draft over FastDeploy's default list at its largest
    (max_num_seqs 512, k = 1: 35 sizes up to 1,024 tokens), none warmed, through a rank's real
    end over the store: its plan; the self-check of every graph of both, each failed
    (FD_CUDAGRAPH_SELF_CHECK=warn, as a model with a host-side value fails it); then a capture
    that runs out of memory with the longest error a rank posts, in 4-byte characters. Each post
    must stay within MAX_POST_BYTES: over it, the rank's post is replaced by a MalformedStatus
    that blames another plugin version (the self-check's did: 17,273 bytes)."""
    from types import SimpleNamespace

    import paddle
    import pytest
    from conftest import HIDDEN, DecoratedBackbone, DecoratedDraft, make_config
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    from fd_cudagraph_plugin.core import guards
    from fd_cudagraph_plugin.core.capture import self_checks
    from fd_cudagraph_plugin.core.errors import CaptureError
    from fd_cudagraph_plugin.core.ranks.messages import (
        MAX_POST_BYTES,
        PlanPayload,
        SelfChecks,
        read_posted,
    )
    from fd_cudagraph_plugin.core.session import CaptureSession

    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    config = make_config(512, speculative=mtp, draft_model_use_cudagraph=True)
    target, draft = DecoratedBackbone(fd_config=config), DecoratedDraft(fd_config=config)
    runner = GPUModelRunner(config, target, draft_model=draft)
    runner.profile_run()
    sizes = config.graph_opt_config.cudagraph_capture_sizes
    count = len(sizes)
    assert count == 35 and max(sizes) == 1024
    store = Store()

    def differs(key):
        wrong = SimpleNamespace(
            phase=key.phase,
            size=key.size,
            replay=lambda: None,
            result=paddle.full([key.size, HIDDEN], 0.5, dtype="bfloat16"),
        )
        eager = paddle.full([key.size, HIDDEN], -12345.6, dtype="bfloat16")
        return lambda: guards.self_check(wrong, lambda: eager)

    def out_of_memory():
        raise MemoryError("CUDA out of memory " + "\U0001f600" * 10_000)

    with (
        pytest.raises(CaptureError, match="MemoryError: CUDA out of memory"),
        CaptureSession(
            "decode", fd_config=config, runner=runner, link=StoreLink(store, "g", 0, 1)
        ) as session,
    ):
        members = session.members
        assert sorted(m.role for m in members) == ["draft", "target"]
        checks = [
            (f"{m.role} {e.key}", m, e.key, differs(e.key)) for m in members for e in m.expected()
        ]
        assert len(checks) == 2 * count
        assert len(self_checks(session.agreement, checks, error=False)) == 2 * count
        largest = max(members[0].expected(), key=lambda e: e.key.size)
        session.agreement.run("capture", members[0], largest.key, out_of_memory)
    posts = {key: read_posted(body) for key, body in _posts(store).items()}
    kinds = {type(p.status.payload).__name__: key for key, p in posts.items()}
    plan, checked = posts[kinds["PlanPayload"]], posts[kinds["SelfChecks"]]
    assert isinstance(plan.status.payload, PlanPayload)
    assert [len(u.decode) for u in plan.status.payload.unwarmed] == [count, count]
    assert isinstance(checked.status.payload, SelfChecks)
    assert len(checked.status.payload.failed) == 2 * count
    assert all("differs (max abs difference" in v for v in checked.status.payload.failed.values())
    failures = [p.status.failure for p in posts.values() if p.status.failure is not None]
    assert failures and all(f.error.startswith("MemoryError: CUDA out of memory") for f in failures)
    assert all(f.out_of_memory and f.advice for f in failures)
    sizes = {key: len(body) for key, body in _posts(store).items()}
    assert max(sizes.values()) <= MAX_POST_BYTES, sizes


def test_a_post_over_the_cap_is_its_ranks_failure_and_bytes_over_it_are_never_read():
    """messages.py: one over MAX_POST_BYTES is its rank's failure, never a truncated read."""
    import msgspec
    import pytest

    from fd_cudagraph_plugin.core.ranks.messages import (
        MAX_POST_BYTES,
        MAX_TEXT,
        SelfChecks,
        read_posted,
    )

    heavy = SelfChecks(failed={f"target decode size {n}": "x" * MAX_TEXT for n in range(9)})
    body = encode(Posted(point="c1.s1.0", label="self-check", status=Status(payload=heavy)))
    assert len(body) > MAX_POST_BYTES
    with pytest.raises(msgspec.DecodeError, match=rf"^{len(body)} bytes, over {MAX_POST_BYTES}$"):
        read_posted(body)
    store = Store()
    agreed = StoreLink(store, "g", 0, 1).agree("c1.s1.0", "self-check", Status(payload=heavy), 5)
    written = _posts(store)["g/c1.s1.0/s0"]
    assert len(written) <= MAX_POST_BYTES and read_posted(written).status.failure is not None
    message = str(agreed_error(agreed, 1, 5))
    assert "MalformedStatus: rank 0 posted a status at 'self-check'" in message
    assert f"it is {len(body)} bytes, over {MAX_POST_BYTES}" in message
