"""Where a tensor-parallel group agrees, and how each rank joins it.

TP rank 0 starts the server and publishes its endpoint and a fresh token in Paddle's job store,
which every FastDeploy worker has; the other ranks read both, connect, present the token in
ZeroMQ's handshake and say hello. On one host the server listens on a Unix socket in a directory
made for it alone (nobody can make it first, no older group held it, and a rank connects only to
a socket in a directory that is its user's alone); across hosts, or with
``FD_CUDAGRAPH_AGREEMENT_INTERFACE`` / ``_PORTS``, on TCP. A rank that meets a stale entry reads
the store again until rank 0 has published. docs/design.md, "Where it listens", says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import msgspec
import zmq
from msgspec import Meta

from fd_cudagraph_plugin.core.ranks.link import JoinError, Stale, ZmqLink
from fd_cudagraph_plugin.core.ranks.messages import MAX_LABEL, UNREADABLE, text
from fd_cudagraph_plugin.core.ranks.server import BindError, Server

logger = logging.getLogger("fd_cudagraph_plugin")

#: The longest Unix socket path used: the kernel's limit is 107 bytes (``sun_path``).
MAX_SOCKET_PATH = 100
#: Seconds between reads of the store while waiting for TP rank 0 to publish.
_STORE_POLL_SECONDS = 0.05


class Store(Protocol):
    """What the agreement needs of Paddle's ``TCPStore``."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...


@dataclass(frozen=True)
class Address:
    """Where rank 0's server listens: a Unix socket (``host`` None), or TCP on ``host`` (an
    address or an interface name) on a port of ``ports``, else one the kernel picks."""

    host: str | None = None
    ports: tuple[int, int] | None = None


def address_for(group: list[int], interface: str, ports: tuple[int, int] | None) -> Address:
    """Where the group of ``group`` (global ranks) agrees. ``interface`` is
    ``FD_CUDAGRAPH_AGREEMENT_INTERFACE`` ("auto", an address or an interface name), ``ports``
    ``FD_CUDAGRAPH_AGREEMENT_PORTS``; either set means TCP."""
    if interface != "auto":
        return Address(interface, ports)
    host = node_host(group)
    if host is not None or ports is not None:
        return Address(host or "127.0.0.1", ports)
    return Address()


def node_host(group: list[int]) -> str | None:
    """This worker's host when the group spans hosts, else None (every rank is on this host).
    Paddle's launcher sets ``PADDLE_CURRENT_ENDPOINT`` and ``PADDLE_TRAINER_ENDPOINTS`` (every
    rank's, by global rank) in every worker; without them the ranks are taken to share a host,
    as FastDeploy's single-node launch does."""
    host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "").rpartition(":")[0]
    if not host:
        return None
    endpoints = [e for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
    if not endpoints or any(r >= len(endpoints) for r in group):
        return host  # where the ranks are is unknown: reachable from other hosts
    if all(endpoints[r].rpartition(":")[0] == host for r in group):
        return None
    return host


def socket_directory() -> str:
    """A new directory for one server's Unix socket, private to this user, under the first base
    where the socket's path fits."""
    bases = [os.environ.get("XDG_RUNTIME_DIR", ""), tempfile.gettempdir(), "/tmp"]
    for base in bases:
        if base and len(os.path.join(base, "fd-cudagraph-12345678", "s")) <= MAX_SOCKET_PATH:
            with contextlib.suppress(OSError):
                return tempfile.mkdtemp(prefix="fd-cudagraph-", dir=base)
    raise JoinError(
        "no directory to hold the ranks' Unix socket: XDG_RUNTIME_DIR, TMPDIR and /tmp are "
        f"unwritable or longer than a socket path allows ({MAX_SOCKET_PATH} bytes); set TMPDIR "
        "to a short writable directory"
    )


def _check_private(endpoint: str) -> None:
    """An ``ipc://`` endpoint read from the store must lie in a directory that is this user's
    alone (only this user can have made a socket there); ``Stale`` if it is gone."""
    directory = os.path.dirname(endpoint[len("ipc://") :])
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        raise Stale(f"{directory} is gone") from None
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.geteuid()
        or stat.S_IMODE(info.st_mode) & 0o077
    ):
        raise JoinError(
            f"the job store names a Unix socket in {directory}, which is not a directory private "
            f"to this user (mode {stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}): refused"
        )


class Published(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """What rank 0 publishes in the job store: where its server listens."""

    endpoint: Annotated[
        str, Meta(max_length=MAX_SOCKET_PATH + 6, pattern=r"^(ipc:///|tcp://)[\w./:\[\]-]+$")
    ]
    token: Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]


class NotStarted(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    """What rank 0 publishes when its server cannot listen: the others stop at once, saying
    why, instead of waiting their whole timeout."""

    why: Annotated[str, Meta(max_length=MAX_LABEL * 2)]


class ServerNotStarted(JoinError):
    """TP rank 0 could not start the server (``NotStarted``): an operator's setting, mostly."""


def listen_problem(
    interface: str, ports: tuple[int, int] | None, environ: Mapping[str, str]
) -> str | None:
    """Why ``FD_CUDAGRAPH_AGREEMENT_INTERFACE`` / ``_PORTS`` cannot work from this host, or None:
    an interface it does not have, a wildcard or loopback address where the job spans hosts (the
    other hosts would dial it), and, where the whole job is on this host (so TP rank 0 is here
    too), an address it does not own or a port range in use. ``register()`` and ``fd-cudagraph
    doctor`` ask it."""
    spans = _job_spans_hosts(environ)
    host = None if interface == "auto" else interface
    if host is not None:
        try:
            address = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            address = None
            try:
                socket.if_nametoindex(host)
            except OSError:
                return (
                    f"FD_CUDAGRAPH_AGREEMENT_INTERFACE={host}: this host has no network interface "
                    f"of that name and it is no IP address; name one of "
                    f"{', '.join(sorted(n for _, n in socket.if_nameindex()))}, or unset it"
                )
        unreachable = host in ("lo", "lo0") or (
            address is not None and (address.is_loopback or address.is_unspecified)
        )
        if spans and unreachable:
            return (
                f"FD_CUDAGRAPH_AGREEMENT_INTERFACE={host} is a wildcard or loopback address, which "
                f"the other hosts of this job cannot dial; give an address or interface of TP rank "
                f"0's host that they reach, or unset it"
            )
        if address is not None and not spans and not _bindable(str(address), 0):
            return (
                f"FD_CUDAGRAPH_AGREEMENT_INTERFACE={host} is not an address of this host, where "
                f"every rank of the job runs; give one of its own, or unset it"
            )
    if ports is not None and not spans:
        where = str(address) if host is not None and address is not None else "0.0.0.0"
        if not any(_bindable(where, port) for port in range(ports[0], ports[1] + 1)):
            return (
                f"every port of FD_CUDAGRAPH_AGREEMENT_PORTS={ports[0]}-{ports[1]} is in use on "
                f"this host; widen the range, or unset it"
            )
    return None


def _job_spans_hosts(environ: Mapping[str, str]) -> bool:
    endpoints = [e for e in environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
    return len({e.rpartition(":")[0] for e in endpoints}) > 1


def _bindable(address: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True


def group_id(name: str) -> str:
    """What tells this launch of the group ``name`` from another: every rank of one launch has
    the same job store and the same ranks' endpoints (Paddle's launcher picks them anew)."""
    job = "|".join(
        os.environ.get(key, "")
        for key in ("PADDLE_MASTER", "MASTER_ADDR", "MASTER_PORT", "PADDLE_TRAINER_ENDPOINTS")
    )
    return hashlib.sha256(f"{name}\0{job}".encode()).hexdigest()[:16]


def join(
    store: Callable[[], Store] | None,
    name: str,
    address: Address,
    rank: int,
    world: int,
    timeout: float,
    group: str | None = None,
) -> ZmqLink:
    """This rank's link to its group's channel, within ``timeout`` seconds in all. ``store``
    makes the job store's client; ``name`` is the group's key in it; ``group`` tells this
    launch of the group from another (``group_id``)."""
    started = time.monotonic()
    deadline = started + timeout
    group = group_id(name) if group is None else group
    if rank == 0:
        return _host(store, name, address, world, deadline, group)
    while True:
        published = _bounded(lambda: _read(store(), name, deadline), deadline + 0.1, "read from")
        if published is None:
            raise JoinError(
                f"tensor-parallel rank 0 did not start the CUDA graph agreement server within "
                f"{timeout:g} s (FD_CUDAGRAPH_RANK_TIMEOUT; waited "
                f"{time.monotonic() - started:.3g} s)"
            )
        try:
            if published.endpoint.startswith("ipc://"):
                _check_private(published.endpoint)
            link = ZmqLink(rank, world, published.endpoint, published.token, group=group)
        except Stale:
            time.sleep(_STORE_POLL_SECONDS)
            continue
        try:
            link.hello(deadline)
            return link
        except Stale:
            link.close()
            time.sleep(_STORE_POLL_SECONDS)  # an older server's entry: rank 0 publishes anew
        except TimeoutError:
            link.close()
            raise JoinError(
                f"the agreement server of tensor-parallel rank 0 ({published.endpoint}) did not "
                f"welcome this rank within {timeout:g} s (FD_CUDAGRAPH_RANK_TIMEOUT)"
            ) from None
        except BaseException:
            link.close()
            raise


def _host(
    store: Callable[[], Store] | None,
    name: str,
    address: Address,
    world: int,
    deadline: float,
    group: str,
) -> ZmqLink:
    host = address.host
    endpoint = f"tcp://{host}" if host is not None else f"ipc://{socket_directory()}/s"
    try:
        server = Server(world, endpoint, address.ports, group)
    except (BindError, zmq.ZMQError) as error:
        why = str(error)
        if isinstance(error, zmq.ZMQError):
            why = (
                f"it cannot listen on {endpoint} ({error}); check "
                f"FD_CUDAGRAPH_AGREEMENT_INTERFACE, or unset it"
            )
        failed = msgspec.json.encode(NotStarted(text(why, 2 * MAX_LABEL))).decode()
        with contextlib.suppress(JoinError):  # the others stop at once, saying why
            _bounded(lambda: _publish(store(), name, failed), deadline, "publish to")
        raise ServerNotStarted(why) from None
    try:
        server.start()
        logger.info(
            "fd-cudagraph agreement: tensor-parallel rank 0 of %d listens on %s",
            world,
            server.endpoint,
        )
        value = msgspec.json.encode(Published(server.endpoint, server.token)).decode()
        _bounded(lambda: _publish(store(), name, value), deadline, "publish to")
        link = ZmqLink(0, world, "", server.token, server)
        link.hello(deadline)
        return link
    except TimeoutError:
        server.stop()
        raise JoinError("rank 0's own agreement server did not welcome it") from None
    except BaseException:
        server.stop()
        raise


def _publish(store: Store, name: str, value: str) -> None:
    store.set(f"{name}/server", value)
    store.add(f"{name}/ready", 1)


def _read(store: Store, name: str, deadline: float) -> Published | None:
    """What rank 0 published, once it has (None: not before ``deadline``); ``ServerNotStarted``
    when it could not listen."""
    while store.add(f"{name}/ready", 0) < 1:
        if time.monotonic() >= deadline:
            return None
        time.sleep(_STORE_POLL_SECONDS)
    raw = store.get(f"{name}/server")
    try:
        read = msgspec.json.decode(
            raw if isinstance(raw, bytes) else bytes(raw), type=Published | NotStarted
        )
    except (*UNREADABLE, TypeError):
        raise JoinError("the agreement server's address in the job store is malformed") from None
    if isinstance(read, NotStarted):
        raise ServerNotStarted(read.why)
    return read


def _bounded(call: Callable[[], Any], deadline: float, what: str) -> Any:
    """``call()`` in a daemon thread, waited for until ``deadline``: a call of Paddle's store
    blocks for as long as the store's host does not answer (global rank 0 frozen) and cannot be
    interrupted."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as error:
            box["error"] = error

    started = time.monotonic()
    thread = threading.Thread(target=run, name="fd-cudagraph-store", daemon=True)
    thread.start()
    thread.join(max(deadline - started, 0.0))
    if thread.is_alive():
        raise JoinError(
            f"the job store (Paddle's TCP store, hosted by global rank 0) did not answer when "
            f"this rank tried to {what} it, after {time.monotonic() - started:.3g} s"
        )
    error = box.get("error")
    if isinstance(error, JoinError):
        raise error
    if error is not None:
        raise JoinError(
            f"the job store (Paddle's TCP store) failed when this rank tried to {what} it: "
            f"{type(error).__name__}: {text(error, MAX_LABEL)}"
        ) from error
    return box["value"]
