"""What the service costs while nobody is calling it, against vLLM's own server, in one run.

On a laptop (the one-command setup) the service is idle most of the time, and on a small host whatever its
processes do between requests takes CPU from the engine's compute when requests come. Both servers serve the
tiny model of load/bench_capacity.py, start at once, answer one request each (so every lazy path has run),
settle, and then their whole process trees are read from /proc over the same windows: CPU seconds per second
(cores) by role, and the busiest processes by name. Nothing in either server is instrumented.

    python -m load.bench_idle --json load/results/idle.json
    python -m load.bench_idle --controller-set RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.1   # Serve's own default
    python -m load.bench_idle --launcher serve          # `serve run`: Ray's dashboard, idle workers, task events
    python -m load.bench_idle --ingress-set response_store_placement=deployment   # the ResponseStore replica
    python -m load.bench_idle --launcher single_process --front listen --engine-placement ingress   # no Ray
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time

import psutil
import yaml

from load import provenance
from load.bench_capacity import (CpuMeter, add_front_arg, add_launcher_arg, check_launcher, free_port, start_ours,
                                 start_vllm, stop, wait_healthy)


def process_titles(root_pid: int) -> dict[int, str]:
    out = {}
    for p in [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]:
        try:
            out[p.pid] = (" ".join(p.cmdline()) or p.name())[:60]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="length of one measured window")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--settle", type=float, default=20.0, help="seconds after the first answers before measuring")
    ap.add_argument("--engine-placement", choices=("deployment", "ingress"), default="deployment")
    ap.add_argument("--controller-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a variable of the controller's env_vars (the shipped config of --front)")
    ap.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for `serve run` (reaches every Ray process it starts)")
    ap.add_argument("--ingress-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override an ingress setting (YAML value), e.g. response_store_placement=deployment")
    add_front_arg(ap)
    add_launcher_arg(ap)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    check_launcher(ap, a)

    from load.tiny_model import ensure_tiny_model

    model_path = ensure_tiny_model()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log = open(tempfile.mkstemp(prefix="bench_idle_", suffix=".log")[1], "w")
    ports = {"ours": free_port(), "vllm": free_port()}
    controller = dict(kv.split("=", 1) for kv in a.controller_set)
    ingress_set = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in a.ingress_set)}
    t0 = time.monotonic()
    procs = {"ours": start_ours(ports["ours"], model_path, 1, log, dict(kv.split("=", 1) for kv in a.serve_env),
                                engine_placement=a.engine_placement, ingress_set=ingress_set,
                                controller_set=controller, front=a.front, launcher=a.launcher),
             "vllm": start_vllm(ports["vllm"], model_path, log)}
    try:
        ready = {}
        for n in ("ours", "vllm"):
            wait_healthy(f"http://127.0.0.1:{ports[n]}", procs[n])
            ready[n] = time.monotonic() - t0
        time.sleep(a.settle)
        meters = {n: CpuMeter(procs[n].pid, n) for n in procs}
        roles = {n: {} for n in procs}
        per_pid = {n: {} for n in procs}
        wall = 0.0
        for w in range(a.windows):
            before = {n: meters[n].snapshot() for n in procs}
            w0 = time.monotonic()
            time.sleep(a.seconds)
            wall += time.monotonic() - w0
            for n in procs:
                after = meters[n].snapshot()  # one read of the tree per window: by role and by process
                for k, v in CpuMeter.delta(before[n], after).items():
                    roles[n][k] = roles[n].get(k, 0.0) + v
                titles = process_titles(procs[n].pid)
                for pid, (_, cpu) in after.items():
                    name = titles.get(pid, str(pid))
                    per_pid[n][name] = per_pid[n].get(name, 0.0) + cpu - before[n].get(pid, (None, cpu))[1]
            print(f"window {w}: ours {sum(roles['ours'].values()) / wall:.3f} cores, "
                  f"vllm {sum(roles['vllm'].values()) / wall:.3f} cores", flush=True)
        out = {
            **provenance.header("load.bench_idle", sys.argv[1:]),
            "engine_placement": a.engine_placement,
            "front": a.front,
            "launcher": a.launcher,
            "controller_set": controller,
            "ingress_set": ingress_set,
            "serve_env": a.serve_env,
            "measured_s": round(wall, 1),
            "ready_s": {n: round(v, 1) for n, v in ready.items()},
            "servers": {},
        }
        for n in procs:
            out["servers"][n] = {
                "cores": round(sum(roles[n].values()) / wall, 4),
                "cores_by_role": {k: round(v / wall, 4) for k, v in sorted(roles[n].items(), key=lambda kv: -kv[1])},
                "busiest_processes": {k: round(v / wall, 4) for k, v in
                                      sorted(per_pid[n].items(), key=lambda kv: -kv[1])[:20]},
            }
        out["ratio_cores"] = out["servers"]["ours"]["cores"] / max(out["servers"]["vllm"]["cores"], 1e-9)
        print(json.dumps(out, indent=2))
        if a.json:
            provenance.write(a.json, out)
    finally:
        stop(list(procs.values()))


if __name__ == "__main__":
    main()
