"""`python -m dsim.cluster up|run|down|list|kill|cut|restore|replace-disk|shape`: a cluster of namespaces (as root).

    $ python -m dsim.cluster up --hosts 2 --slots 4 [--rate 10gbit]
    $ python -m dsim.cluster run -- bash launch/run_parallel_save_ckpt.sh      # HOSTFILE is the cluster's
    $ python -m dsim.cluster run -- mpirun --hostfile /var/tmp/dsim-cluster/dsim/hostfile --map-by ppr:4:node \\
          -n 8 python -m dsim.train
    $ python -m dsim.cluster down            # or down --all: every cluster's leftovers

`run` without a cluster up makes one for the command (--hosts, --slots) and tears it down after, whatever
happens. A command that is mpirun is run through dsim/ft/launcher.py, as the launch scripts run it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from . import Cluster, ClusterError, clusters, leftovers, teardown

LAUNCHER = Path(__file__).resolve().parents[1] / "ft" / "launcher.py"
MPIRUNS = ("mpirun", "mpiexec", "prterun")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m dsim.cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)

    def verb(name, help, shape=False):
        p = sub.add_parser(name, help=help)
        p.add_argument("--name", default="dsim", help="the cluster's name (default dsim)")
        if shape:
            p.add_argument("--hosts", type=int, default=2)
            p.add_argument("--slots", type=int, default=4, help="ranks a host takes (the hostfile's slots)")
            p.add_argument("--subnet", default="10.77.0.0/24", help="the hosts' addresses (inside the cluster only)")
            p.add_argument("--rate", help="shape every link with tc tbf to this rate, e.g. 10gbit")
            p.add_argument("--latency", default="1ms", help="tbf's queue latency with --rate")
        return p
    verb("up", "make a cluster and leave it up", shape=True)
    run = verb("run", "run a command on a host (the cluster that is up, else one made for it)", shape=True)
    run.add_argument("--host", type=int, default=1, help="the host to run on (default 1: mpirun's node)")
    run.add_argument("--timeout", type=float, help="kill the command and everything below it after this many s")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    down = verb("down", "tear a cluster down (also one whose maker was killed)")
    down.add_argument("--all", action="store_true", help="every cluster on the machine")
    verb("list", "the clusters on the machine, and what each has left")
    for name, help in (("kill", "kill every process of a host (Open MPI's daemon, the ranks)"),
                       ("cut", "cut a host's link"), ("restore", "bring a host's link back"),
                       ("replace-disk", "replace a host's local disk by an empty one")):
        verb(name, help).add_argument("host", type=int)
    shape = verb("shape", "shape a host's link (tc tbf), or unshape it with --rate none")
    shape.add_argument("host", type=int)
    shape.add_argument("--rate", required=True)
    shape.add_argument("--latency", default="1ms")
    args = parser.parse_args(argv)
    if args.verb == "run":
        if args.command[:1] == ["--"]:
            args.command = args.command[1:]
        if not args.command:
            parser.error("run: no command given (python -m dsim.cluster run -- COMMAND ...)")
    return args


def run(args) -> int:
    """Run args.command on a host; make a cluster for it (and tear it down) when none named args.name is up."""
    try:
        cluster, made = Cluster.load(args.name), None
    except ClusterError:
        cluster = made = Cluster(args.hosts, args.slots, args.name, args.subnet, args.rate, args.latency)
    cmd = args.command
    if os.path.basename(cmd[0]) in MPIRUNS:  # watched as the launch scripts watch it
        cmd = [sys.executable, str(LAUNCHER), *cmd]
    env = {**cluster.env(), **os.environ} if "HOSTFILE" in os.environ else {**os.environ, **cluster.env()}
    try:
        if made:
            made.__enter__()
            print(made.describe(), file=sys.stderr)
        from dsim.ft.launcher import kill_tree, supervise
        proc = subprocess.Popen(cluster.command(args.host, cmd), env=env)
        try:
            how = supervise(proc, float("inf") if args.timeout is None else args.timeout, stalls=False, group=False)
        except BaseException:  # Ctrl-C, SIGTERM: the command and everything below it, then the cluster
            kill_tree(proc.pid, group=False)
            proc.wait()
            raise
        proc.wait()
        if how == "timeout":
            print(f"dsim cluster: error: the command still ran after {args.timeout:g} s; killed it", file=sys.stderr)
            return 124
        return proc.returncode
    finally:
        if made:
            made.__exit__(None, None, None)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.verb == "up":
            cluster = Cluster(args.hosts, args.slots, args.name, args.subnet, args.rate, args.latency).up()
            print(cluster.describe())
        elif args.verb == "run":
            return run(args)
        elif args.verb == "down":
            for name in (clusters() if args.all else [args.name]):
                teardown(name)
                left = leftovers(name)
                if left:
                    print(f"dsim cluster: error: {name}: left: {'; '.join(left)}", file=sys.stderr)
                    return 1
        elif args.verb == "list":
            for name in clusters():
                try:
                    print(Cluster.load(name).describe())
                except ClusterError:
                    print(f"dsim cluster {name}: broken, left: {'; '.join(leftovers(name))} (down --name {name})")
        else:
            cluster = Cluster.load(args.name)
            if args.verb == "kill":
                print(f"killed {len(cluster.kill_host(args.host))} process(es) on {cluster.hostname(args.host)}")
            elif args.verb == "cut":
                cluster.cut(args.host)
            elif args.verb == "restore":
                cluster.restore(args.host)
            elif args.verb == "replace-disk":
                print(f"{cluster.hostname(args.host)}: a new empty disk: {cluster.replace_disk(args.host)}")
            elif args.verb == "shape":
                if args.rate == "none":
                    cluster.unshape(args.host)
                else:
                    cluster.shape(args.host, args.rate, args.latency)
    except ClusterError as e:
        print(f"dsim cluster: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
