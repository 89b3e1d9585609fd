"""A cluster of H hosts of S slots on this machine, made of Linux namespaces: for testing dsim across hosts.

    $ python -m dsim.cluster up --hosts 2 --slots 4       # as root; prints the hostfile and the agent
    $ python -m dsim.cluster run -- mpirun -n 8 python -m dsim.train    # on node1, with the cluster's MPI settings
    $ python -m dsim.cluster down

    with Cluster(hosts=2, slots=4) as cluster:            # torn down on leaving, however it is left
        subprocess.run(cluster.command(1, ["mpirun", *cluster.mpirun_args(), "-n", "8", ...]), env=cluster.env())

A host (node1 ... nodeH) is
- a network namespace `dsimc-NAME-I` (`ip netns`) whose eth0 (address SUBNET.I) is one end of a veth pair, the
  other end a port of a bridge in a namespace of the cluster's own, `dsimc-NAME-net`: traffic between hosts stays
  in namespaces the cluster made, and no address is added outside them. A link may be shaped (tc tbf: a rate,
  the queue's latency) on both of its ends;
- a mount and UTS namespace held by a keeper process (`sleep infinity`) living in that network namespace: its
  hostname, /etc/hosts from /etc/netns/dsimc-NAME-I/hosts (every host by name), its own /dev/shm (shared memory
  is per host, as on real machines), and its own local disk: a directory of the cluster's state directory
  bind-mounted at DISK_PATH, the same path on every host.

Open MPI starts its daemons (prted) on the hosts with its ssh launcher, told to run the cluster's agent instead of
ssh (`plm_ssh_agent`): `agent HOST COMMAND...` runs COMMAND with /bin/sh inside HOST's namespaces. mpirun itself
runs on node1 (command(1, ...)), as it would on a cluster's first node.

Teardown kills every process in the cluster's network namespaces (the keepers with the rest: the mount and UTS
namespaces, and every mount in them, go with their last process), deletes the network namespaces (the veths and
the bridge go with them), and removes /etc/netns/dsimc-NAME-* and the state directory. It works from what is on
the machine (names with the cluster's prefix), not from this object's memory, so `down` also cleans up after a
maker that was killed. A `with Cluster(...)` block tears down on any exit, SIGTERM and SIGHUP included
(SIGINT already raises KeyboardInterrupt).
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

PREFIX = "dsimc-"                        # every namespace the clusters make starts with this
DISK_PATH = "/var/tmp/dsim-node"         # where each host's local disk is mounted, on every host
STATE_ROOT = Path(os.environ.get("DSIM_CLUSTER_DIR", "/var/tmp/dsim-cluster"))  # a directory a cluster
SUBNET = "10.77.0.0/24"                  # the hosts' addresses: only inside the cluster's namespaces
TOOLS = ("ip", "nsenter", "unshare", "tc")


class ClusterError(RuntimeError):
    """A cluster could not be made or used (the reason in one line)."""


def unavailable() -> str | None:
    """Why a cluster cannot be made here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns add)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install iproute2 util-linux)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    _run(["ip", "netns", "del", probe], check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    return None


def _run(cmd, check=True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(map(str, cmd))}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc


def _netns_inode(ns: str):
    """(device, inode) of a named network namespace, None when there is none by that name."""
    try:
        st = os.stat(f"/run/netns/{ns}")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def processes_in(namespaces) -> list[int]:
    """The live processes whose network namespace is one of the named ones (a host's processes)."""
    wanted = {i for i in map(_netns_inode, namespaces) if i is not None}
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                st = os.stat(f"/proc/{entry.name}/ns/net")
            except OSError:
                continue  # gone, or a zombie (its namespaces already released)
            if (st.st_dev, st.st_ino) in wanted:
                found.append(int(entry.name))
    return found


def kill_all(namespaces, keep=(), seconds: float = 10.0) -> list[int]:
    """SIGKILL every process in the named network namespaces but `keep`, until none is left (a dying daemon may
    fork); returns the pids killed."""
    killed, deadline = set(), time.monotonic() + seconds
    while True:
        pids = [p for p in processes_in(namespaces) if p not in keep]
        if not pids:
            return sorted(killed)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed.add(p)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise ClusterError(f"processes still in {', '.join(namespaces)}: {pids}")
        time.sleep(0.02)


def namespaces(prefix: str = PREFIX) -> list[str]:
    """The named network namespaces starting with prefix."""
    try:
        return sorted(n for n in os.listdir("/run/netns") if n.startswith(prefix))
    except OSError:
        return []


def clusters() -> list[str]:
    """The names of the clusters on this machine (their namespaces, or their state directories)."""
    names = {n[len(PREFIX):].rsplit("-", 1)[0] for n in namespaces()}
    if STATE_ROOT.is_dir():
        names.update(p.name for p in STATE_ROOT.iterdir() if p.is_dir())
    return sorted(names)


def leftovers(name: str) -> list[str]:
    """What cluster `name` has left on the machine: namespaces, processes, /etc/netns entries, its state
    directory (one line each; [] when it is all gone). Its mounts live only in its keepers' namespaces."""
    ns = namespaces(f"{PREFIX}{name}-")
    left = [f"network namespace {n}" for n in ns]
    left += [f"process {p} ({_cmdline(p)})" for p in processes_in(ns)]
    left += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
             if f"/{PREFIX}{name}-" in line or f"{STATE_ROOT}/{name}/" in line]
    left += [f"{p}" for p in sorted(Path("/etc/netns").glob(f"{PREFIX}{name}-*"))]
    if (STATE_ROOT / name).exists():
        left.append(str(STATE_ROOT / name))
    return left


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def teardown(name: str) -> None:
    """Remove everything of cluster `name` that is on the machine (see the module's docstring); idempotent.
    SIGINT, SIGTERM and SIGHUP wait until it is done (a second Ctrl-C does not leave half a cluster); a process
    that would not die is named in a ClusterError after the rest is removed."""
    blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        ns = namespaces(f"{PREFIX}{name}-")
        stuck = None
        try:
            kill_all(ns)
        except ClusterError as e:
            stuck = e
        for n in ns:
            _run(["ip", "netns", "del", n], check=False)
        for p in Path("/etc/netns").glob(f"{PREFIX}{name}-*"):
            shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(STATE_ROOT / name, ignore_errors=True)
        if stuck:
            raise stuck
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Cluster:
    """H hosts of S slots (see the module's docstring). Made by up() or `with`, found again by Cluster.load."""

    def __init__(self, hosts: int = 2, slots: int = 4, name: str = "dsim", subnet: str = SUBNET,
                 rate: str | None = None, latency: str = "1ms", disk_path: str = DISK_PATH):
        if not 1 <= hosts <= 200:
            raise ClusterError(f"hosts must be 1 to 200, not {hosts}")
        if not name.replace("_", "").isalnum() or len(name) > 20:
            raise ClusterError(f"a cluster's name is letters, digits and _ (20 at most), not {name!r}")
        self.hosts, self.slots, self.name, self.subnet = hosts, slots, name, str(ipaddress.ip_network(subnet))
        self.rate, self.latency, self.disk_path = rate, latency, disk_path
        self.state = STATE_ROOT / name
        self.keepers: dict[int, int] = {}   # host -> pid of the process holding its mount and UTS namespaces
        self.disks: dict[int, int] = {}     # host -> the generation of its disk (replace_disk: one more)
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict = {}

    # names and paths
    def netns(self, host: int) -> str:
        return f"{PREFIX}{self.name}-{host}"

    @property
    def bridge_ns(self) -> str:
        return f"{PREFIX}{self.name}-net"

    def hostname(self, host: int) -> str:
        return f"node{host}"

    def address(self, host: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[host])

    @property
    def hostfile(self) -> Path:
        return self.state / "hostfile"

    @property
    def agent(self) -> Path:
        return self.state / "agent"

    def disk(self, host: int) -> Path:
        """The directory that is host's local disk now (mounted at disk_path on that host)."""
        return self.state / "disks" / f"{self.hostname(host)}.{self.disks.get(host, 1)}"

    # making and tearing down
    def up(self) -> "Cluster":
        """Make the cluster; on any failure tear down what was made and raise ClusterError."""
        why = unavailable()
        if why:
            raise ClusterError(why)
        if namespaces(f"{PREFIX}{self.name}-") or self.state.exists():
            raise ClusterError(f"a cluster named {self.name} is up already (python -m dsim.cluster down --name "
                               f"{self.name})")
        if self.hosts + 1 >= ipaddress.ip_network(self.subnet).num_addresses:
            raise ClusterError(f"subnet {self.subnet} too small for {self.hosts} hosts")
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        self.state.mkdir(parents=True)
        prefix = ipaddress.ip_network(self.subnet).prefixlen
        net = self.bridge_ns
        _run(["ip", "netns", "add", net])
        _run(["ip", "-n", net, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", net, "link", "set", "br0", "up"])
        hosts_text = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(h)} {self.hostname(h)}\n" for h in range(1, self.hosts + 1))
        for h in range(1, self.hosts + 1):
            ns = self.netns(h)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{h}", "netns", net])
            _run(["ip", "-n", net, "link", "set", f"p{h}", "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(h)}/{prefix}", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.rate:
                self.shape(h, self.rate, self.latency)
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_text)
            self.disks[h] = 1
            self.disk(h).mkdir(parents=True)
            self.keepers[h] = self._keep(h)
        self.hostfile.write_text("".join(f"{self.hostname(h)} slots={self.slots}\n" for h in range(1, self.hosts + 1)))
        self._write_agent()
        self._save()

    def _keep(self, host: int) -> int:
        """Start host's keeper: a process in its network namespace that makes the host's mount and UTS namespaces
        (hostname, /etc/hosts, /dev/shm, the disk) and then sleeps, holding them. Returns its pid."""
        ns, d = self.netns(host), self.disk_path
        setup = (f"hostname {self.hostname(host)} && mount --bind /etc/netns/{ns}/hosts /etc/hosts && "
                 f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm && mkdir -p {d} && mount --bind {self.disk(host)} {d} "
                 f"&& echo ready && exec sleep infinity")
        proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "--", "unshare", "--mount", "--uts",
                                 "--propagation", "slave", "--", "sh", "-c", setup],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # not in the caller's group: down() ends it
        self._procs.append(proc)
        line = proc.stdout.readline()
        proc.stdout.close()
        if line.strip() != "ready":
            proc.wait()
            raise ClusterError(f"{self.hostname(host)}: could not set up its namespaces: {proc.stderr.read().strip()}")
        proc.stderr.close()
        return proc.pid

    def _write_agent(self) -> None:
        cases = "".join(
            f"    {self.hostname(h)}|{self.address(h)}) pid={self.keepers[h]} net={_netns_inode(self.netns(h))[1]} ;;\n"
            for h in range(1, self.hosts + 1))
        self.agent.write_text(f"""#!/bin/sh
# dsim cluster {self.name}: Open MPI's ssh launcher runs this instead of ssh (--prtemca plm_ssh_agent {self.agent}).
#   agent [ssh options] HOST COMMAND...  runs COMMAND with /bin/sh inside HOST's namespaces (network, mounts,
#   hostname), in the caller's working directory. Made by python -m dsim.cluster; removed by its down.
while [ $# -gt 0 ] && [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
{cases}    *) echo "dsim cluster {self.name}: no host $host" >&2; exit 255 ;;
esac
if [ "$(readlink /proc/$pid/ns/net 2>/dev/null)" != "net:[$net]" ]; then
    echo "dsim cluster {self.name}: host $host is down (its keeper, pid $pid, is gone)" >&2; exit 255
fi
exec nsenter --target "$pid" --net --mount --uts --wd="$PWD" -- /bin/sh -c "$*"
""")
        self.agent.chmod(0o755)

    def _save(self) -> None:
        (self.state / "cluster.json").write_text(json.dumps({
            "hosts": self.hosts, "slots": self.slots, "subnet": self.subnet, "rate": self.rate,
            "latency": self.latency, "disk_path": self.disk_path, "keepers": self.keepers, "disks": self.disks}))

    @classmethod
    def load(cls, name: str = "dsim") -> "Cluster":
        """The cluster `name` that is up (made by up(), maybe by another process)."""
        try:
            s = json.loads((STATE_ROOT / name / "cluster.json").read_text())
        except (OSError, ValueError):
            raise ClusterError(f"no cluster named {name} is up (python -m dsim.cluster up --name {name})") from None
        c = cls(s["hosts"], s["slots"], name, s["subnet"], s["rate"], s["latency"], s["disk_path"])
        c.keepers = {int(k): v for k, v in s["keepers"].items()}
        c.disks = {int(k): v for k, v in s["disks"].items()}
        return c

    def down(self) -> None:
        """Tear the cluster down (teardown), reaping the keepers this object started."""
        teardown(self.name)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()

    def __enter__(self) -> "Cluster":
        for s in (signal.SIGTERM, signal.SIGHUP):  # into an exception, so that __exit__ runs
            try:
                self._old_handlers[s] = signal.signal(s, _raise_exit)
            except ValueError:
                pass  # not the main thread: the caller's handlers stay
        try:
            return self.up()
        except BaseException:
            self._restore_handlers()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            self._restore_handlers()

    def _restore_handlers(self) -> None:
        for s, handler in self._old_handlers.items():
            signal.signal(s, handler)
        self._old_handlers.clear()

    # using it
    def env(self) -> dict[str, str]:
        """The environment for mpirun on the cluster: Open MPI's ssh launcher through the agent, its daemons and
        the ranks' TCP transport on the cluster's subnet, and HOSTFILE (for the launch scripts and make train)."""
        return {"PRTE_MCA_plm_ssh_agent": str(self.agent), "PRTE_MCA_prte_if_include": self.subnet,
                "OMPI_MCA_btl_tcp_if_include": self.subnet, "HOSTFILE": str(self.hostfile),
                "DSIM_CLUSTER": self.name}

    def mpirun_args(self, map_by: str = "slot") -> list[str]:
        """mpirun's options for a job over every host: the hostfile, and the mapping (slot: node1's slots first,
        then node2's, as the launch scripts map with HOSTFILE; node: round robin; ppr:N:node: N a host)."""
        return ["--hostfile", str(self.hostfile), "--map-by", map_by]

    def command(self, host: int, argv: list[str], cwd: str | None = None) -> list[str]:
        """argv run on host (in its namespaces, in cwd or the caller's directory): for subprocess."""
        self._check(host)
        return ["nsenter", "--target", str(self.keepers[host]), "--net", "--mount", "--uts",
                f"--wd={cwd or os.getcwd()}", "--", *map(str, argv)]

    def _check(self, host: int) -> None:
        if host not in self.keepers:
            raise ClusterError(f"cluster {self.name} has no host {host} (1 to {self.hosts})")

    def processes(self, host: int) -> list[int]:
        """Every process running on host (its keeper too)."""
        return processes_in([self.netns(host)])

    # faults, for the node-fault tests
    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process on host (Open MPI's daemon and the ranks), as a machine that dies; the host
        itself (addresses, disk) stays, so a job can be started on it again. Returns the pids killed."""
        self._check(host)
        return kill_all([self.netns(host)], keep={self.keepers[host]})

    def cut(self, host: int) -> None:
        """Cut host's link (its bridge port down): nothing reaches it or leaves it until restore(host)."""
        self._check(host)
        _run(["ip", "-n", self.bridge_ns, "link", "set", f"p{host}", "down"])

    def restore(self, host: int) -> None:
        """Bring host's link back after cut(host)."""
        self._check(host)
        _run(["ip", "-n", self.bridge_ns, "link", "set", f"p{host}", "up"])

    def replace_disk(self, host: int) -> Path:
        """Replace host's local disk by an empty one (the old one's contents are gone); returns the new one.
        A process with a file of the old disk open keeps it; what it writes there is lost."""
        self._check(host)
        old = self.disk(host)
        self.disks[host] += 1
        self.disk(host).mkdir(parents=True)
        d = self.disk_path
        _run(["nsenter", "--target", str(self.keepers[host]), "--mount", "--", "sh", "-c",
              f"umount -l {d} && mount --bind {self.disk(host)} {d}"])
        shutil.rmtree(old, ignore_errors=True)
        self._save()
        return self.disk(host)

    def shape(self, host: int, rate: str, latency: str = "1ms", burst: str | None = None) -> None:
        """Shape host's link, both ways, with tc's token bucket (tbf): `rate` (e.g. 10gbit, 100mbit), the queue's
        `latency` (how long a packet may wait for tokens) and `burst` (default: 10 ms at the rate, 64 KiB at least)."""
        burst = burst or f"{max(64 << 10, _bits_per_second(rate) // 8 // 100)}b"
        for ns, dev in ((self.netns(host), "eth0"), (self.bridge_ns, f"p{host}")):
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                  "latency", latency])

    def unshape(self, host: int) -> None:
        for ns, dev in ((self.netns(host), "eth0"), (self.bridge_ns, f"p{host}")):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def describe(self) -> str:
        """A few lines: the hosts, the hostfile, the agent, how to run mpirun on the cluster."""
        lines = [f"dsim cluster {self.name}: {self.hosts} host(s) x {self.slots} slot(s) on {self.subnet}"
                 + (f", links shaped to {self.rate}" if self.rate else "")]
        lines += [f"  {self.hostname(h)} {self.address(h)} netns {self.netns(h)}, disk {self.disk(h)} at "
                  f"{self.disk_path}" for h in range(1, self.hosts + 1)]
        lines += [f"  hostfile {self.hostfile}", f"  agent    {self.agent}",
                  f"  run:     python -m dsim.cluster run --name {self.name} -- mpirun "
                  f"{' '.join(self.mpirun_args())} -n {self.hosts * self.slots} ..."]
        return "\n".join(lines)


def _bits_per_second(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12, "bit": 1}
    r = rate.strip().lower()
    for unit, factor in units.items():
        if r.endswith(unit):
            return int(float(r[:-len(unit)]) * factor)
    raise ClusterError(f"a rate is a number and kbit, mbit, gbit or tbit (e.g. 10gbit), not {rate!r}")


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)
