"""A network cut: which ranks a side still reaches, found by itself and agreed among its ranks, without MPI.

Over several hosts, a cut separates sides of the job that are all alive: MPI tells nobody (with Open MPI 5.0.11
neither ULFM's heartbeat detector nor PRRTE's keepalives reliably do: docs/design/node-faults.md), so every rank
waits in its collective, and a shrink, which needs every living process to agree, waits across the cut for ever.
dsim finds the sides itself, over plain TCP:

- **a listener per process** (Listener), armed at the start of training in a job over several hosts (arm,
  collective: the addresses gathered, each other host's address that answers kept, a duplicate of the world made,
  which nothing revokes). On each connection it says who it is (the job's token and its rank), then reads one
  line, if any: a rank's view of its side.
- **the watch** (Links.look, from the hang watch's thread, tft.hang_timeout): a rank that has waited in a collective
  longer than the timeout probes every rank (a TCP connection, PROBE_SECONDS at most). A host none of whose ranks
  answers, twice in a row, is cut off (or gone): the rank revokes its communicators, as after a death; the revoke
  reaches its own side. A host that answers refuses the connection of a rank that died: that is a death, MPI's to
  tell.
- **the side** (survivors, in place of MPI's shrink in the last gasp and the repair in the job): a rank whose own
  watch did not find the cut takes MPI's shrink unless a host is silent to two probes 2 s apart; then every rank
  probes again and sends its view (the ranks that answered) to each rank that answered; a side is agreed when every rank
  of the view sent the same view. A rank whose main thread is stuck in MPI (a send across the cut never returns)
  answers through its listener but never sends a view: after GRACE_SECONDS the others leave it out, and the side's
  lowest rank tells its listener to end it. Then the quorum rule (dsim.ft.quorum: hosts, rank 0's host on an even
  split) says whether this side may commit: if not it stops, writing nothing; if so its ranks build their
  communicator from the world's duplicate (MPI_Comm_create_group, a collective of its members only, which
  completes across a cut), on which the last gasp runs as on a shrunk world.

When every host answers (a rank died, the others reach each other), the shrink is MPI's, as on one host. Two sides
cannot both hold the quorum (two disjoint sets of hosts cannot both be a strict majority, nor both hold rank 0's
host), so at most one commits. Liveness is best effort: views that keep differing (a link that flaps) stop the
side after AGREE_SECONDS, and a side whose MPI_Comm_create_group does not complete in CREATE_SECONDS stops; both
write nothing.
"""
from __future__ import annotations

import errno
import fcntl
import json
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass

# a probe's answer: it said who it is; refused, or closed without a word (its process ended: its host is there);
# nothing (or not the rank: another process at that address)
UP, GONE, SILENT = "up", "gone", "silent"
PROBE_SECONDS = 2.0   # how long a probe waits for the ranks to answer (a lost SYN is sent again after 1 s)
WATCH_PROBE_SECONDS = 1.0  # the same from the hang watch's thread (its heartbeat waits meanwhile)
WATCH_EVERY = 2.0     # seconds between two probes of the watch
GRACE_SECONDS = 12.0  # how long a side waits for every rank that answers to take part (> the 2 probes + 2 s before)
AGREE_SECONDS = 30.0  # the longest a side's agreement may take before its ranks stop
CREATE_SECONDS = 30.0  # the longest MPI_Comm_create_group of an agreed side may take before the side stops
SIOCGIFADDR = 0x8915


def addresses() -> list[str]:
    """This host's IPv4 addresses, loopback left out (one per interface)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            ip = socket.inet_ntoa(packed[20:24])
            if not ip.startswith("127."):
                out.append(ip)
    return out


class Listener:
    """A process's listener: says who it is on each connection, keeps the last view each rank sent."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.identity = b""   # token:rank, set by arm
        self.views = {}       # (token, rank) -> the last view it sent
        self.cond = threading.Condition()
        threading.Thread(target=self._serve, name="dsim-cut-listener", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(PROBE_SECONDS)
                    conn.sendall(self.identity + b"\n")
                    data = b""
                    while len(data) < 1 << 20:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    if data:
                        message = json.loads(data)
                        if message.get("stop") and self.identity.startswith(message["token"].encode()):
                            _stop(None)  # left out of its side, stuck in MPI: its side's lowest rank ends it
                        with self.cond:
                            self.views[(message["token"], message["rank"])] = tuple(message["view"])
                            self.cond.notify_all()
                except (OSError, ValueError, KeyError):
                    continue

    def wait(self, token: str, ranks, want, seconds: float) -> bool:
        """Whether each of `ranks` sent the view `want`, waiting up to `seconds` for them."""
        deadline = time.monotonic() + seconds
        with self.cond:
            while True:
                if all(self.views.get((token, r)) == want for r in ranks):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)


def _connect(targets: dict, seconds: float, message: dict | None = None) -> dict:
    """Open a connection to each target (key -> (address, port, identity wanted)) at once; within `seconds`, each
    key's answer: UP (it said the identity wanted; `message` then sent to it), GONE (refused) or SILENT."""
    sel = selectors.DefaultSelector()
    out, socks = {}, {}
    for key, (address, port, identity) in targets.items():
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        err = s.connect_ex((address, port))
        if err in (0, errno.EINPROGRESS, errno.EAGAIN):
            socks[s] = [key, identity, b"", False]
            sel.register(s, selectors.EVENT_WRITE)
        else:
            out[key] = GONE if err == errno.ECONNREFUSED else SILENT
            s.close()
    deadline = time.monotonic() + seconds
    try:
        while socks and time.monotonic() < deadline:
            for k, _ in sel.select(max(0.0, deadline - time.monotonic())):
                s = k.fileobj
                key, identity, got, connected = socks[s]
                if not connected:
                    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        out[key] = GONE if err == errno.ECONNREFUSED else SILENT
                        sel.unregister(s)
                        s.close()
                        del socks[s]
                        continue
                    socks[s][3] = True
                    sel.modify(s, selectors.EVENT_READ)
                    continue
                try:
                    chunk = s.recv(256)
                except OSError:
                    chunk = b""
                got += chunk
                socks[s][2] = got
                if b"\n" in got or not chunk:  # (closed before a word: its process is ending, or ended)
                    out[key] = UP if got.split(b"\n")[0] == identity else SILENT if got else GONE
                    sel.unregister(s)
                    if out[key] == UP and message is not None:
                        try:
                            s.setblocking(True)
                            s.settimeout(max(0.1, deadline - time.monotonic()))
                            s.sendall(json.dumps(message).encode())
                        except OSError:
                            out[key] = SILENT
                    s.close()
                    del socks[s]
    finally:
        for s, (key, *_) in socks.items():
            out.setdefault(key, SILENT)
            s.close()
        sel.close()
    return out


def identity(token: str, rank: int) -> bytes:
    """What a rank's listener says on each connection: the job's token and its rank."""
    return f"{token}:{rank}".encode()


@dataclass
class Links:
    """What this rank needs to find its side of a cut in the world it was armed for (arm)."""

    world: object        # the world armed for (a side is found only in it)
    dup: object          # its duplicate, never revoked: a side's communicator is made from it
    names: tuple         # each rank's host
    peers: dict          # rank -> (address, port) it is reached at
    token: str
    listener: Listener
    seen: int = 0        # the watch's probes in a row that found a host silent
    last: float = 0.0    # when the watch last probed (time.monotonic())

    @property
    def rank(self) -> int:
        return self.world.rank

    def identity(self, rank: int) -> bytes:
        return identity(self.token, rank)

    def probe(self, seconds: float = PROBE_SECONDS) -> dict:
        """Every rank's answer (this one: UP), from a connection to each (collective over nobody)."""
        targets = {r: (*self.peers[r], self.identity(r)) for r in range(len(self.names)) if r != self.rank}
        out = _connect(targets, seconds)
        out[self.rank] = UP
        return out

    def silent_hosts(self, answers: dict) -> list[str]:
        """The hosts none of whose ranks answered."""
        hosts = list(dict.fromkeys(self.names))
        return [h for h in hosts if all(answers.get(r) == SILENT for r, n in enumerate(self.names) if n == h)]

    def look(self, groups, runtime, waited: float) -> None:
        """From the hang watch's thread, while this rank has waited long in a collective: probe (every WATCH_EVERY
        seconds); a host silent twice in a row is cut off: revoke this rank's communicators (ulfm.revoke_all), so
        that its side goes on as after a failure (survivors then finds the side)."""
        now = time.monotonic()
        if now - self.last < WATCH_EVERY or runtime.cut_at is not None or groups.world is not self.world:
            return
        self.last = now
        answers = self.probe(WATCH_PROBE_SECONDS)
        silent = self.silent_hosts(answers)
        self.seen = self.seen + 1 if silent else 0
        if self.seen < 2:
            return
        from ..log import event, say
        from . import ulfm
        runtime.cut_at = time.time()
        reached = [r for r, a in answers.items() if a == UP]
        if self.rank == min(reached):  # one line a side
            event("cut_seen", any_rank=True, rank=self.rank, silent=silent, waited=round(waited, 1))
            say(f"dsim: warning: rank {self.rank}: no answer from host(s) {', '.join(silent)} (none of their ranks "
                f"takes a TCP connection) while this rank waits in a collective: a network cut, or a host gone; the "
                "job's communicators are revoked, and the side holding the quorum of the hosts saves")
        ulfm.revoke_all(groups)


def arm(run) -> None:
    """At the start of training, in a job over several hosts under ULFM (collective over the world): this process's
    listener (made once), every rank's address, and the world's duplicate (Runtime.links). Elsewhere nothing."""
    from . import ulfm
    groups, runtime = run.groups, run.runtime
    hosts = getattr(groups, "hosts", None)
    if hosts is None or len(hosts.distinct) < 2 or ulfm.unavailable_reason() is not None:
        return
    links = runtime.links
    if links is not None and links.world is groups.world:
        return
    world = groups.world
    listener = links.listener if links is not None else Listener()
    token = world.bcast(secrets.token_hex(8) if world.rank == 0 else None, root=0)
    listener.identity = identity(token, world.rank)
    table = world.allgather((addresses(), listener.port))
    # each other host's address that answers as its first rank (the same for all its ranks): a host's interfaces
    # may include ones every host has (a container bridge), where another process may take the connection
    peers = {}
    for name in hosts.distinct:
        ranks = hosts.ranks(name)
        addrs, port = table[ranks[0]]
        if name == hosts.names[world.rank]:
            address = "127.0.0.1"
        else:
            answers = _connect({a: (a, port, identity(token, ranks[0])) for a in addrs}, PROBE_SECONDS)
            address = next((a for a in addrs if answers.get(a) == UP), addrs[0] if addrs else "127.0.0.1")
        peers.update({q: (address, table[q][1]) for q in ranks})
    runtime.links = Links(world, world.Dup(), tuple(hosts.names), peers, token, listener)
    runtime.cut_at = None
    runtime.poll = True  # (a blocking collective may never return after a cut: Runtime.collective)


def survivors(world, runtime):
    """The communicator of this side's living ranks and the sorted world ranks left out, in place of ulfm.shrink
    after a failure: MPI's shrink when every host answers; after a cut, the side agreed (side) and its communicator
    made from the world's duplicate. A side without the quorum of the hosts stops here (dsim.ft.quorum.stop)."""
    from mpi4py import MPI

    from . import quorum, ulfm
    links = runtime.links
    shrink = lambda: runtime.collective(ulfm.shrink, world, runtime=runtime)  # noqa: E731 (MPI's)
    if links is None or links.world is not world:
        return shrink()
    if runtime.cut_at is None:  # not found by this rank's watch: a host silent twice, WATCH_EVERY apart (a rank
        # slow to answer on a loaded machine, or one being killed, is silent a moment; a host of them is not)
        if not links.silent_hosts(links.probe()):  # every host answers (a dead rank's refuses): MPI's shrink
            return shrink()
        time.sleep(WATCH_EVERY)
        if not links.silent_hosts(links.probe()):
            return shrink()
        runtime.cut_at = time.time()
    agreed = runtime.collective(side, links)  # (a wait for the others of its side, as the hang watch sees it)
    if agreed is None:
        _stop(f"dsim: error: rank {links.rank}: the ranks this side of a network cut reaches do not agree on who "
              f"they are in {AGREE_SECONDS:g} s (a link that flaps): stopping without a checkpoint")
    view, stuck = agreed
    lead = links.rank == min(view)
    if lead and stuck:  # reachable, but never came to agree: stuck in MPI (a send across the cut)
        _connect({r: (*links.peers[r], links.identity(r)) for r in stuck}, PROBE_SECONDS,
                 {"token": links.token, "stop": True})
    verdict = quorum.decide(links.names, view)
    if not verdict.holds:
        quorum.stop(verdict, lead=lead)
    timer = threading.Timer(CREATE_SECONDS, _stop, (f"dsim: error: rank {links.rank}: the communicator of this side "
                                                    f"of a network cut was not made in {CREATE_SECONDS:g} s: stopping "
                                                    "without a checkpoint",))
    timer.daemon = True
    timer.start()
    group = links.dup.Get_group().Incl(view)
    try:
        comm = runtime.collective(links.dup.Create_group, group, 52)
    except MPI.Exception:  # MPI knows a rank of the world dead (a host gone, not cut): then its shrink completes
        runtime.cut_at = None
        return shrink()
    finally:
        timer.cancel()
        group.Free()
    runtime.shrunk = comm
    left_out = sorted(set(range(world.size)) - set(view))
    if comm.rank == 0:
        from ..log import event
        event("cut_side", any_rank=True, ranks=view, stopped=stuck, hosts=list(verdict.reachable), left_out=left_out)
    return comm, left_out


def side(links: Links, grace: float = GRACE_SECONDS, limit: float = AGREE_SECONDS, seconds: float = PROBE_SECONDS):
    """(the ranks of this side, agreed by each of them; the ranks it reaches that never took part), or None when
    they do not agree within `limit` seconds. Each round every rank probes every rank and sends its view to each one
    that answered; the last view each sent counts. A view is the ranks that answer, and, past `grace` seconds,
    only those of them that sent one: a rank whose main thread is stuck in MPI (a send across the cut never
    returns: docs/design/node-faults.md) answers through its listener but never takes part, and is left out."""
    began = time.monotonic()
    while time.monotonic() - began < limit:
        answers = links.probe(seconds)
        up = sorted(r for r, a in answers.items() if a == UP)
        heard = {r for (token, r) in links.listener.views if token == links.token} | {links.rank}
        view = tuple(up if time.monotonic() - began < grace else [r for r in up if r in heard])
        message = {"token": links.token, "rank": links.rank, "view": view}
        others = [r for r in up if r != links.rank]
        _connect({r: (*links.peers[r], links.identity(r)) for r in others}, seconds, message)
        if links.listener.wait(links.token, [r for r in view if r != links.rank], view, seconds):
            return list(view), [r for r in up if r not in view]
    return None


def _stop(line) -> None:
    """End this process at once, without MPI_Finalize and without writing (its rescue files deleted), after `line`."""
    from ..log import leave, tell
    from ..runtime import PROCESS
    if PROCESS.rescue is not None:
        PROCESS.rescue.discard()
    if line:
        tell(line)
    leave(1)
