"""`python -m cluster.local up|down|status`: a Ray cluster of a head and N worker nodes on this machine.

Each node is its own `ray start --block` (own ports, own CPUs and a `worker-<i>` resource) in its own
process group, so `down` stops exactly this cluster's processes (never `ray stop`, which stops every
Ray process of the user). State lives in `--dir` (default /tmp/iterserve-cluster): ports and the
process-group ids. The nodes listen on this machine only; token auth is off (RAY_AUTH_MODE=disabled)
so that workers and drivers join without a token. Processes get this checkout on PYTHONPATH.

    python -m cluster.local up --workers 2        # head + 2 workers, prints the addresses as JSON
    python -m cluster.local status                # nodes (alive, resources) and Serve replicas per node
    python -m cluster.local down
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")
LEFTOVER_S = 2.0  # what a node's group still runs this long after its `ray start` exited is killed
PORTS_PER_NODE = 100  # GCS, dashboard, client: base + 0..2; node i (head 0): base + 100 (i + 1) .. + 99


def env() -> dict:
    # No drain on SIGTERM: nodes stop only with `down`, the whole cluster at once, so a draining node's
    # replicas have nowhere to go and Ray would wait its drain timeout (30 s) for them.
    e = dict(
        os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"
    )
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    return e


def _node_args(base: int) -> List[str]:
    return [
        "--node-ip-address",
        "127.0.0.1",
        "--node-manager-port",
        str(base + 1),
        "--object-manager-port",
        str(base + 2),
        "--min-worker-port",
        str(base + 10),
        "--max-worker-port",
        str(base + 99),
        "--dashboard-agent-listen-port",
        str(base + 3),
        "--dashboard-agent-grpc-port",
        str(base + 4),
        "--runtime-env-agent-port",
        str(base + 5),
        "--metrics-export-port",
        str(base + 6),
        "--object-store-memory",
        str(200 * 2**20),
        "--disable-usage-stats",
    ]


def _start(cmd: List[str], log: Path) -> int:
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(), start_new_session=True)
    return proc.pid  # = its process group id (new session)


def up(workers: int, cpus: float, head_cpus: float, base_port: int, state_dir: Path, timeout_s: float = 120) -> dict:
    state_dir.mkdir(parents=True, exist_ok=True)
    if (state_dir / "cluster.json").exists():
        raise SystemExit(f"a cluster is recorded in {state_dir}; run `down` first")
    gcs, dashboard = base_port, base_port + 1
    info = {
        "dir": str(state_dir),
        "address": f"127.0.0.1:{gcs}",
        "dashboard": f"http://127.0.0.1:{dashboard}",
        "workers": workers,
        "pgids": [],
    }
    head = [
        RAY,
        "start",
        "--head",
        "--block",
        "--port",
        str(gcs),
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dashboard),
        "--ray-client-server-port",
        str(base_port + 2),
        "--num-cpus",
        str(head_cpus),
        "--temp-dir",
        str(state_dir),
        *_node_args(base_port + PORTS_PER_NODE),
    ]
    info["pgids"].append(_start(head, state_dir / "head.log"))
    (state_dir / "cluster.json").write_text(json.dumps(info))  # `down` works even if what follows fails
    _wait_nodes(info, 1, timeout_s)
    for i in range(1, workers + 1):
        cmd = [
            RAY,
            "start",
            "--block",
            "--address",
            info["address"],
            "--num-cpus",
            str(cpus),
            "--resources",
            json.dumps({f"worker-{i}": 1}),
            *_node_args(base_port + PORTS_PER_NODE * (i + 1)),
        ]
        info["pgids"].append(_start(cmd, state_dir / f"worker-{i}.log"))
        (state_dir / "cluster.json").write_text(json.dumps(info))
        _wait_nodes(info, i + 1, timeout_s)  # one at a time: raylets starting together race for socket names
    return info


def _nodes(info: dict) -> Optional[list]:
    """The cluster's nodes from its dashboard (Ray's state API, no driver); None until it answers."""
    from ray.util.state import list_nodes

    try:
        nodes = list_nodes(address=info["dashboard"], limit=1000, timeout=10)
    except Exception:  # the dashboard is not up yet
        return None
    return [{"id": n.node_id, "alive": n.state == "ALIVE", "resources": n.resources_total} for n in nodes]


def _wait_nodes(info: dict, n: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        nodes = _nodes(info)
        if nodes is not None and sum(node["alive"] for node in nodes) >= n:
            return
        time.sleep(0.5)
    raise SystemExit(f"cluster did not reach {n} nodes in {timeout_s:.0f} s; see logs in {info['dir']}")


def down(state_dir: Path, grace_s: float = 15) -> None:
    path = state_dir / "cluster.json"
    if not path.exists():
        print(f"no cluster recorded in {state_dir}")
        return
    info = json.loads(path.read_text())
    # SIGTERM to each `ray start --block` (the group's leader), workers first: it stops its node's
    # processes in Ray's order (~3 s for three nodes). Signalled all at once, a node took over 15 s:
    # the autoscaler's monitor, its handler reporting to a GCS already gone, never exited. Once a
    # leader is gone, what its group still runs (Ray workers slow to follow their raylet, or the whole
    # node if the leader died before its handler was set) gets SIGTERM, and SIGKILL LEFTOVER_S later.
    pgids, leader_gone, killed = info["pgids"], {}, set()
    for pgid in reversed(pgids):
        _signal(pgid, signal.SIGTERM)
    deadline, leftovers = time.time() + grace_s, 0
    while time.time() < deadline and any(_members(p) for p in pgids):
        for pgid in pgids:
            if pgid not in leader_gone and not _running(pgid):
                leader_gone[pgid] = time.time()
                _signal_group(pgid, signal.SIGTERM)
            elif pgid in leader_gone and pgid not in killed and time.time() - leader_gone[pgid] > LEFTOVER_S:
                left = _members(pgid)
                if left:
                    leftovers += len(left)
                    killed.add(pgid)
                    _signal_group(pgid, signal.SIGKILL)
        time.sleep(0.2)
    stuck = [("head" if i == 0 else f"worker-{i}") for i, p in enumerate(pgids) if _running(p)]
    for pgid in pgids:
        _signal_group(pgid, signal.SIGKILL)
    # Workers Ray started in sessions of their own still name this cluster's session dir: by pid.
    for pid in _pids_mentioning(str(state_dir / "session_")):
        _signal(pid, signal.SIGKILL)
    path.unlink()
    how = (
        f"ray start killed after {grace_s:.0f} s: {', '.join(stuck)}"
        if stuck
        else "every node's ray start exited on SIGTERM"
    ) + (f"; {leftovers} leftover processes killed" if leftovers else "")
    print(f"stopped the cluster in {state_dir} ({how})")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _state_and_group(pid: int) -> Optional[tuple]:
    """(state, process group) from /proc/<pid>/stat; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def _running(pid: int, pgid: Optional[int] = None) -> bool:
    """Alive, not a zombie (the machine's init may reap an orphan only seconds later) and, given
    pgid, in that process group."""
    seen = _state_and_group(pid)
    return seen is not None and seen[0] not in ("Z", "X") and pgid in (None, seen[1])


def _members(pgid: int) -> List[int]:
    """The group's processes that still run."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _running(int(p.name), pgid)]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _pids_mentioning(text: str) -> List[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if text.encode() in (proc / "cmdline").read_bytes() and proc.stat().st_uid == os.getuid():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def status(state_dir: Path) -> dict:
    """This cluster's nodes and Serve replicas, from its dashboard (named, never auto-detected: with
    another Ray on the machine, a test session's own, auto-detection finds two and refuses)."""
    from ray.util.state import list_actors

    info = json.loads((state_dir / "cluster.json").read_text())
    nodes = _nodes(info)
    if nodes is None:
        raise SystemExit(f"the cluster's dashboard {info['dashboard']} does not answer; see logs in {state_dir}")
    actors = list_actors(address=info["dashboard"], filters=[("state", "=", "ALIVE")], limit=10000, timeout=30)
    replicas = [
        {"name": a.class_name, "node": a.node_id, "state": a.state}
        for a in actors
        if a.class_name.startswith("ServeReplica:")
    ]
    return {**info, "nodes": nodes, "replicas": replicas}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "status"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cpus", type=float, default=1, help="logical CPUs per worker node")
    ap.add_argument("--head-cpus", type=float, default=0, help="logical CPUs of the head (0: replicas go to workers)")
    ap.add_argument("--base-port", type=int, default=46000, help="node i uses base + 100 (i + 1) and up")
    ap.add_argument("--dir", default="/tmp/iterserve-cluster", help="state, logs and Ray's temp dir")
    args = ap.parse_args(argv)
    state_dir = Path(args.dir)
    if args.command == "up":
        print(json.dumps(up(args.workers, args.cpus, args.head_cpus, args.base_port, state_dir)))
    elif args.command == "down":
        down(state_dir)
    else:
        s = status(state_dir)
        for n in s["nodes"]:
            here = [r for r in s["replicas"] if r["node"] == n["id"]]
            kind = next((k for k in n["resources"] if k.startswith("worker-")), "head")
            print(
                f"{n['id'][:12]} {kind:<9} {'alive' if n['alive'] else 'dead':<5} "
                f"CPU {n['resources'].get('CPU', 0):g}  replicas: {', '.join(r['name'] for r in here) or '-'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
