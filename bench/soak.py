#!/usr/bin/env python3
"""Soak: minutes of mixed traffic against a real Serve app, with client disconnects, bad requests and one
engine replica killed half-way; reports what was served, errors by kind, KV blocks leaked and replica RSS.

    RAY_AUTH_MODE=disabled python bench/soak.py --minutes 10 --json bench/results/soak_cpu.json
    RAY_AUTH_MODE=disabled python bench/soak.py --device sim --core-process --kill core --clients 32 \
        --json bench/results/soak_sim_core.json

Starts its own Ray cluster (own temp dir, loopback only) and a 2-replica app with an API key. `--clients`
threads each loop until the deadline: a normal request (streamed or not, chat or completion, greedy or
sampled, 8-96 tokens), of which `--disconnect` leave early (a stream after a few events, a whole response
after a short read timeout), or with chance `--bad` a bad request from BAD (each has the status it must
get). At half time one EngineReplica actor is killed (ray.kill, as a crash would), or with `--kill core` the
engine core process of one replica (SIGKILL; with `--core-process`, engine/core_proc.py); Serve replaces the
replica. `--device sim` serves the SIMULATED H100 (Qwen2.5-0.5B shape): GPU-rate steps, so the host runs at
the load a GPU would put on it. Core processes count in the RSS check.

Pass/fail lines at the end (exit 1 on a failure): no 5xx or stream error outside the kill's window (the
requests in flight on the killed replica fail with replica_died, nothing else), every bad request got its
status and an OpenAI error body, /health was 200 throughout except while no replica ran, both replicas back,
0 KV blocks held once idle, and replica RSS flat (growth between the sample after warm-up and the last one
within --rss-slack-mb). Not part of CI: it is a timed soak.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import ray
from ray import serve

from bench_serve import SIM_MODEL, actor_pids, core_pids, free_port, machine  # bench/ is this script's directory
from serve_app import build_app
from serve_app.builder import apply_cluster_env

APP = "tandem_soak"
KEY = "soak-key-1"
MODEL = "tandem-default"
ENGINE = "EngineReplica"
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain paged attention in one paragraph.",
           "List five prime numbers and why they are prime.", "def fibonacci(n):", "The history of Rome",
           "Translate to French: good morning, how are you?", "A haiku about GPUs:", "Once upon a time"]
# (name, method, path, body or raw bytes, headers override, status it must get)
BAD = [
    ("no_key", "/v1/completions", {"model": MODEL, "prompt": "x"}, {}, 401),
    ("wrong_key", "/v1/completions", {"model": MODEL, "prompt": "x"}, {"Authorization": "Bearer nope"}, 401),
    ("unknown_model", "/v1/completions", {"model": "nope", "prompt": "x"}, None, 404),
    ("bad_temperature", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, None, 400),
    ("max_tokens_past_context", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, None, 400),
    ("too_many_stops", "/v1/completions", {"model": MODEL, "prompt": "x", "stop": [f"s{i}" for i in range(100)]},
     None, 400),
    ("bad_regex", "/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "(unclosed"}, None, 400),
    ("tools", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, None, 400),
    ("malformed_json", "/v1/completions", b'{"model": "tandem-default", "prompt": ', None, 400),
    ("oversized_body", "/v1/completions", b'{"prompt": "' + b"x" * (9 * 1024**2) + b'"}', None, 413),
    ("wrong_type", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "lots"}, None, 400),
]
AUTH = {"Authorization": f"Bearer {KEY}"}


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.failures: list[dict] = []  # every 5xx / stream error / wrong status, with its time
        self.tokens = 0

    def add(self, kind: str, tokens: int = 0) -> None:
        with self.lock:
            self.counts[kind] += 1
            self.tokens += tokens

    def fail(self, kind: str, detail: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            self.failures.append({"t": time.monotonic(), "kind": kind, "detail": detail[:300]})


def normal_request(client: httpx.Client, rng: random.Random, tally: Tally, disconnect: bool) -> None:
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    body = {"model": MODEL, "max_tokens": rng.randint(8, 96),
            "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 10**6)}
    prompt = rng.choice(PROMPTS)
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    if stream:
        body["stream"] = True
        stop_after = rng.randint(1, 6) if disconnect else None
        events, done, errors, finish = 0, False, [], None
        with client.stream("POST", path, json=body, headers=AUTH) as r:
            if r.status_code != 200:
                return tally.fail(f"stream_status_{r.status_code}", r.read().decode(errors="replace"))
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                for c in event.get("choices", []):
                    finish = c.get("finish_reason") or finish
                events += 1
                if stop_after is not None and events >= stop_after:
                    return tally.add("disconnect_stream")
        if errors:
            return tally.fail("stream_error_event", json.dumps(errors[0]))
        if not done or finish not in ("length", "stop"):
            return tally.fail("stream_incomplete", f"done={done} finish={finish}")
        return tally.add("ok_stream", events)
    if disconnect:
        try:
            client.post(path, json=body, headers=AUTH, timeout=httpx.Timeout(60, read=rng.uniform(0.05, 0.5)))
        except httpx.ReadTimeout:
            return tally.add("disconnect_whole")
        return tally.add("ok_before_disconnect")
    r = client.post(path, json=body, headers=AUTH)
    if r.status_code != 200:
        return tally.fail(f"status_{r.status_code}", r.text)
    out = r.json()
    if out["choices"][0]["finish_reason"] not in ("length", "stop"):
        return tally.fail("bad_finish", r.text)
    tally.add("ok_whole", out["usage"]["completion_tokens"])


def bad_request(client: httpx.Client, rng: random.Random, tally: Tally) -> None:
    name, path, body, headers, want = rng.choice(BAD)
    headers = AUTH if headers is None else headers
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        r = client.post(path, json=body, headers=headers)
    try:
        error = r.json().get("error", {})
    except ValueError:
        error = {}
    if r.status_code != want or not {"message", "type", "code"} <= set(error):
        return tally.fail(f"bad_{name}_got_{r.status_code}", r.text)
    tally.add(f"rejected_{name}")


def client_loop(base_url: str, seed: int, deadline: float, args, tally: Tally) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base_url, timeout=120) as client:
        while time.monotonic() < deadline:
            try:
                if rng.random() < args.bad:
                    bad_request(client, rng, tally)
                else:
                    normal_request(client, rng, tally, disconnect=rng.random() < args.disconnect)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                tally.fail(f"client_{type(exc).__name__}", repr(exc))


def engine_actors() -> list[str]:
    """Names of the app's live EngineReplica actors."""
    prefix = f"SERVE_REPLICA::{APP}#{ENGINE}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(prefix))


def engine_rss_mb() -> dict[int, float]:
    """pid -> resident MB of every engine replica process and engine core process."""
    out = {}
    for pid in actor_pids(f"ServeReplica:{APP}:{ENGINE}") + core_pids():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue  # gone meanwhile
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
        if kb is not None:
            out[pid] = kb / 1024
    return out


def watcher(base_url: str, stop: threading.Event, samples: list, health: list, period_s: float) -> None:
    while not stop.wait(period_s):
        t = time.monotonic()
        try:
            code = httpx.get(base_url + "/health", timeout=10).status_code
        except httpx.HTTPError:
            code = 0
        health.append((t, code))
        for pid, mb in engine_rss_mb().items():
            samples.append((t, pid, mb))


def running_replicas() -> int:
    states = serve.status().applications[APP].deployments[ENGINE].replica_states
    return sum(n for s, n in states.items() if str(getattr(s, "value", s)) == "RUNNING")


def wait_idle(timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        names = list(engine_actors())
        stats = ray.get([ray.get_actor(n, namespace="serve").record_routing_stats.remote() for n in names])
        idle = all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
                   for s in stats)
        if idle or time.monotonic() > deadline:
            return [{"replica": n.rsplit("#", 1)[-1], **{k: s[k] for k in ("num_running", "num_waiting",
                     "kv_blocks_free", "kv_blocks_total")}} for n, s in zip(names, stats)]
        time.sleep(1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--disconnect", type=float, default=0.15, help="share of normal requests left early")
    p.add_argument("--bad", type=float, default=0.15, help="share of requests that are bad")
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS baseline is taken after this")
    p.add_argument("--rss-slack-mb", type=float, default=64.0)
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--kill", choices=["replica", "core"], default="replica",
                   help="at half time kill a replica actor, or one replica's engine core process")
    p.add_argument("--device", choices=["cpu", "sim"], default="cpu")
    p.add_argument("--core-process", action="store_true", help="engine_core_process: true (auto keeps the "
                                                                  "core on a replica thread on cpu and sim)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    apply_cluster_env()  # the cluster scripts/serve.sh starts

    temp_dir = tempfile.mkdtemp(prefix="tds")
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=temp_dir, namespace="soak", logging_level="ERROR",
             log_to_driver=False)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = {"num_replicas": 2, "api_key": KEY, "device": args.device, "max_queued_requests": 256}
    if args.device == "sim":
        app.update(model=os.path.normpath(os.path.join(SIM_MODEL, "qwen2.5-0.5b")), sim_gpu="h100",
                   served_model_name=MODEL,
                   engine={"max_model_len": 2048})
    if args.core_process:
        app["engine_core_process"] = True
    serve.run(build_app(app), name=APP, route_prefix="/")
    tally, samples, health, stop = Tally(), [], [], threading.Event()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    watch = threading.Thread(target=watcher, args=(base_url, stop, samples, health, 5.0), daemon=True)
    watch.start()
    clients = [threading.Thread(target=client_loop, args=(base_url, args.seed + i, deadline, args, tally))
               for i in range(args.clients)]
    for c in clients:
        c.start()

    kill = {}
    if not args.no_kill:
        time.sleep(max(0.0, start + args.minutes * 30 - time.monotonic()))
        victim = engine_actors()[0]
        if args.kill == "core":
            core = core_pids()[0]
            kill = {"core_pid": core, "t": time.monotonic()}
            os.kill(core, signal.SIGKILL)
            before = set(engine_actors())
            while time.monotonic() < deadline and not (running_replicas() == 2 and len(engine_actors()) == 2
                                                        and set(engine_actors()) != before
                                                        and len(core_pids()) == 2 and core not in core_pids()):
                time.sleep(0.5)
        else:
            kill = {"replica": victim.rsplit("#", 1)[-1], "t": time.monotonic()}
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            while time.monotonic() < deadline and not (running_replicas() == 2 and len(engine_actors()) == 2
                                                        and victim not in engine_actors()):
                time.sleep(0.5)
        kill["recovered_s"] = round(time.monotonic() - kill["t"], 1)
    for c in clients:
        c.join()
    stop.set()
    watch.join()
    wall = time.monotonic() - start
    idle = wait_idle(60)
    final_health = httpx.get(base_url + "/health", timeout=10).status_code
    serve.shutdown()
    ray.shutdown()
    logs = replica_log_faults(temp_dir)
    return report(args, app, tally, samples, health, kill, idle, final_health, wall, start, logs)


def replica_log_faults(temp_dir: str) -> dict[str, int]:
    """Tracebacks and ERROR lines in the Serve replicas' logs (ingress and engine), by deployment."""
    out: collections.Counter = collections.Counter()
    for path in Path(temp_dir).glob("session_*/logs/serve/replica_*.log"):
        deployment = "ingress" if "OpenAIIngress" in path.name else "engine"
        text = path.read_text(errors="replace")
        out[f"{deployment} tracebacks"] += text.count("Traceback (most recent call last)")
        out[f"{deployment} ERROR lines"] += sum(" ERROR " in line for line in text.splitlines())
    return dict(out)


def report(args, app, tally: Tally, samples, health, kill, idle, final_health, wall, start, logs) -> int:
    window = (kill["t"] - 1, kill["t"] + kill["recovered_s"] + 5) if kill else None
    in_window = [f for f in tally.failures if window and window[0] <= f["t"] <= window[1]]
    outside = [f for f in tally.failures if f not in in_window]
    in_window_not_died = [f for f in in_window if "replica" not in f["detail"] and "died" not in f["detail"]]
    rss: dict[str, list] = collections.defaultdict(list)
    for t, pid, mb in samples:
        rss[f"pid {pid}"].append((t, mb))
    rss_rows = {}
    for replica, series in rss.items():
        settled = [mb for t, mb in series if t - series[0][0] >= args.warmup_s] or [series[-1][1]]
        rss_rows[replica] = {"first_mb": round(series[0][1]), "after_warmup_mb": round(settled[0]),
                             "last_mb": round(series[-1][1]), "growth_mb": round(series[-1][1] - settled[0]),
                             "span_s": round(series[-1][0] - series[0][0])}
    bad_health = [(round(t - start), code) for t, code in health if code != 200]
    served = sum(v for k, v in tally.counts.items() if k.startswith("ok_"))
    checks = {
        "no 5xx / stream error outside the kill window": not outside,
        "failures in the kill window are replica deaths": not in_window_not_died,
        "every bad request got its status and an OpenAI error body": not any(
            f["kind"].startswith("bad_") for f in tally.failures),
        "/health 200 at the end": final_health == 200,
        "no traceback in the replica logs": not any(n for k, n in logs.items() if "traceback" in k),
        "both replicas back after the kill": not kill or len(idle) == 2,
        "0 KV blocks held once idle": all(r["kv_blocks_free"] == r["kv_blocks_total"] for r in idle),
        f"replica RSS flat (growth <= {args.rss_slack_mb:g} MB after warm-up)": all(
            r["growth_mb"] <= args.rss_slack_mb for r in rss_rows.values() if r["span_s"] >= 2 * args.warmup_s),
    }
    result = {"machine": machine(), "args": vars(args), "app": app, "wall_s": round(wall, 1),
              "served_ok": served, "tokens_streamed_or_returned": tally.tokens, "counts": dict(tally.counts),
              "kill": kill, "failures_in_kill_window": len(in_window), "failures_outside": outside[:20],
              "health_not_200": bad_health, "replica_logs": logs, "idle": idle, "rss": rss_rows, "checks": checks}
    print(f"machine: {result['machine']}")
    engine = "CPU, embedded model" if args.device == "cpu" else "SIMULATED h100, Qwen2.5-0.5B shape"
    core = ", core process" if args.core_process else ""
    print(f"soak: {wall / 60:.1f} min, {args.clients} clients, 2 replicas ({engine}{core}), "
          f"disconnect {args.disconnect:.0%} of normal requests, {args.bad:.0%} bad")
    print(f"served ok: {served} requests ({tally.tokens} tokens/events)")
    for kind, n in sorted(tally.counts.items()):
        print(f"  {kind:40s} {n}")
    if kill:
        what = f"replica {kill['replica']}" if "replica" in kill else f"core process {kill['core_pid']}"
        print(f"killed {what} at {kill['t'] - start:.0f} s; both replicas running again after "
              f"{kill['recovered_s']} s; {len(in_window)} requests failed in its window")
    print(f"/health not 200 at (s, status): {bad_health or 'never'}; at the end: {final_health}")
    print("replica logs: " + ", ".join(f"{k} {n}" for k, n in sorted(logs.items())))
    print("KV once idle: " + ", ".join(f"{r['replica']}: {r['kv_blocks_total'] - r['kv_blocks_free']} blocks held "
                                       f"of {r['kv_blocks_total']}" for r in idle))
    for replica, r in rss_rows.items():
        print(f"RSS {replica}: first {r['first_mb']} MB, after warm-up {r['after_warmup_mb']} MB, "
              f"last {r['last_mb']} MB (growth {r['growth_mb']:+d} MB over {r['span_s']} s)")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for f in outside[:10]:
        print(f"  outside the window: {f['kind']}: {f['detail']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
