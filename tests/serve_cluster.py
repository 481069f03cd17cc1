"""A real local Ray cluster with the Tandem Serve app on it, for end-to-end test modules.

One cluster per test module (starting one costs ~10-15 s on the 2-core dev machine). Everything it starts is
torn down on exit, also when startup fails half-way: serve.shutdown(), ray.shutdown(), then its own temp dir.
Never `ray stop` or pkill: other Ray clusters may run on the same machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ENGINE_DEPLOYMENT = "EngineReplica"


@dataclass
class ServeCluster:
    app_name: str
    port: int
    temp_dir: str = ""
    metrics_port: int | None = None  # Ray's Prometheus export port, when asked for
    engine_deployment: str = ENGINE_DEPLOYMENT  # the deployment whose replicas hold the engines

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def deployment_status(self, deployment: str | None = None):
        """`deployment`'s Serve status; by default the deployment holding the engines."""
        from ray import serve

        return serve.status().applications[self.app_name].deployments[deployment or self.engine_deployment]

    def running_replicas(self, deployment: str | None = None) -> int:
        states = self.deployment_status(deployment).replica_states
        return sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")

    def engine_replica_actors(self) -> list:
        """Handles to the live EngineReplica actors (Serve names them SERVE_REPLICA::<app>#<deployment>#<id>
        in the "serve" namespace)."""
        import ray

        prefix = f"SERVE_REPLICA::{self.app_name}#{self.engine_deployment}#"
        handles = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == "serve" and entry["name"].startswith(prefix):
                with contextlib.suppress(ValueError):  # it died between the listing and the lookup
                    handles.append(ray.get_actor(entry["name"], namespace="serve"))
        return handles


_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port that is free now and that the kernel will not hand out meanwhile.

    Ports come from below the kernel's ephemeral range. A port taken from inside it (bind to port 0) is free
    when chosen, but until Ray binds it the kernel may give it to any outgoing connection as its source port,
    and Ray's own processes open many (CI lost a whole module to "dashboard ... address already in use").
    Ray's worker ports (10002-19999 unless set) are left out too: `ray start` refuses a port inside them.
    Each pytest-xdist worker draws from its own share of the range: `_handed_out` is one process's, and CI once lost
    test_metrics_e2e.py's cluster to a dashboard port that was free when drawn and taken before Ray bound it."""
    start, lo = 20000, _ephemeral_start()  # Ray's workers take 10002-19999 by default
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    if workers > 1 and lo - start >= 1000 * workers:
        share = (lo - start) // workers
        start, lo = start + worker * share, start + (worker + 1) * share
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(start, max(lo, start + 1000))
        if port in _handed_out:  # not bound yet by whoever got it: a second caller must not get it too
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))  # the wildcard: taken on any address means taken
            except OSError:
                continue  # in use: try another
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{start}, {lo})")


def wait_for(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.5,
             what: str = "condition") -> object:
    """Poll `predicate` until it returns something truthy; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - transient while the cluster changes; reported on timeout
            last_exc = exc
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}"
                         + (f" (last error: {last_exc!r})" if last_exc else ""))


async def give_up_once_running(cluster, body: dict, running: Callable[[], bool]) -> None:
    """POST `body` (not streamed) and cancel the call once `running()` says the engine runs a request: the client
    leaves."""
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as client:
        call = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.to_thread(wait_for, lambda: call.done() or running(), 60, 0.02,
                                what="the engine to run the request")  # (raises when it never does)
        assert not call.done(), f"the 1000-token response came back before the client could leave: {call.result()}"
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call


def start_serve(port: int, **options) -> int:
    """serve.start on loopback `port`; the port Serve's HTTP proxy listens on.

    serve.start gives the new proxy a fixed 60 s (Ray's HTTP_PROXY_TIMEOUT) to come up. On the 2-core CI VM
    beside another module's cluster that once ran out (8 errors in test_lora_serve.py, whose module passed on
    its own): shut that Serve instance down and start a fresh controller and proxy, once, on a fresh port."""
    from ray import serve

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, **options)
        return port
    except TimeoutError as exc:
        if "not available" not in str(exc):
            raise
        print(f"serve.start: {exc} Starting Serve again.", file=sys.stderr)
        serve.shutdown()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, **options)
    return port


@contextlib.contextmanager
def serve_cluster(app_args: dict, num_cpus: int = 8, metrics: bool = False) -> Iterator[ServeCluster]:
    """Start a private Ray cluster, Serve on a free loopback port, and build_app(app_args) at route "/".

    metrics=True also exports Ray's metrics on a free port and starts the Ray dashboard (on loopback),
    which is what writes the session's Prometheus and Grafana configs."""
    os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 turns token auth on by default
    import ray
    from ray import serve

    from serve_app import build_app
    from serve_app.builder import COLOCATED_DEPLOYMENT, app_is_colocated, apply_cluster_env

    apply_cluster_env()  # the cluster scripts/serve.sh starts: Serve's proxy on gRPC

    temp_dir = tempfile.mkdtemp(prefix="tdr", dir="/tmp")  # short: Ray puts unix sockets under it
    cluster = ServeCluster(app_name=f"tandem{uuid.uuid4().hex[:6]}", port=free_port(), temp_dir=temp_dir,
                           metrics_port=free_port() if metrics else None)
    extra = dict(_metrics_export_port=cluster.metrics_port, include_dashboard=True, dashboard_host="127.0.0.1",
                 dashboard_port=free_port()) if metrics else dict(include_dashboard=False)
    try:
        for attempt in (1, 2, 3):
            try:
                ray.init(num_cpus=num_cpus, _temp_dir=temp_dir, namespace=f"tandem-test-{uuid.uuid4().hex[:8]}",
                         log_to_driver=False, **extra)
                break
            except Exception as exc:  # noqa: BLE001
                # Ray waits a fixed 30 s for its own raylet to register. On a 2-core CI VM that is also starting
                # another test file's two-node cluster it once ran out (8 errors in test_metrics_e2e.py, which
                # passed on its own right after): try again, then the error. Likewise a port drawn free that
                # something else bound before Ray did ("already occupied"): again, on fresh ports.
                retry = "timed out during startup" in str(exc) or "already occupied" in str(exc)
                if attempt == 3 or not retry:
                    raise
                ray.shutdown()
                if metrics and "already occupied" in str(exc):
                    cluster.metrics_port = free_port()
                    extra.update(_metrics_export_port=cluster.metrics_port, dashboard_port=free_port())
        if app_is_colocated(app_args):  # as build_app resolves it, device "auto" included (Ray is up)
            cluster.engine_deployment = COLOCATED_DEPLOYMENT
        cluster.port = start_serve(cluster.port)
        serve.run(build_app(app_args), name=cluster.app_name, route_prefix="/")
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            if ray.is_initialized():
                serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
