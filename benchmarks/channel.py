"""Which channel the tensor-parallel ranks should agree over: TP rank 0's socket server, or a
``paddle.distributed`` gloo group. Two CPU ranks, both links measured in one run.

The gloo link (``GlooLink`` below) has the socket link's interface (``agree(label, status,
timeout) -> Outcome``): each point is one ``all_gather`` of a fixed 1 KiB CPU buffer holding the
JSON of (label, status) over a gloo group made with ``new_group(ranks, backend="gloo")`` under a
custom group id (as FastDeploy's ``set_communicate_group`` does with ``_set_custom_gid``), a second
``all_gather`` only if some status is longer. Paddle gives no per-call timeout for gloo, so it is
measured three ways: blocking, waited for in a thread (``+thread``), and under ``SIGALRM``
(``+alarm``). A ``gloo object`` arm uses Paddle's ``all_gather_object`` for the healthy cost.

Scenarios, each launched afresh (the ranks are started here with the environment Paddle's
launcher gives them, not by the launcher itself, which stops every rank once one dies):

* ``healthy``: cost per point (110 points of small JSON statuses a round, arms interleaved,
  medians over rounds); then a slow peer (rank 1 reaches a point ``--late`` s late, timeout
  ``--timeout`` s) for each link, and whether the next point completes; then a peer later than
  gloo's own timeout (``--beyond`` s late) and the point after it;
* ``dead-<link>@<rank>``: that rank kills itself (SIGKILL) while the other waits at a point: how
  long until the survivor's call returns or raises, what it says, and whether the next point
  answers; once more over four ranks (rank 3 killed), where gloo's ring names a neighbour;
* ``absent``: rank 1 never joins: the socket link's point, and gloo's group creation, on rank 0.

    python benchmarks/channel.py [--rounds 15] [--timeout 2] [--late 5] [--beyond 35]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fd_cudagraph_plugin.core.channel import SocketLink  # noqa: E402
from fd_cudagraph_plugin.core.wire import Outcome  # noqa: E402

POINTS = 110
#: A group id of the plugin's own, apart from FastDeploy's TP and EP groups
#: (``FD_TP_GROUP_GID_OFFSET`` + data-parallel rank), one per TP group: the base plus the TP
#: group's first global rank, so data-parallel replicas never share one.
GID_BASE = 7_340_000
CAPACITY = 1024
RANK_DEADLINE_S = 420
PHASE_LIMIT_S = 480
DEAD_PHASES = ("dead-socket@1", "dead-gloo@1", "dead-socket@0", "dead-gloo@0")
#: Four ranks, rank 3 killed: which rank does each survivor name, and when?
DEAD_OF_FOUR = ("dead-socket@3", "dead-gloo@3")


class Abandoned(Exception):
    """This rank stopped waiting at a point."""


class GlooLink:
    """A rank's end of the agreement over a gloo group: one ``all_gather`` a point.

    ``bound``: ``"none"`` waits as long as gloo does; ``"thread"`` runs the collective in a
    thread and stops waiting after ``timeout`` (the collective stays open: the next point first
    waits for it); ``"alarm"`` raises from a ``SIGALRM`` handler after ``timeout``, which Python
    runs only once the gloo call has returned."""

    def __init__(self, group: Any, rank: int, world: int, *, gather: str = "bytes") -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.gather = gather
        self.bound = "none"
        self.last_error = ""
        self._pending: threading.Thread | None = None
        self._epoch = -1

    def next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def agree(self, label: str, status: dict[str, Any] | None, timeout: float) -> Outcome:
        others = tuple(r for r in range(self.world) if r != self.rank)
        self.last_error = ""
        try:
            if self.bound == "thread":
                posts = self._in_thread(label, status, timeout)
            elif self.bound == "alarm":
                posts = self._with_alarm(label, status, timeout)
            else:
                posts = self._gather(label, status)
        except Abandoned:
            # gloo cannot say which rank did not come: every other rank is named
            self.last_error = f"gave up after {timeout:g} s"
            return Outcome(label, {self.rank: status}, others, ())
        except Exception as error:
            self.last_error = f"{type(error).__name__}: {error}"
            return Outcome(label, {self.rank: status}, others, ())
        labels = {post["label"] for post in posts}
        if labels != {label}:
            self.last_error = f"labels differ: {sorted(labels)}"
        return Outcome(label, {r: post["status"] for r, post in enumerate(posts)})

    def _gather(self, label: str, status: Any) -> list[dict[str, Any]]:
        import paddle.distributed as dist

        if self.gather == "object":
            posts: list[Any] = []
            dist.all_gather_object(posts, {"label": label, "status": status}, group=self.group)
            return posts
        import numpy as np
        import paddle

        body = json.dumps({"label": label, "status": status}, separators=(",", ":")).encode()
        buffer = np.zeros(CAPACITY, dtype=np.uint8)
        buffer[:4] = np.frombuffer(len(body).to_bytes(4, "big"), dtype=np.uint8)
        if len(body) <= CAPACITY - 4:
            buffer[4 : 4 + len(body)] = np.frombuffer(body, dtype=np.uint8)
        gathered: list[Any] = []
        dist.all_gather(
            gathered, paddle.to_tensor(buffer, place=paddle.CPUPlace()), group=self.group
        )
        arrays = [t.numpy() for t in gathered]
        lengths = [int.from_bytes(a[:4].tobytes(), "big") for a in arrays]
        if max(lengths) <= CAPACITY - 4:
            bodies = [a[4 : 4 + n].tobytes() for a, n in zip(arrays, lengths, strict=True)]
        else:  # a second round, sized for the longest status (every rank knows every length)
            longer = np.zeros(max(lengths), dtype=np.uint8)
            longer[: len(body)] = np.frombuffer(body, dtype=np.uint8)
            gathered = []
            dist.all_gather(
                gathered, paddle.to_tensor(longer, place=paddle.CPUPlace()), group=self.group
            )
            bodies = [t.numpy()[:n].tobytes() for t, n in zip(gathered, lengths, strict=True)]
        return [json.loads(b) for b in bodies]

    def _in_thread(self, label: str, status: Any, timeout: float) -> list[dict[str, Any]]:
        if self._pending is not None:
            self._pending.join(timeout)  # the last point's collective is still open
            if self._pending.is_alive():
                raise Abandoned
            self._pending = None
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["posts"] = self._gather(label, status)
            except Exception as error:
                result["error"] = error

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            self._pending = thread
            raise Abandoned
        if "error" in result:
            raise result["error"]
        return result["posts"]

    def _with_alarm(self, label: str, status: Any, timeout: float) -> list[dict[str, Any]]:
        def ring(signum: int, frame: Any) -> None:
            raise Abandoned

        previous = signal.signal(signal.SIGALRM, ring)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return self._gather(label, status)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------------------ one rank


class Rank:
    def __init__(self, args: argparse.Namespace) -> None:
        import paddle.distributed as dist

        self.args = args
        self.dist = dist
        dist.init_parallel_env()  # the job's default group: gloo on CPU Paddle
        self.index = dist.get_rank()
        self.world = dist.get_world_size()
        self.facts: dict[str, Any] = {"rank": self.index}
        self.path = Path(args.out, f"{args.phase}.rank{self.index}.json")
        self.save()

    def save(self) -> None:
        """What this rank found so far (a rank that dies leaves what it had)."""
        self.path.write_text(json.dumps(self.facts))

    def socket_link(self, name: str, timeout: float = 60.0) -> SocketLink:
        from paddle.base import core

        from fd_cudagraph_plugin.core.channel import listen_host

        store = core.create_or_get_global_tcp_store()
        host = listen_host(list(range(self.world)))
        return SocketLink.connect(
            store, f"fd-cudagraph/channel/{name}", self.index, self.world, host, timeout
        )

    def gloo_group(self, ranks: list[int]) -> Any:
        """A gloo group as FastDeploy makes its TP group: a custom group id around
        ``new_group``. The 2 s ``timeout`` is to show whether it reaches gloo."""
        collective = self.dist.collective
        collective._set_custom_gid(GID_BASE + ranks[0])
        try:
            return self.dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=2))
        finally:
            collective._set_custom_gid(None)

    def point(self, link: Any, label: str, timeout: float) -> dict[str, Any]:
        started = time.monotonic()
        outcome = link.agree(label, {"payload": {"label": label, "rank": self.index}}, timeout)
        return {
            "seconds": time.monotonic() - started,
            "end": time.time(),
            "complete": outcome.complete,
            "missing": list(outcome.missing),
            "lost": list(outcome.lost),
            "error": getattr(link, "last_error", ""),
        }


def healthy(rank: Rank) -> None:
    args = rank.args
    started = time.perf_counter()
    links: dict[str, Any] = {"socket": rank.socket_link("healthy")}
    rank.facts["join_socket_s"] = time.perf_counter() - started
    started = time.perf_counter()
    group = rank.gloo_group(list(range(rank.world)))
    rank.facts["join_gloo_s"] = time.perf_counter() - started
    links["gloo"] = GlooLink(group, rank.index, rank.world)
    links["gloo object"] = GlooLink(group, rank.index, rank.world, gather="object")
    statuses = [None, {"payload": {"size": 512, "pool": 1, "graphs": 36}}, None]
    times: dict[str, list[float]] = {arm: [] for arm in links}
    arms = list(links)
    for round_ in range(args.rounds + 1):  # round 0 warms every arm up, unmeasured
        for arm in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:
            link = links[arm]
            link.next_epoch()
            rank.dist.barrier()
            began = time.perf_counter()
            for i in range(POINTS):
                outcome = link.agree(f"point {i}", statuses[i % len(statuses)], 60.0)
                assert outcome.complete and len(outcome.statuses) == rank.world, outcome
            if round_:
                times[arm].append((time.perf_counter() - began) / POINTS)
    rank.facts["per_point_s"] = times
    rank.save()

    # A slow peer: rank 1 comes --late seconds after rank 0, which waits --timeout seconds.
    variants = {"socket": "socket", "gloo": "none", "gloo+thread": "thread", "gloo+alarm": "alarm"}
    slow: dict[str, Any] = {}
    for name, bound in variants.items():
        link = links["socket" if name == "socket" else "gloo"]
        if name != "socket":
            link.bound = bound
        link.next_epoch()
        rank.dist.barrier()
        if rank.index == 1:
            time.sleep(args.late)
        facts = rank.point(link, "slow", args.timeout)
        facts["next"] = rank.point(link, "next", max(args.late * 2, 10))
        slow[name] = facts
        rank.facts["slow"] = slow
        rank.save()
        links["gloo"].bound = "none"
        rank.dist.barrier()

    # Later than gloo's own timeout; the point after is waited for in a thread (bounded).
    if args.beyond:
        link = links["gloo"]
        rank.dist.barrier()
        if rank.index == 1:
            time.sleep(args.beyond)
        facts = rank.point(link, "beyond", args.beyond * 2)
        link.bound = "thread"
        facts["next"] = rank.point(link, "next", args.beyond + 15)
        facts["next2"] = rank.point(link, "next 2", args.beyond + 15)
        rank.facts["beyond"] = facts
        rank.save()


def dead(rank: Rank) -> None:
    kind, _, victim = rank.args.phase.removeprefix("dead-").partition("@")
    if kind == "socket":
        link: Any = rank.socket_link(rank.args.phase)
    else:
        link = GlooLink(rank.gloo_group(list(range(rank.world))), rank.index, rank.world)
    link.next_epoch()
    rank.facts["first"] = rank.point(link, "first", 30.0)
    rank.save()
    killed_at = Path(rank.args.out, f"{rank.args.phase}.killed_at")
    if rank.index == int(victim):
        time.sleep(1.0)  # the other rank is waiting at the next point by now
        killed_at.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    facts = rank.point(link, "dead", 60.0)
    if killed_at.exists():
        facts["after_kill_s"] = facts["end"] - float(killed_at.read_text())
    if rank.world == 2:
        if isinstance(link, GlooLink):
            link.bound = "thread"  # the next point may hang: wait for it in a thread
        facts["next"] = rank.point(link, "next", 40.0)
    rank.facts["dead"] = facts
    rank.save()


def absent(rank: Rank) -> None:
    """Rank 1 never joins: rank 0's socket point, then rank 0 creating a gloo group alone
    (last: the blocked creation holds this process's store connection)."""
    args = rank.args
    if rank.index == 1:
        # The converse for the socket link: rank 0 never starts its server.
        started = time.monotonic()
        try:
            rank.socket_link("absent-server", timeout=args.timeout)
            rank.facts["no_server"] = {"error": "", "seconds": time.monotonic() - started}
        except Exception as error:
            rank.facts["no_server"] = {
                "error": f"{type(error).__name__}: {error}",
                "seconds": time.monotonic() - started,
            }
        rank.save()
        done = Path(args.out, "absent.done")
        deadline = time.monotonic() + args.create_wait + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        return
    link = rank.socket_link("absent")
    link.next_epoch()
    rank.facts["socket"] = rank.point(link, "absent", args.timeout)
    rank.save()
    result: dict[str, Any] = {}

    def create() -> None:
        try:
            rank.gloo_group([0, 1])
            result["created"] = True
        except Exception as error:
            result["error"] = f"{type(error).__name__}: {error}"

    started = time.monotonic()
    thread = threading.Thread(target=create, daemon=True)
    thread.start()
    thread.join(args.create_wait)
    rank.facts["gloo_create"] = {
        "returned": not thread.is_alive(),
        "seconds": time.monotonic() - started,
        **result,
    }
    rank.save()
    Path(args.out, "absent.done").write_text("")


def rank_main(args: argparse.Namespace) -> int:
    faulthandler.dump_traceback_later(RANK_DEADLINE_S, exit=True)
    rank = Rank(args)
    if args.phase == "healthy":
        healthy(rank)
    elif args.phase.startswith("dead-"):
        dead(rank)
    else:
        absent(rank)
    rank.facts["finished"] = True
    rank.save()
    sys.stdout.flush()
    sys.stderr.flush()
    # A gloo collective or store wait may still be open in a thread: leave without joining it.
    os._exit(0)


# ---------------------------------------------------------------------------------- driver


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: argparse.Namespace, phase: str, out: Path, world: int = 2) -> list[dict[str, Any]]:
    """``world`` ranks with the environment ``paddle.distributed.launch`` gives a CPU job's workers;
    each rank's facts (empty if it left none), its exit status and the tail of its log."""
    endpoints = [f"127.0.0.1:{_free_port()}" for _ in range(world)]
    procs, logs = [], []
    for index in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PADDLE_MASTER": endpoints[0],
            "PADDLE_GLOBAL_SIZE": str(world),
            "PADDLE_LOCAL_SIZE": str(world),
            "PADDLE_GLOBAL_RANK": str(index),
            "PADDLE_LOCAL_RANK": str(index),
            "PADDLE_NNODES": "1",
            "PADDLE_CURRENT_ENDPOINT": endpoints[index],
            "PADDLE_TRAINER_ID": str(index),
            "PADDLE_TRAINERS_NUM": str(world),
            "PADDLE_RANK_IN_NODE": str(index),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
            "PADDLE_DISTRI_BACKEND": "gloo",
        }
        log = open(out / f"{phase}.log{index}", "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        command = [
            sys.executable, __file__, "--rank", "--phase", phase, "--out", str(out),
            "--timeout", str(args.timeout), "--late", str(args.late), "--beyond",
            str(args.beyond), "--rounds", str(args.rounds), "--create-wait",
            str(args.create_wait),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    deadline = time.monotonic() + PHASE_LIMIT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(other.pid, signal.SIGKILL)
            proc.wait()
    results = []
    for index, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        log.close()
        path = out / f"{phase}.rank{index}.json"
        facts = json.loads(path.read_text()) if path.exists() else {}
        tail = (out / f"{phase}.log{index}").read_text(errors="replace")[-1500:]
        results.append({**facts, "returncode": proc.returncode, "log": tail})
    return results


def _us(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e6:.0f}"


def _short(text: str, width: int = 150) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _blamed(facts: dict[str, Any]) -> list[int]:
    """The ranks an outcome blames: the socket server's ``missing``; for gloo, the
    ``pair_rank`` its error text names (Paddle's gloo says which pair failed, not who)."""
    error = facts.get("error", "")
    named = error.split("pair_rank = ")[1].split()[0] if "pair_rank = " in error else ""
    if named.isdigit():
        return [int(named)]
    return [] if error else list(facts.get("missing", []))


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> str:
    lines: list[str] = []
    healthy_ranks = results["healthy"]
    columns = ["socket", "gloo", "gloo+thread", "gloo+alarm"]
    rows: list[tuple[str, list[str]]] = []

    def per_point(arm: str) -> str:
        values = [r.get("per_point_s", {}).get(arm) for r in healthy_ranks]
        if not all(values):
            return "-"
        return " / ".join(_us(v) for v in values)

    rows.append(
        (
            f"cost per point, us (median of {args.rounds}; rank 0 / rank 1)",
            [per_point("socket"), per_point("gloo"), "as gloo", "as gloo"],
        )
    )
    rows.append(("  gloo all_gather_object instead, us", ["", per_point("gloo object"), "", ""]))
    joins = [
        " / ".join(f"{r.get(key, float('nan')) * 1e3:.0f}" for r in healthy_ranks)
        for key in ("join_socket_s", "join_gloo_s")
    ]
    rows.append(("join once per process, ms", [joins[0], joins[1], "as gloo", "as gloo"]))

    slow0 = healthy_ranks[0].get("slow", {})
    slow1 = healthy_ranks[1].get("slow", {})
    title = f"slow peer (timeout {args.timeout:g} s, rank 1 {args.late:g} s late)"
    rows.append((title, ["", "", "", ""]))

    def slow_cell(name: str, field: str) -> str:
        facts = slow0.get(name)
        if not facts:
            return "-"
        if field == "waited":
            return f"{facts['seconds']:.2f} s"
        if field == "bounded":
            return "yes" if facts["seconds"] < args.timeout + 0.5 else "no"
        if field == "outcomes":
            other = slow1.get(name, {})
            return (
                f"{'complete' if facts['complete'] else 'abandoned'} / "
                f"{'complete' if other.get('complete') else 'abandoned'}"
            )
        if field == "names":
            blamed = _blamed(facts) if name == "socket" or facts["error"] else []
            return "yes" if blamed == [1] else "no"
        following = facts["next"]
        return (
            f"{'complete' if following['complete'] else 'NOT complete'} "
            f"({following['seconds']:.2f} s)"
        )

    for label, field in (
        ("  rank 0's call returned after", "waited"),
        ("  bounded by the timeout", "bounded"),
        ("  outcome on rank 0 / rank 1", "outcomes"),
        ("  names the rank that did not come", "names"),
        ("  next point on rank 0 (rank 1 there at 5 s)", "next"),
    ):
        rows.append((label, [slow_cell(name, field) for name in columns]))

    beyond = [r.get("beyond", {}) for r in healthy_ranks]
    if beyond[0]:
        rows.append((f"gloo peer {args.beyond:g} s late (past gloo's own 30 s)", [""] * 4))
        said = beyond[0]["error"]
        blamed = ", ".join(str(r) for r in _blamed(beyond[0])) or "none"
        rows.append(
            (
                "  rank 0's call returned after, blames",
                [
                    "as slow peer",
                    f"{beyond[0]['seconds']:.1f} s ({'raised' if said else 'complete'}), "
                    f"rank {blamed}",
                    "",
                    "",
                ],
            )
        )
        broken = all(r.get("next2", {}).get("error") for r in beyond)
        rows.append(
            (
                "  next two points, both ranks",
                ["", "raise at once: broken for good" if broken else "usable", "", ""],
            )
        )

    for victim in (1, 0):
        survivor = 1 - victim
        title = f"dead peer (kill -9 rank {victim} while rank {survivor} waits)"
        rows.append((title, ["", "", "", ""]))
        cells: dict[str, list[str]] = {"after": [], "names": [], "next": []}
        for kind in ("socket", "gloo"):
            ranks = results.get(f"dead-{kind}@{victim}", [{}, {}])
            facts = ranks[survivor].get("dead", {})
            if not facts:
                for key in cells:
                    cells[key].append(f"no result (rc {ranks[survivor].get('returncode')})")
                continue
            after = facts.get("after_kill_s")
            cells["after"].append("-" if after is None else f"{after * 1e3:.0f} ms")
            blamed = _blamed(facts)
            how = "lost" if facts["lost"] == [victim] else "in the error text"
            cells["names"].append(f"yes ({how})" if blamed == [victim] else f"no: {blamed}")
            following = facts["next"]
            verb = "raises" if following["error"] else "answers"
            cells["next"].append(
                f"{verb} at once ({following['seconds']:.2f} s)"
                if following["seconds"] < 1
                else f"{verb} after {following['seconds']:.1f} s"
            )
        for label, key in (
            ("  survivor's call returned after the kill", "after"),
            ("  names the dead rank", "names"),
            ("  next point on the survivor", "next"),
        ):
            rows.append((label, [*cells[key], "as gloo", "as gloo"]))

    rows.append(("dead peer, 4 ranks (kill -9 rank 3): returned after, blames", ["", "", "", ""]))
    for survivor in range(3):
        cells_4: list[str] = []
        for kind in ("socket", "gloo"):
            ranks = results.get(f"dead-{kind}@3", [{}] * 4)
            facts = ranks[survivor].get("dead", {}) if len(ranks) > survivor else {}
            if not facts:
                cells_4.append("no result")
                continue
            after = facts.get("after_kill_s")
            when = "-" if after is None else f"{after:.2f} s"
            blamed = ", ".join(str(r) for r in _blamed(facts)) or "none"
            cells_4.append(f"{when}, rank {blamed}")
        rows.append((f"  rank {survivor}", [*cells_4, "as gloo", "as gloo"]))

    absent_ranks = results["absent"]
    socket_facts = absent_ranks[0].get("socket", {})
    create = absent_ranks[0].get("gloo_create", {})
    rows.append(("rank 1 never joins", ["", "", "", ""]))
    rows.append(
        (
            "  rank 0 (socket: a point; gloo: new_group)",
            [
                f"abandoned after {socket_facts.get('seconds', float('nan')):.2f} s, "
                f"names rank {', '.join(map(str, socket_facts.get('missing', [])))}",
                (
                    f"new_group returned after {create['seconds']:.1f} s"
                    if create.get("returned")
                    else f"new_group still waiting after {create.get('seconds', 0):.0f} s"
                ),
                "as gloo",
                "as gloo",
            ],
        )
    )

    width = max(len(label) for label, _ in rows)
    widths = [max(len(c), *(len(cells[i]) for _, cells in rows)) for i, c in enumerate(columns)]
    lines.append(
        " | ".join([" " * width, *(c.ljust(w) for c, w in zip(columns, widths, strict=True))])
    )
    lines.append("-+-".join(["-" * width, *("-" * w for w in widths)]))
    for label, cells in rows:
        lines.append(
            " | ".join(
                [label.ljust(width), *(c.ljust(w) for c, w in zip(cells, widths, strict=True))]
            )
        )

    lines.append("")
    lines.append("What the calls said:")
    for name in columns[1:]:
        if slow0.get(name, {}).get("error"):
            lines.append(f"  slow peer, {name}, rank 0: {_short(slow0[name]['error'])}")
    for victim in (1, 0):
        for kind in ("socket", "gloo"):
            ranks = results.get(f"dead-{kind}@{victim}", [{}, {}])
            facts = ranks[1 - victim].get("dead", {})
            if facts:
                said = facts["error"] or (
                    f"Outcome(missing={facts['missing']}, lost={facts['lost']})"
                )
                lines.append(f"  dead rank {victim}, {kind}: {_short(said)}")
                if facts["next"]["error"]:
                    lines.append(f"    next point: {_short(facts['next']['error'])}")
            elif ranks[1 - victim].get("log"):
                lines.append(
                    f"  dead rank {victim}, {kind}: survivor's log: "
                    f"{_short(ranks[1 - victim]['log'][-300:])}"
                )
    for kind in ("socket", "gloo"):
        for survivor, facts in enumerate(results.get(f"dead-{kind}@3", [])[:3]):
            said = facts.get("dead", {}).get("error")
            if said:
                lines.append(f"  4 ranks, dead rank 3, {kind}, rank {survivor}: {_short(said)}")
    beyond0 = healthy_ranks[0].get("beyond")
    beyond1 = healthy_ranks[1].get("beyond")
    if beyond0:
        lines.append(
            f"  gloo, rank 1 {args.beyond:g} s late: rank 0 returned after "
            f"{beyond0['seconds']:.1f} s: {_short(beyond0['error'] or 'complete')}"
        )
        if beyond1:
            lines.append(
                f"    rank 1 on arrival, after {beyond1['seconds']:.1f} s: "
                f"{_short(beyond1['error'] or 'complete')}"
            )
        for key in ("next", "next2"):
            for index, facts in enumerate((beyond0, beyond1)):
                if facts:
                    step = facts[key]
                    lines.append(
                        f"    {key} point, rank {index}: after {step['seconds']:.1f} s: "
                        f"{_short(step['error'] or 'complete')}"
                    )
    if create.get("error"):
        lines.append(f"  gloo new_group without rank 1: {_short(create['error'])}")
    no_server = absent_ranks[1].get("no_server", {})
    if no_server:
        lines.append(
            f"  socket, rank 0 never starts its server: rank 1 after "
            f"{no_server['seconds']:.2f} s: {_short(no_server['error'])}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=2.0, help="FD_CUDAGRAPH_RANK_TIMEOUT")
    parser.add_argument("--late", type=float, default=5.0, help="how late the slow peer comes")
    parser.add_argument(
        "--beyond", type=float, default=35.0, help="a peer later than gloo's 30 s (0: skip)"
    )
    parser.add_argument(
        "--create-wait", type=float, default=60.0, help="how long to watch new_group wait"
    )
    parser.add_argument("--json", default=None, help="write every rank's facts here")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        return rank_main(args)
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as out:
        phases = [(p, 2) for p in ("healthy", *DEAD_PHASES, "absent")]
        for phase, world in [*phases, *((p, 4) for p in DEAD_OF_FOUR)]:
            started = time.monotonic()
            results[phase] = launch(args, phase, Path(out), world)
            codes = [r["returncode"] for r in results[phase]]
            print(f"# {phase}: {time.monotonic() - started:.0f} s, exit {codes}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(
        f"Agreement channel, 2 CPU ranks, Paddle gloo vs TP rank 0's socket server; "
        f"{POINTS} points a round"
    )
    print(report(args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
