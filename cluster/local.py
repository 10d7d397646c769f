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
PORTS_PER_NODE = 100  # GCS, dashboard, client: base + 0..2; node i (head 0): base + 100 (i + 1) .. + 99


def env() -> dict:
    e = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    return e


def _node_args(base: int) -> List[str]:
    return ["--node-ip-address", "127.0.0.1", "--node-manager-port", str(base + 1),
            "--object-manager-port", str(base + 2), "--min-worker-port", str(base + 10),
            "--max-worker-port", str(base + 99), "--dashboard-agent-listen-port", str(base + 3),
            "--dashboard-agent-grpc-port", str(base + 4), "--runtime-env-agent-port", str(base + 5),
            "--metrics-export-port", str(base + 6), "--object-store-memory", str(200 * 2**20),
            "--disable-usage-stats"]


def _start(cmd: List[str], log: Path) -> int:
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(), start_new_session=True)
    return proc.pid  # = its process group id (new session)


def up(workers: int, cpus: float, head_cpus: float, base_port: int, state_dir: Path, timeout_s: float = 120) -> dict:
    state_dir.mkdir(parents=True, exist_ok=True)
    if (state_dir / "cluster.json").exists():
        raise SystemExit(f"a cluster is recorded in {state_dir}; run `down` first")
    gcs, dashboard = base_port, base_port + 1
    info = {"dir": str(state_dir), "address": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dashboard}",
            "workers": workers, "pgids": []}
    head = [RAY, "start", "--head", "--block", "--port", str(gcs), "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(dashboard), "--ray-client-server-port", str(base_port + 2),
            "--num-cpus", str(head_cpus), "--temp-dir", str(state_dir), *_node_args(base_port + PORTS_PER_NODE)]
    info["pgids"].append(_start(head, state_dir / "head.log"))
    (state_dir / "cluster.json").write_text(json.dumps(info))  # `down` works even if what follows fails
    _wait_nodes(info, 1, timeout_s)
    for i in range(1, workers + 1):
        cmd = [RAY, "start", "--block", "--address", info["address"], "--num-cpus", str(cpus),
               "--resources", json.dumps({f"worker-{i}": 1}), *_node_args(base_port + PORTS_PER_NODE * (i + 1))]
        info["pgids"].append(_start(cmd, state_dir / f"worker-{i}.log"))
        (state_dir / "cluster.json").write_text(json.dumps(info))
        _wait_nodes(info, i + 1, timeout_s)  # one at a time: raylets starting together race for socket names
    return info


def _alive_nodes(info: dict) -> Optional[list]:
    code = ("import json, ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
            "print(json.dumps([{'id': n['NodeID'], 'alive': n['Alive'], 'resources': n['Resources']} "
            "for n in ray.nodes()]))") % info["address"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=60)
    if out.returncode != 0:
        return None
    return [n for n in json.loads(out.stdout.strip().splitlines()[-1]) if n["alive"]]


def _wait_nodes(info: dict, n: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        nodes = _alive_nodes(info)
        if nodes is not None and len(nodes) >= n:
            return
        time.sleep(2)
    raise SystemExit(f"cluster did not reach {n} nodes in {timeout_s:.0f} s; see logs in {info['dir']}")


def down(state_dir: Path, grace_s: float = 15) -> None:
    path = state_dir / "cluster.json"
    if not path.exists():
        print(f"no cluster recorded in {state_dir}")
        return
    info = json.loads(path.read_text())
    for pgid in reversed(info["pgids"]):  # workers first, then the head
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(_group_alive(p) for p in info["pgids"]):
        time.sleep(0.5)
    for pgid in info["pgids"]:
        _signal_group(pgid, signal.SIGKILL)
    # Workers Ray started in sessions of their own still name this cluster's session dir: by pid.
    for pid in _pids_mentioning(str(state_dir / "session_")):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    path.unlink()
    print(f"stopped the cluster in {state_dir}")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


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
    # Every call names this cluster's address: with another Ray running on the machine (a test
    # session's own), Ray's auto-detection finds two and refuses.
    info = json.loads((state_dir / "cluster.json").read_text())
    code = ("import json, ray; from ray.util.state import list_actors; "
            "ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
            "nodes = [{'id': n['NodeID'], 'alive': n['Alive'], 'resources': n['Resources']} for n in ray.nodes()]; "
            "reps = [{'name': a.class_name, 'node': a.node_id, 'state': a.state} for a in "
            "list_actors(address=%r, filters=[('state', '=', 'ALIVE')], limit=1000) "
            "if a.class_name.startswith('ServeReplica:')]; "
            "print(json.dumps({'nodes': nodes, 'replicas': reps}))") % (info["address"], info["address"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=120)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return {**info, **json.loads(out.stdout.strip().splitlines()[-1])}


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
            print(f"{n['id'][:12]} {kind:<9} {'alive' if n['alive'] else 'dead':<5} "
                  f"CPU {n['resources'].get('CPU', 0):g}  replicas: {', '.join(r['name'] for r in here) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
