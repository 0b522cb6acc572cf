"""Supervision of a pipeline's ranks: a heartbeat outside `mx.distributed`, which has no timeouts.

A rank that dies mid-request leaves the others blocked inside a collective for ever (NCCL; the ring
backend when a process stops answering or its machine goes away) or failing with the backend's own error
(the ring backend, when the process ended and its sockets closed). So every rank keeps one TCP connection
to rank 0, the hub (it listens where the launcher says rank 0 is; the port is shared with one `all_sum` at
load), and sends a beat on it every `BEAT_S`; each end reads the other with a timeout. A peer is lost when
its connection closes (its process ended) or it is silent for `timeout_s` (`OD_MOE_HEARTBEAT_TIMEOUT`,
default 20 s: its process stopped or its machine went away). The hub tells the other ranks, and each
rank's `on_lost` decides what follows:
- by default (`od-moe generate`, the Python API): a loss while this rank is inside pipeline work (`busy`:
  a generation, a gather) that is still the same work `GRACE_S` later (it neither ended nor failed with
  the backend's error, which `busy` turns into a `RankLost`) prints one line and ends the process with
  code 1, as nothing else frees a thread blocked in a collective. A loss while idle is recorded; the next
  `busy` raises `RankLost`;
- the server (`server/ranks.py`) ends its clients' requests with an error and says so on /health.
The same connections carry other messages: the server's (rank 0's requests and per-token decisions, the
other ranks' statistics) go to `inbox`, in order; a kind with a handler (`handlers`: the seam's
predictions, `seams.py`) is handed to it on the reader thread; rank 0 relays a message `to` another rank.
Not here: the split itself (`rank_split.py`) or serving across ranks (`server/ranks.py`).
"""

import atexit
import json
import os
import queue
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from ..errors import RankLost, UserError

BEAT_S = 0.5  # a beat every half second
GRACE_S = 2.0  # how long pipeline work may take to end or fail by itself once a peer is lost
CONNECT_S = 60.0  # how long the ranks may take to connect at load
_BACKEND_ERRORS = ("[ring]", "[nccl]", "nccl", "[jaccl]", "mpi")


def timeout_s() -> float:
    """Seconds of silence after which a peer is lost (`OD_MOE_HEARTBEAT_TIMEOUT`, default 20)."""
    value = os.environ.get("OD_MOE_HEARTBEAT_TIMEOUT", "20")
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise UserError(f"OD_MOE_HEARTBEAT_TIMEOUT must be a number of seconds above 0, got {value!r}")
    return seconds


def hub_host() -> str:
    """Where rank 0 listens: `OD_MOE_HEARTBEAT_HOST`, else the address the launcher gave rank 0 (the ring
    backend's hostfile, NCCL's NCCL_HOST_IP, JACCL's coordinator), else loopback."""
    if os.environ.get("OD_MOE_HEARTBEAT_HOST"):
        return os.environ["OD_MOE_HEARTBEAT_HOST"]
    try:
        first = json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())[0]
        return (first[0] if isinstance(first, list) else first).rsplit(":", 1)[0]
    except (KeyError, OSError, ValueError, IndexError, TypeError, AttributeError):
        pass
    if os.environ.get("NCCL_HOST_IP"):
        return os.environ["NCCL_HOST_IP"]
    if os.environ.get("MLX_JACCL_COORDINATOR"):
        return os.environ["MLX_JACCL_COORDINATOR"].rsplit(":", 1)[0]
    return "127.0.0.1"


class _Link:
    """One TCP connection carrying JSON lines; a read waits at most `timeout` seconds."""

    def __init__(self, sock: socket.socket, timeout: float):
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.lock, self.reader = sock, threading.Lock(), sock.makefile("rb")

    def send(self, message: dict) -> bool:
        data = (json.dumps(message) + "\n").encode()
        try:
            with self.lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def receive(self) -> dict | None:
        """The next message; None once the connection closed; TimeoutError when the peer is silent."""
        line = self.reader.readline()
        return json.loads(line) if line else None

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class Supervisor:
    """This rank's heartbeat connections (rank 0: one to every other rank; the others: one to rank 0),
    what was lost, and whether this rank is inside pipeline work (`busy`)."""

    def __init__(self, rank: int, size: int, links: dict, timeout: float):
        self.rank, self.size, self.timeout, self.links = rank, size, timeout, links
        self.inbox: queue.Queue = queue.Queue()  # (rank, message) of the server's kinds, in order
        self.handlers: dict = {}  # kind -> called with (rank, message) on the reader thread instead
        self.payload = None  # a callable whose dict goes with every beat (the server's statistics)
        self.payloads: dict[int, dict] = {}  # rank -> the last payload it sent
        self.on_lost = self._stop_if_stuck  # called once, with the one-line message, from a reader thread
        self.lost: tuple[int, str] | None = None  # (the rank, why)
        self.closed = False
        self._lock, self._lost_event = threading.Lock(), threading.Event()
        self._busy = self._sections = 0
        self._ended: set[int] = set()  # ranks that said goodbye (ended normally)
        for peer, link in links.items():
            threading.Thread(target=self._read, args=(peer, link), daemon=True, name="od-moe-hb").start()
        threading.Thread(target=self._beat, daemon=True, name="od-moe-heartbeat").start()
        atexit.register(self.close)

    def when_lost(self, callback):
        """Call `callback(message)` once, from a reader thread, when a rank is found gone (instead of
        stopping the process where it is stuck)."""
        self.on_lost = callback

    def send_with_beats(self, payload):
        """Send `payload()`'s dict with every beat (the server's statistics, `payloads` on rank 0)."""
        self.payload = payload

    def handle(self, kind: str, handler):
        """Call `handler(rank, message)` on the reader thread for each message of `kind`, instead of
        putting it in `inbox`."""
        self.handlers[kind] = handler

    @property
    def message(self) -> str | None:
        if self.lost is None:
            return None
        rank, why = self.lost
        return f"rank {rank} of {self.size} is gone ({why}): start every rank again"

    def send(self, message: dict, to: int | None = None):
        """Send `message` to rank `to` (None: every rank this one is connected to)."""
        for peer, link in list(self.links.items()):
            if to is None or peer == to:
                link.send(message)

    @contextmanager
    def busy(self):
        """Pipeline work (collectives): a `RankLost` at once if a rank is already lost; the backend's error
        for a lost peer becomes one too."""
        with self._lock:
            if self.lost is not None:
                raise RankLost(self.message)
            self._busy += 1
        try:
            yield
        except RuntimeError as e:
            lost = self._explain(e)
            if lost is None:
                raise
            raise lost from e
        finally:
            with self._lock:
                self._busy -= 1
                self._sections += 0 if self._busy else 1

    def _explain(self, error: RuntimeError) -> RankLost | None:
        if isinstance(error, RankLost):
            return error
        if self._lost_event.wait(GRACE_S):
            return RankLost(self.message)
        if any(word in str(error).lower() for word in _BACKEND_ERRORS):
            return RankLost(f"the connection between the ranks failed ({error}): start every rank again")
        return None

    def close(self):
        """Say goodbye (an ended rank, not a lost one) and close the connections."""
        if self.closed:
            return
        self.send({"k": "bye"})
        self.closed = True
        for link in self.links.values():
            link.close()

    def _beat(self):
        while not self.closed:
            message = {"k": "beat"}
            if self.payload is not None:
                try:
                    message["p"] = self.payload()
                except Exception:  # statistics are best effort; the beat is what matters
                    pass
            self.send(message)
            time.sleep(BEAT_S)

    def _read(self, peer: int, link: _Link):
        while True:
            try:
                message = link.receive()
            except TimeoutError:
                why = f"it sent nothing for {self.timeout:g} s: its process stopped or its machine went away"
                break
            except (OSError, ValueError):
                message = None
            if message is None:
                why = "it ended" if peer in self._ended else "its connection closed: its process ended"
                break
            kind = message.get("k")
            if kind == "beat":
                if "p" in message:
                    self.payloads[peer] = message["p"]
            elif kind == "bye":
                self._ended.add(peer)
            elif kind == "lost":
                self._lose(message["rank"], message["why"])
            elif message.get("to", self.rank) != self.rank:  # the hub relays
                self.send(message, to=message["to"])
            elif kind in self.handlers:
                self.handlers[kind](peer, message)
            else:
                self.inbox.put((peer, message))
        self._lose(peer, why)

    def _lose(self, peer: int, why: str):
        with self._lock:
            if self.lost is not None or self.closed:
                return
            self.lost = (peer, why)
        self._lost_event.set()
        if self.rank == 0:  # the hub tells the others
            for other, link in list(self.links.items()):
                if other != peer:
                    link.send({"k": "lost", "rank": peer, "why": why})
        message = self.message
        assert message is not None  # `lost` was set above, and is never unset
        self.on_lost(message)

    def _stop_if_stuck(self, message: str):
        """The default `on_lost`: end the process if this rank stays inside the same pipeline work."""
        with self._lock:
            busy, section = self._busy, self._sections
        if not busy:
            return
        time.sleep(GRACE_S)
        with self._lock:
            stuck = self._busy and self._sections == section
        if stuck:
            print(f"od-moe: error: {message}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)


_started: dict[tuple[int, int], Supervisor] = {}


def supervise(group) -> Supervisor:
    """This process's supervisor of `group`, started (connected) once: a later load reuses it. Every rank
    calls it at the same point (one `all_sum` shares rank 0's port)."""
    key = (group.rank(), group.size())
    if key in _started and not _started[key].closed:
        return _started[key]
    timeout, host = timeout_s(), hub_host()
    listener = None
    if group.rank() == 0:
        try:
            listener = socket.create_server((host, 0))
        except OSError as e:
            raise UserError(
                f"rank 0 cannot listen for the ranks' heartbeat on {host} ({e.strerror}): set "
                "OD_MOE_HEARTBEAT_HOST to an address of rank 0 that every rank reaches"
            )
    mine = listener.getsockname()[1] if listener is not None else 0
    summed = mx.distributed.all_sum(mx.array([mine], dtype=mx.int32), group=group)
    port = int(summed.item())  # type: ignore[arg-type]  # mlx types item() as any scalar: int32 gives an int
    if listener is not None:
        with listener:
            links = _accept(listener, group.size(), timeout, f"{host}:{port}")
    else:
        links = {0: _connect(host, port, group.rank(), timeout)}
    _started[key] = Supervisor(group.rank(), group.size(), links, timeout)
    return _started[key]


def _accept(listener: socket.socket, size: int, timeout: float, where: str) -> dict:
    links: dict[int, _Link] = {}
    deadline = time.monotonic() + CONNECT_S
    while len(links) < size - 1:
        listener.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            sock, _ = listener.accept()
            link = _Link(sock, timeout)
            # a peer that closed before saying its rank (None) fails as a message without one does
            links[int((link.receive() or {})["rank"])] = link
        except (OSError, ValueError, TypeError, KeyError):
            if time.monotonic() < deadline:
                continue
            missing = sorted(set(range(1, size)) - set(links))
            raise UserError(
                f"rank(s) {missing} did not reach rank 0's heartbeat at {where} in {CONNECT_S:g} s: set "
                "OD_MOE_HEARTBEAT_HOST to an address of rank 0 that every rank reaches"
            )
    return links


def _connect(host: str, port: int, rank: int, timeout: float) -> _Link:
    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            link = _Link(socket.create_connection((host, port), timeout=5), timeout)
            link.send({"k": "hello", "rank": rank})
            return link
        except OSError as e:
            if time.monotonic() > deadline:
                raise UserError(
                    f"rank {rank} cannot reach rank 0's heartbeat at {host}:{port} ({e}): set "
                    "OD_MOE_HEARTBEAT_HOST to an address of rank 0 that every rank reaches"
                )
            time.sleep(0.2)
