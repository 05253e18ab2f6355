"""Which channel the tensor-parallel ranks agree over, measured side by side in one run: the
plugin's ZeroMQ channel (over a Unix socket, as on one host, and over TCP with the job's token,
as across hosts), the socket server of our own that 0.4.0 shipped (loaded from git history at
``OLD_COMMIT``), and a ``paddle.distributed`` gloo group. CPU ranks on this machine.

Each scenario is a fresh launch of ranks with the environment Paddle's launcher gives them
(started here, not by the launcher, which stops every rank once one dies):

* ``healthy@W``: cost per point, W = 2 and 4 ranks: 110 points of small JSON statuses a round,
  the arms interleaved, round 0 unmeasured; median and spread (min..max) over ``--rounds``;
* ``killed-<arm>``: rank 1 is SIGKILLed while rank 0 waits at a point (timeout 60 s): how long
  until rank 0's call returns, and whom it names;
* ``hung-<arm>``: rank 1 is SIGSTOPped while rank 0 waits (timeout ``--timeout``): how long rank
  0's call waited in all, and whom it names. Paddle gives no per-call timeout for gloo: it is
  waited for in a thread;
* ``absent-<arm>``: rank 1 never joins: how long rank 0 waits, and what it says.

    python benchmarks/channel.py [--rounds 15] [--timeout 2]
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
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: The last commit with 0.4.0's own socket server (core/channel.py and core/wire.py).
OLD_COMMIT = "b048c51"
POINTS = 110
#: A group id of the benchmark's own, apart from FastDeploy's TP and EP groups.
GID_BASE = 7_340_000
CAPACITY = 1024
RANK_DEADLINE_S = 300
PHASE_LIMIT_S = 240
ARMS = ("zmq ipc", "zmq tcp", "0.4.0 server", "gloo")
FAULT_ARMS = ("zmq ipc", "0.4.0 server", "gloo")


class Abandoned(Exception):
    """This rank stopped waiting at a point."""


class GlooLink:
    """A rank's end of the agreement over a gloo group: one ``all_gather`` of a fixed 1 KiB CPU
    buffer holding the JSON of (label, payload) a point, a second round only if some is longer.
    ``bounded``: wait for the collective in a thread, at most ``timeout`` (the collective stays
    open; the next point first waits for it)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.bounded = False
        self._pending: threading.Thread | None = None

    def agree(self, label: str, payload: Any, timeout: float) -> dict[str, Any]:
        try:
            posts = self._in_thread(label, payload, timeout) if self.bounded else None
            if posts is None:
                posts = self._gather(label, payload)
        except Abandoned:
            return {"complete": False, "named": [], "said": f"gave up after {timeout:g} s"}
        except Exception as error:
            return {"complete": False, "named": _pair_rank(str(error)), "said": _short(error)}
        return {"complete": {p["label"] for p in posts} == {label}, "named": [], "said": ""}

    def _gather(self, label: str, payload: Any) -> list[dict[str, Any]]:
        import numpy as np
        import paddle
        import paddle.distributed as dist

        body = json.dumps({"label": label, "payload": payload}, separators=(",", ":")).encode()
        buffer = np.zeros(CAPACITY, dtype=np.uint8)
        buffer[:4] = np.frombuffer(len(body).to_bytes(4, "big"), dtype=np.uint8)
        buffer[4 : 4 + len(body)] = np.frombuffer(body, dtype=np.uint8)
        gathered: list[Any] = []
        dist.all_gather(gathered, paddle.to_tensor(buffer, place=paddle.CPUPlace()), self.group)
        arrays = [t.numpy() for t in gathered]
        lengths = [int.from_bytes(a[:4].tobytes(), "big") for a in arrays]
        return [json.loads(a[4 : 4 + n].tobytes()) for a, n in zip(arrays, lengths, strict=True)]

    def _in_thread(self, label: str, payload: Any, timeout: float) -> list[dict[str, Any]]:
        if self._pending is not None:
            self._pending.join(timeout)  # the last point's collective is still open
            if self._pending.is_alive():
                raise Abandoned
            self._pending = None
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["posts"] = self._gather(label, payload)
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

    def next_epoch(self) -> None:
        pass


class ZmqArm:
    """The plugin's channel as it ships (``core/ranks/``)."""

    def __init__(self, rank: int, world: int, name: str, tcp: bool, timeout: float) -> None:
        from paddle.base import core

        from fd_cudagraph_plugin.core.ranks import join

        group = list(range(world))
        interface = "127.0.0.1" if tcp else "auto"
        address = join.address_for(group, interface, None)
        self.link = join.join(
            core.create_or_get_global_tcp_store, name, address, rank, world, timeout
        )

    def next_epoch(self) -> None:
        self.link.next_epoch(60.0)

    def agree(self, label: str, payload: Any, timeout: float) -> dict[str, Any]:
        from fd_cudagraph_plugin.core.ranks.messages import Status

        agreed = self.link.agree(label, Status(payload=json.dumps(payload)), timeout)
        outcome = agreed.outcome
        return {
            "complete": agreed.complete,
            "named": sorted({*outcome.missing, *outcome.gave_up} - {self.link.rank}),
            "lost": list(outcome.lost),
            "said": agreed.channel_failure,
        }


class OldArm:
    """0.4.0's socket server and link, from git history (``OLD_COMMIT``)."""

    def __init__(self, rank: int, world: int, name: str, timeout: float, module: Any) -> None:
        from paddle.base import core

        store = core.create_or_get_global_tcp_store()
        host = module.listen_host(list(range(world)))
        self.rank = rank
        self.link = module.SocketLink.connect(store, name, rank, world, host, timeout)

    def next_epoch(self) -> None:
        self.link.next_epoch()

    def agree(self, label: str, payload: Any, timeout: float) -> dict[str, Any]:
        outcome = self.link.agree(label, {"payload": payload}, timeout)
        return {
            "complete": outcome.complete,
            "named": sorted({*outcome.missing, *outcome.gave_up} - {self.rank}),
            "lost": list(outcome.lost),
            "said": outcome.channel_failure,
        }


def old_channel(out: Path) -> Any:
    """0.4.0's ``channel.py`` and ``wire.py`` as a module of their own, or None without git."""
    folder = out / "old_channel"
    if not folder.exists():
        folder.mkdir()
        try:
            for name in ("channel", "wire"):
                source = subprocess.run(
                    [
                        "git",
                        "-C",
                        str(ROOT),
                        "show",
                        f"{OLD_COMMIT}:fd_cudagraph_plugin/core/{name}.py",
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                source = source.replace("fd_cudagraph_plugin.core.wire", "old_wire")
                (folder / f"old_{name}.py").write_text(source)
        except (OSError, subprocess.CalledProcessError):
            return None
    sys.path.insert(0, str(folder))
    import old_channel as module

    return module


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

    def arm(self, kind: str, name: str, timeout: float = 60.0) -> Any:
        if kind.startswith("zmq"):
            return ZmqArm(self.index, self.world, name, kind == "zmq tcp", timeout)
        if kind == "0.4.0 server":
            module = old_channel(Path(self.args.out))
            return None if module is None else OldArm(self.index, self.world, name, timeout, module)
        collective = self.dist.collective
        collective._set_custom_gid(GID_BASE + zlib.crc32(name.encode()) % 10_000)
        try:
            group = self.dist.new_group(
                list(range(self.world)), backend="gloo", timeout=datetime.timedelta(seconds=2)
            )
        finally:
            collective._set_custom_gid(None)
        return GlooLink(group, self.index, self.world)

    def point(self, arm: Any, label: str, timeout: float) -> dict[str, Any]:
        started = time.monotonic()
        facts = arm.agree(label, {"label": label, "rank": self.index}, timeout)
        return {**facts, "seconds": time.monotonic() - started, "end": time.time()}


def healthy(rank: Rank) -> None:
    arms: dict[str, Any] = {}
    for kind in ARMS:
        started = time.perf_counter()
        try:
            made = rank.arm(kind, f"fd-cudagraph/bench/healthy/{kind}")
        except Exception as error:  # said in the report; the other arms are still measured
            rank.facts.setdefault("join_error", {})[kind] = _short(
                f"{type(error).__name__}: {error}"
            )
            rank.save()
            made = None
        if made is not None:
            arms[kind] = made
            rank.facts.setdefault("join_s", {})[kind] = time.perf_counter() - started
    payloads = [None, {"size": 512, "pool": 1, "graphs": 36}, None]
    times: dict[str, list[float]] = {kind: [] for kind in arms}
    kinds = list(arms)
    for round_ in range(rank.args.rounds + 1):  # round 0 warms every arm up, unmeasured
        for kind in kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]:
            arm = arms[kind]
            arm.next_epoch()
            rank.dist.barrier()
            began = time.perf_counter()
            for i in range(POINTS):
                facts = arm.agree(f"point {i}", payloads[i % len(payloads)], 60.0)
                assert facts["complete"], facts
            if round_:
                times[kind].append((time.perf_counter() - began) / POINTS)
    rank.facts["per_point_s"] = times


def fault(rank: Rank) -> None:
    """``killed-<arm>`` or ``hung-<arm>``: rank 1 dies or freezes while rank 0 waits."""
    what, _, kind = rank.args.phase.partition("-")
    arm = rank.arm(kind, f"fd-cudagraph/bench/{rank.args.phase}")
    if arm is None:
        rank.facts["skipped"] = "no git history for the 0.4.0 server"
        return
    arm.next_epoch()
    rank.facts["first"] = rank.point(arm, "first", 30.0)
    rank.save()
    stamp = Path(rank.args.out, f"{rank.args.phase}.at")
    if rank.index == 1:
        time.sleep(1.0)  # rank 0 is waiting at the next point by now
        stamp.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if what == "killed" else signal.SIGSTOP)
        facts = rank.point(arm, "fault", 60.0)  # after SIGCONT: the late arrival
        rank.facts["fault"] = facts
        return
    timeout = 60.0 if what == "killed" else rank.args.timeout
    if isinstance(arm, GlooLink):
        arm.bounded = True
    facts = rank.point(arm, "fault", timeout)
    facts["after_fault_s"] = facts["end"] - float(stamp.read_text())
    if what == "hung":  # let it go on, and end
        os.kill(int(Path(rank.args.out, f"{rank.args.phase}.peer").read_text()), signal.SIGCONT)
    rank.facts["fault"] = facts


def absent(rank: Rank) -> None:
    """``absent-<arm>``: rank 1 never joins; rank 0 waits ``--timeout``."""
    kind = rank.args.phase.partition("-")[2]
    if rank.index == 1:
        time.sleep(rank.args.timeout + 5)
        return
    started = time.monotonic()
    result: dict[str, Any] = {}

    def attempt() -> None:
        try:
            arm = rank.arm(kind, f"fd-cudagraph/bench/{rank.args.phase}", rank.args.timeout)
            if arm is None:
                result["said"] = "skipped"
                return
            if isinstance(arm, GlooLink):
                arm.bounded = True
            arm.next_epoch()
            result.update(rank.point(arm, "absent", rank.args.timeout))
        except Exception as error:
            result["said"] = _short(error)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(rank.args.timeout + 20)
    result["returned"] = not thread.is_alive()
    result["seconds"] = time.monotonic() - started
    rank.facts["absent"] = result


def rank_main(args: argparse.Namespace) -> int:
    faulthandler.dump_traceback_later(RANK_DEADLINE_S, exit=True)
    rank = Rank(args)
    if args.phase.startswith("healthy"):
        healthy(rank)
    elif args.phase.startswith("absent"):
        absent(rank)
    else:
        fault(rank)
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
            "--timeout", str(args.timeout), "--rounds", str(args.rounds),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    # Rank 0 resumes a frozen rank 1 itself (SIGCONT): it reads its pid when it needs it.
    Path(out, f"{phase}.peer").write_text(str(procs[1].pid))
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


def _short(text: object, width: int = 150) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _pair_rank(error: str) -> list[int]:
    """Paddle's gloo says which pair failed (``pair_rank = N``), not who failed."""
    named = error.split("pair_rank = ")[1].split()[0] if "pair_rank = " in error else ""
    return [int(named)] if named.isdigit() else []


def _spread(values: list[float]) -> str:
    """Median (min..max) in µs."""
    if not values:
        return "-"
    us = sorted(v * 1e6 for v in values)
    return f"{statistics.median(us):.0f} ({us[0]:.0f}..{us[-1]:.0f})"


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> str:
    rows: list[tuple[str, list[str]]] = []
    for world in (2, 4):
        ranks = results.get(f"healthy@{world}", [])
        cells = []
        for kind in ARMS:
            values = ranks[0].get("per_point_s", {}).get(kind) if ranks else None
            cells.append(_spread(values) if values else "-")
        rows.append((f"cost per point, {world} ranks, us (rank 0)", cells))
    if results.get("healthy@2"):
        joins = results["healthy@2"][1].get("join_s", {})
        rows.append(
            (
                "join once per process, ms (rank 1)",
                [f"{joins[k] * 1e3:.0f}" if k in joins else "-" for k in ARMS],
            )
        )

    def fault_cells(what: str, field: str) -> list[str]:
        cells = []
        for kind in ARMS:
            ranks = results.get(f"{what}-{kind}")
            facts = (ranks or [{}])[0].get("fault") if ranks else None
            if kind not in FAULT_ARMS:
                cells.append("as zmq ipc")
                continue
            if not facts:
                cells.append("no result" if ranks else "-")
                continue
            if field == "after":
                cells.append(f"{facts['after_fault_s'] * 1e3:.0f} ms")
            elif field == "waited":
                cells.append(f"{facts['seconds']:.2f} s")
            else:
                lost = " (lost)" if facts.get("lost") == [1] else ""
                cells.append(f"rank {facts['named']}{lost}" if facts["named"] else "nobody")
        return cells

    rows.append(("rank 1 killed (SIGKILL) while rank 0 waits, timeout 60 s", [""] * 4))
    rows.append(("  rank 0's call returned after the kill", fault_cells("killed", "after")))
    rows.append(("  it named", fault_cells("killed", "named")))
    rows.append((f"rank 1 frozen (SIGSTOP), timeout {args.timeout:g} s", [""] * 4))
    rows.append(("  rank 0's call waited in all", fault_cells("hung", "waited")))
    rows.append(("  it named", fault_cells("hung", "named")))
    cells = []
    for kind in ARMS:
        facts = (results.get(f"absent-{kind}") or [{}])[0].get("absent")
        if kind not in FAULT_ARMS:
            cells.append("as zmq ipc")
        elif not facts:
            cells.append("-")
        elif not facts["returned"]:
            cells.append(f"still waiting after {facts['seconds']:.0f} s")
        else:
            cells.append(f"{facts['seconds']:.2f} s, {'named' if facts.get('named') else 'said'}")
    rows.append((f"rank 1 never joins, timeout {args.timeout:g} s: rank 0 returned after", cells))

    width = max(len(label) for label, _ in rows)
    widths = [max(len(c), *(len(cells[i]) for _, cells in rows)) for i, c in enumerate(ARMS)]
    lines = [" | ".join([" " * width, *(c.ljust(w) for c, w in zip(ARMS, widths, strict=True))])]
    lines.append("-+-".join(["-" * width, *("-" * w for w in widths)]))
    for label, cells in rows:
        lines.append(
            " | ".join(
                [label.ljust(width), *(c.ljust(w) for c, w in zip(cells, widths, strict=True))]
            )
        )
    lines.append("")
    for world in (2, 4):
        for kind, said in (
            (results.get(f"healthy@{world}") or [{}])[0].get("join_error", {}).items()
        ):
            lines.append(f"  {kind} could not be set up on {world} ranks: {said}")
    lines.append("What rank 0's call said:")
    for what in ("killed", "hung", "absent"):
        for kind in FAULT_ARMS:
            ranks = results.get(f"{what}-{kind}") or [{}]
            facts = ranks[0].get("fault" if what != "absent" else "absent")
            if facts and facts.get("said"):
                lines.append(f"  {what}, {kind}: {_short(facts['said'])}")
            elif not facts and ranks[0].get("log"):
                lines.append(f"  {what}, {kind}: rank 0's log: {_short(ranks[0]['log'][-300:])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=2.0, help="FD_CUDAGRAPH_RANK_TIMEOUT")
    parser.add_argument("--json", default=None, help="write every rank's facts here")
    parser.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        return rank_main(args)
    if not 1 <= args.rounds <= 1000 or not 0.5 <= args.timeout <= 60:
        parser.error("--rounds must be 1..1000 and --timeout 0.5..60")
    results: dict[str, list[dict[str, Any]]] = {}
    phases = [("healthy@2", 2), ("healthy@4", 4)]
    phases += [
        (f"{what}-{kind}", 2) for what in ("killed", "hung", "absent") for kind in FAULT_ARMS
    ]
    phases = [(p, w) for p, w in phases if not args.only or p in args.only]
    with tempfile.TemporaryDirectory() as out:
        for phase, world in phases:
            started = time.monotonic()
            results[phase] = launch(args, phase, Path(out), world)
            codes = [r["returncode"] for r in results[phase]]
            print(f"# {phase}: {time.monotonic() - started:.0f} s, exit {codes}", file=sys.stderr)
            for index, facts in enumerate(results[phase]):
                if facts["returncode"] not in (0, -signal.SIGKILL):
                    print(f"#   rank {index}'s log ends: {facts['log'][-3000:]}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(
        f"Agreement channel, CPU ranks on this machine: the plugin's ZeroMQ channel, 0.4.0's "
        f"socket server ({OLD_COMMIT}) and a gloo group; {POINTS} points a round, "
        f"{args.rounds} rounds"
    )
    print(report(args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
