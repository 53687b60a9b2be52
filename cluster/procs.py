"""Process helpers for cluster/start.sh and cluster/stop.sh, with psutil (Ray ships it).

    python cluster/procs.py listeners PORT...   one line naming whoever listens on those ports;
                                                exit 3 if any (start.sh refuses to start)
    python cluster/procs.py record FILE ID GCS_PORT DASHBOARD_URL
                                                record the processes carrying
                                                RAYTORCH_CLUSTER_ID=ID in FILE (mode 600);
                                                exit 1 if there are none
    python cluster/procs.py alive STATE         exit 0 if a recorded process still runs
    python cluster/procs.py stop STATE GRACE    stop exactly the recorded cluster; exit 1 if
                                                something survives
    python cluster/procs.py report              print the Ray GCS servers and Serve HAProxies
                                                running (stops nothing)

Standard library and psutil only: it runs with the project's Python before anything else is
imported, and never imports Ray itself.
"""

import contextlib
import importlib.util
import os
import socket
import sys
import time

try:
    import psutil
except ImportError:  # use the copy inside Ray's package
    spec = importlib.util.find_spec("ray")
    if spec and spec.submodule_search_locations:
        sys.path.insert(
            0, os.path.join(list(spec.submodule_search_locations)[0], "thirdparty_files")
        )
    try:
        import psutil
    except ImportError:
        psutil = None


# --- start.sh ----------------------------------------------------------------------------------


def listeners(ports):
    held = {}  # pid (None: unknown) -> ports it listens on
    try:
        conns = psutil.net_connections("tcp") if psutil else None
    except psutil.AccessDenied:  # e.g. macOS without root
        conns = None
    if conns is not None:
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports:
                held.setdefault(c.pid, set()).add(c.laddr.port)
    else:
        for port in ports:
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    held.setdefault(None, set()).add(port)
    if not held:
        return 0
    parts, pids = [], []
    for pid, taken in held.items():
        taken = sorted(taken)
        what = (
            f"port {taken[0]} is" if len(taken) == 1 else f"ports {', '.join(map(str, taken))} are"
        )
        what += " in use by "
        if pid is None:
            what += f"a process this user cannot see (find it with: lsof -i :{taken[0]})"
        else:
            pids.append(str(pid))
            try:
                p = psutil.Process(pid)
                name, ppid = os.path.basename((p.cmdline() or [p.name()])[0]), p.ppid()
            except psutil.Error:
                name, ppid = "?", "?"
            what += f"pid {pid} ({name}, parent pid {ppid}"
            if "haproxy" in name and ppid == 1:
                what += ": a Serve HAProxy left over from a cluster that died"
            what += ")"
        parts.append(what)
    fix = f"'make cluster-down' or 'kill {' '.join(pids)}'" if pids else "'make cluster-down'"
    print(f"cannot start: {'; '.join(parts)}; run {fix}, then run this again")
    return 3


def record(path, cluster_id, gcs_port, dashboard_url):
    found, info = [], {"NODE_ID": "", "SESSION_NAME": "", "SESSION_DIR": ""}
    flags = {
        "--node_id": "NODE_ID",
        "--node-id": "NODE_ID",
        "--session-name": "SESSION_NAME",
        "--session_dir": "SESSION_DIR",
        "--session-dir": "SESSION_DIR",
    }
    for p in psutil.process_iter(["pid", "cmdline", "environ", "create_time"], ad_value=None):
        if (p.info["environ"] or {}).get("RAYTORCH_CLUSTER_ID") != cluster_id:
            continue
        found.append(f"{p.info['pid']}:{p.info['create_time']!r}")
        for arg in p.info["cmdline"] or []:
            key, _, value = arg.partition("=")
            if key in flags and value:
                info[flags[key]] = value
    if not found:
        return 1
    lines = [
        "# Written by cluster/start.sh for cluster/stop.sh, which stops exactly this cluster:",
        "# the processes carrying RAYTORCH_CLUSTER_ID, these PIDS (pid:start time), and the Serve",
        "# HAProxy whose config lives under NODE_ID.",
        f"CLUSTER_ID={cluster_id}",
        f"GCS_PORT={gcs_port}",
        f"DASHBOARD_URL={dashboard_url}",
        *(f"{k}={v}" for k, v in info.items()),
        f"STARTED={time.strftime('%Y-%m-%dT%H:%M:%S%z')}",
        f"PIDS={' '.join(found)}",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
    print(
        f"cluster/start.sh: recorded the cluster's {len(found)} processes in {path}",
        file=sys.stderr,
    )
    return 0


# --- stop.sh -----------------------------------------------------------------------------------


def log(msg):
    print(f"cluster/stop.sh: {msg}", file=sys.stderr)


def read_state(path):
    state = {}
    with open(path) as f:
        for line in f:
            key, eq, value = line.strip().partition("=")
            if eq and not key.startswith("#"):
                state[key] = value
    return state


def recorded(state):
    """The recorded processes still running: same pid *and* same start time."""
    out = []
    for item in state.get("PIDS", "").split():
        pid, _, started = item.partition(":")
        try:
            p = psutil.Process(int(pid))
            if abs(p.create_time() - float(started)) < 1.0:
                out.append(p)
        except (ValueError, psutil.Error):
            pass
    return out


def belongs(info, state):
    cmd, env = info["cmdline"] or [], info["environ"] or {}
    cid, node, session, sdir = (
        state.get(k, "") for k in ("CLUSTER_ID", "NODE_ID", "SESSION_NAME", "SESSION_DIR")
    )
    if cid and env.get("RAYTORCH_CLUSTER_ID") == cid:
        return True
    flags = set()
    if session:
        flags |= {f"--session-name={session}", f"--session_name={session}"}
    if sdir:
        flags |= {f"--session-dir={sdir}", f"--session_dir={sdir}"}
    if flags & set(cmd):
        return True
    # Serve's HAProxy: <haproxy binary> ... -f <base>/<node id>/haproxy.cfg
    return bool(
        node
        and cmd
        and "haproxy" in os.path.basename(cmd[0])
        and any(f"/{node}/" in a for a in cmd)
    )


def running(procs):
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.Error:
            pass
    return left


def wait_gone(procs, timeout_s):
    deadline = time.monotonic() + timeout_s
    while (left := running(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def signal_all(procs, how):
    for p in procs:
        with contextlib.suppress(psutil.Error):
            getattr(p, how)()  # psutil re-checks the pid's start time first


def stop(path, grace_s):
    state = read_state(path)
    me = {os.getpid()} | {p.pid for p in psutil.Process().parents()}
    found = {p.pid: p for p in recorded(state)}
    for p in psutil.process_iter(["pid", "cmdline", "environ"], ad_value=None):
        if p.pid not in found and belongs(p.info, state):
            found[p.pid] = p
    for p in list(found.values()):
        with contextlib.suppress(psutil.Error):
            found.update({c.pid: c for c in p.children(recursive=True)})
    procs = running([p for pid, p in sorted(found.items()) if pid not in me])
    if not procs:
        log(f"nothing left running of the cluster recorded in {path}")
        return 0
    pids = " ".join(str(p.pid) for p in procs)
    log(
        f"stopping the cluster started {state.get('STARTED', '?')}: {len(procs)} processes ({pids})"
    )
    # In `ray stop`'s order: the raylet first (its agents fate-share with it), the GCS last.
    order = {"raylet": 0, "gcs_server": 2}
    buckets = [[], [], []]
    for p in procs:
        try:
            name = os.path.basename((p.cmdline() or [""])[0])
        except psutil.Error:
            name = ""
        buckets[order.get(name, 1)].append(p)
    survivors = []
    for bucket in filter(None, buckets):
        signal_all(bucket, "terminate")
        left = wait_gone(bucket, grace_s)
        if left:
            log(
                f"still running after SIGTERM and {grace_s:g}s, so SIGKILL: {' '.join(str(p.pid) for p in left)}"
            )
            signal_all(left, "kill")
            survivors += wait_gone(left, 5)
    if survivors:
        log(f"could not stop pids {' '.join(str(p.pid) for p in survivors)}")
        return 1
    return 0


def report():
    seen = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline"], ad_value=None):
        cmd = p.info["cmdline"] or []
        base = os.path.basename(cmd[0]) if cmd else ""
        if base == "gcs_server":
            port = next(
                (a.split("=", 1)[1] for a in cmd if a.startswith("--gcs_server_port=")), "?"
            )
            seen.append(f"Ray GCS pid {p.pid} (port {port})")
        elif "haproxy" in base and any("haproxy-serve" in a for a in cmd):
            seen.append(f"Serve HAProxy pid {p.pid} (parent pid {p.info['ppid']})")
    log(
        f"found, and left alone: {'; '.join(seen)}"
        if seen
        else "found no Ray cluster and no Serve HAProxy running"
    )
    return 0


def main(argv):
    mode, args = argv[0], argv[1:]
    if mode == "listeners":
        return listeners({int(a) for a in args})
    if psutil is None:
        sys.exit("cluster/procs.py: psutil not found (it comes with Ray)")
    if mode == "record":
        return record(*args)
    if mode == "alive":
        return 0 if recorded(read_state(args[0])) else 1
    if mode == "stop":
        return stop(args[0], float(args[1]))
    return report()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
