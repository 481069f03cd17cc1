"""Tandem on a real two-node Ray cluster on this one machine: a head (custom resource node_a) and a worker
(node_b), each started with the venv's `ray start --block` as a subprocess, exactly as docs/serving.md "Multi-node"
tells an operator to. The engine deployment runs 2 replicas with max_replicas_per_node=1, so one replica per
node; the test driver joins with ray.init(address=...) and deploys with serve.run(build_app(...)).

Then the worker node is killed (SIGKILL of its `ray start` process, its raylet and every descendant: the
engine replica's worker process among them) while streams are in flight on both replicas. Every stream must
end within a bound: those on the dead node with an error the openai client raises, the others complete. New
requests must then succeed on the head's replica within ~90 s, with the same greedy text as before.

Last, a second app on the same cluster (route /pp): one pipeline-parallel replica whose two stage actors run
on different nodes (SPREAD; see PP_APP for why that is deterministic here), checked against the first app's
greedy text, then the worker is killed under its streams and a replacement stage group on the head serves.

Isolation: the cluster has its own temp dir (the worker shares it: a worker node on the same machine takes
the head's temp dir when it is given none), its own GCS/HTTP/client/dashboard/agent ports, and teardown
kills exactly the process trees of the two `ray start` processes it started (plus any process whose command
line names its temp dir), never `ray stop`: other tests' in-process clusters may run beside it. The state
API (ray.util.state) needs the dashboard, which this cluster does not run; replica placement is read from
the GCS actor table instead (ray._private.state.actors)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from serve_cluster import ENGINE_DEPLOYMENT, free_port, start_serve, wait_for

RAY_CLI = Path(sys.executable).with_name("ray")  # the venv's CLI: same Ray and Python as the driver
if not RAY_CLI.exists():
    pytest.skip(f"no ray CLI next to {sys.executable}", allow_module_level=True)

import openai  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from serve_app import build_app  # noqa: E402
from serve_app.builder import CLUSTER_ENV  # noqa: E402

# The ingress asks for a sliver of node_a, so it lives on the head beside the only HTTP proxy (HeadOnly):
# losing the worker node then costs exactly its engine replica, and what the client sees is Tandem's
# error event, not a cut connection. (Left to Serve, the ingress lands on either node.)
APP = {"num_replicas": 2, "max_replicas_per_node": 1, "ingress_resources": {"node_a": 0.01}, "router": "pow2",
       "health_check_period_s": 1.0, "health_check_timeout_s": 10.0, "graceful_shutdown_timeout_s": 5.0}
MODEL = "tandem-default"
PROMPT = "The history of the river begins"
STREAM_TOKENS = 900  # long enough to be in flight when the node dies (max_model_len is 1024)
START_TIMEOUT_S = 60
STREAM_END_BOUND_S = 60  # after the kill, every stream has ended (error or complete) within this
RECOVERY_BOUND_S = 90


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    log: Path

    def tree(self) -> list[psutil.Process]:
        """The `ray start --block` process and every descendant (gcs, raylet, agents, Ray workers)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        return []


@dataclass
class Cluster:
    gcs_port: int
    http_port: int
    temp_dir: str
    app_name: str
    nodes: dict[str, Node] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # of the `ray start` processes

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def api_url(self) -> str:
        return self.api_at("")

    def api_at(self, route: str) -> str:
        """The OpenAI base URL of the app served under route prefix `route` ("": the module's own app)."""
        return f"http://127.0.0.1:{self.http_port}{route}/v1"

    def node_id(self, resource: str) -> str:
        [node] = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
        return node

    def alive_actors(self, deployment: str, app: str | None = None) -> list[dict]:
        """GCS actor-table entries of the live replicas of `deployment` of `app` (default: the module's app);
        Address.NodeID is their node."""
        return alive_named(f"SERVE_REPLICA::{app or self.app_name}#{deployment}#")

    def replica_handles(self) -> dict[str, object]:
        """{node id: handle} of the live engine replicas."""
        return {a["Address"]["NodeID"]: ray.get_actor(a["Name"], namespace="serve")
                for a in self.alive_actors(ENGINE_DEPLOYMENT)}


def alive_named(prefix: str) -> list[dict]:
    """GCS actor-table entries of the live actors whose name starts with `prefix`."""
    import ray._private.state as state

    return [a for a in state.actors().values() if a["State"] == "ALIVE" and (a.get("Name") or "").startswith(prefix)]


def kill_tree(procs: list[psutil.Process], timeout_s: float = 20) -> None:
    """SIGKILL every process in `procs` at once (no survivor gets to respawn another) and check they are gone."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    assert not alive, f"processes survived SIGKILL: {alive}"


def _ray_start(cluster: Cluster, name: str, args: list[str]) -> Node:
    """`ray start ARGS --block` as a subprocess, registered for teardown before anything can fail; returns
    once it says the node runs (a `ray start` that exits fails at once, with its log)."""
    log = Path(cluster.temp_dir) / f"ray_start_{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(RAY_CLI), "start", *args, "--block"], stdout=out, stderr=subprocess.STDOUT,
                                env=cluster.env, start_new_session=True)  # no terminal signals from pytest
    node = cluster.nodes[name] = Node(name, proc, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"`ray start` of the {name} node exited {proc.returncode} or took over "
                                 f"{START_TIMEOUT_S} s: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    return node


def _agent_ports() -> list[str]:
    """Every port a node would otherwise take at a fixed default (52365, ...) is a free one: the nodes share
    the machine, and so may other tests' clusters."""
    return [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}"]


def start_worker(cluster: Cluster, name: str) -> Node:
    return _ray_start(cluster, name, [
        f"--address={cluster.address}", "--num-cpus=4", '--resources={"node_b": 4}', *_agent_ports()])


def _teardown(cluster: Cluster) -> None:
    with contextlib.suppress(Exception):
        if ray.is_initialized():  # serve.shutdown waits on the controller: bound it (the head may be broken)
            t = threading.Thread(target=serve.shutdown, daemon=True)
            t.start()
            t.join(timeout=30)
    ray.shutdown()
    procs = [p for node in cluster.nodes.values() for p in node.tree()]
    for p in psutil.process_iter(["cmdline"]):  # anything of this cluster that left the two trees
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and any(cluster.temp_dir in arg for arg in p.info["cmdline"] or []):
                procs.append(p)
    try:
        kill_tree(procs)
    finally:
        for node in cluster.nodes.values():
            with contextlib.suppress(Exception):
                node.proc.wait(timeout=5)
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="tdm", dir="/tmp")  # short: Ray puts unix sockets under it
    cluster = Cluster(gcs_port=free_port(), http_port=free_port(), temp_dir=temp_dir,
                      app_name=f"tandem{uuid.uuid4().hex[:6]}")
    # docs/serving.md "Multi-node": every node's `ray start` gets RAY_AUTH_MODE and CLUSTER_ENV (the proxy on gRPC)
    cluster.env = {**os.environ, **CLUSTER_ENV, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the driver too (Ray 2.60 turns token auth on by default)
    try:
        _ray_start(cluster, "head", [
            "--head", f"--port={cluster.gcs_port}", "--node-ip-address=127.0.0.1", "--num-cpus=4",
            '--resources={"node_a": 4}', "--include-dashboard=false", "--disable-usage-stats",
            f"--temp-dir={temp_dir}", f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}",
            *_agent_ports()])
        start_worker(cluster, "worker")
        ray.init(address=cluster.address, namespace=f"tandem-test-{uuid.uuid4().hex[:8]}", log_to_driver=False)
        wait_for(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, 30, what="both nodes alive")
        cluster.http_port = start_serve(cluster.http_port, proxy_location="HeadOnly")
        serve.run(build_app(APP), name=cluster.app_name, route_prefix="/")
        yield cluster
    finally:
        _teardown(cluster)


def client(cluster: Cluster, timeout: float = 30, route: str = "") -> openai.OpenAI:
    """The official client for the app under `route`, no retries of its own; `timeout` bounds connecting and
    each read of a stream."""
    return openai.OpenAI(base_url=cluster.api_at(route), api_key="unused", max_retries=0, timeout=timeout)


def greedy(cluster: Cluster, timeout: float = 30, route: str = "", prompt: str = PROMPT) -> str:
    r = client(cluster, timeout, route).completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                           temperature=0)
    return r.choices[0].text


def start_streams(cluster: Cluster, prompts: list[str], route: str = "") -> tuple[list[dict], list[threading.Thread]]:
    """One thread per prompt streaming a long greedy completion; each fills its dict with chunks, text,
    finish (reason), error (what the client raised) and ended (monotonic time)."""
    results: list[dict] = [{"chunks": 0, "text": "", "finish": None} for _ in prompts]

    def stream(prompt: str, res: dict) -> None:
        try:
            for chunk in client(cluster, STREAM_END_BOUND_S, route).completions.create(
                    model=MODEL, prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}):
                res["chunks"] += 1
                if chunk.choices:
                    res["text"] += chunk.choices[0].text
                    res["finish"] = chunk.choices[0].finish_reason or res["finish"]
        except Exception as exc:  # noqa: BLE001 - recorded; the tests say which streams may fail
            res["error"] = exc
        res["ended"] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(p, r), daemon=True) for p, r in zip(prompts, results)]
    for t in threads:
        t.start()
    return results, threads


def in_flight_on_all(replicas: dict[str, object], results: list[dict]) -> dict[str, int] | None:
    """Streams per replica, once every replica has some and every stream has its first token (after that a
    replica's loss is the client's error, not a silent retry on another replica).

    The first tokens are checked before the replicas are asked: a stream with its first token is on its replica
    for good, so the counts that follow are exact. Counted first, a stream routed just after its replica was
    asked and answering before the token check would go uncounted. (A local run once counted 1 stream on the
    killed node and saw 3 fail; this race is the one explanation found, not a proven one.)"""
    if not results or not all(r["chunks"] for r in results):
        return None
    counts = {node: ray.get(h.get_num_ongoing_requests.remote(), timeout=10) for node, h in replicas.items()}
    return counts if all(counts.values()) else None


def join(threads: list[threading.Thread], deadline: float) -> None:
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "streams still open past their bound"


def test_the_placement_keys_reach_serve():
    """max_replicas_per_node and ingress_resources are passed to Serve as given, and absent when not given
    (Serve's scheduler spreads replicas by default, so the placement test alone could pass without them)."""
    def deployments(app):
        ingress = app._bound_deployment
        return ingress, ingress.init_args[0]._bound_deployment

    ingress, engine = deployments(build_app(APP))
    assert engine.name == ENGINE_DEPLOYMENT and engine._replica_config.max_replicas_per_node == 1
    assert ingress._replica_config.max_replicas_per_node is None
    assert ingress.ray_actor_options["resources"] == {"node_a": 0.01} and "resources" not in engine.ray_actor_options
    ingress, engine = deployments(build_app({"colocated": False}))
    assert engine._replica_config.max_replicas_per_node is None and "resources" not in ingress.ray_actor_options


def test_the_engine_replicas_run_one_per_node(cluster):
    """The driver joined the head, both nodes are in the cluster, and max_replicas_per_node=1 put the two
    engine replicas on different nodes: one on node_a (the head), one on node_b (the worker)."""
    assert ray.get_runtime_context().get_node_id() == cluster.node_id("node_a")
    actors = cluster.alive_actors(ENGINE_DEPLOYMENT)
    assert len(actors) == 2, actors
    assert {a["Address"]["NodeID"] for a in actors} == {cluster.node_id("node_a"), cluster.node_id("node_b")}
    assert [a["Address"]["NodeID"] for a in cluster.alive_actors("OpenAIIngress")] == [cluster.node_id("node_a")]


def test_a_greedy_completion_is_served_and_repeatable(cluster):
    first, second = greedy(cluster), greedy(cluster)
    assert first and first == second


def test_losing_the_worker_node_ends_its_streams_and_the_head_replica_serves_on(cluster):
    expected = greedy(cluster)
    head_id, worker_id = cluster.node_id("node_a"), cluster.node_id("node_b")
    replicas = cluster.replica_handles()
    assert set(replicas) == {head_id, worker_id}
    results, threads = start_streams(cluster, [f"Stream {i}: {PROMPT}" for i in range(6)])
    counts = wait_for(lambda: in_flight_on_all(replicas, results), 60, 0.05, what="streams in flight on both")
    assert all("ended" not in r for r in results), "a stream ended before the node was killed: make them longer"
    worker_tree = cluster.nodes["worker"].tree()
    assert any(p.name() == "raylet" for p in worker_tree), [p.name() for p in worker_tree]
    killed_at = time.monotonic()
    kill_tree(worker_tree)

    join(threads, killed_at + STREAM_END_BOUND_S + 10)
    failed = [r for r in results if "error" in r]
    completed = [r for r in results if "error" not in r]
    assert failed, f"no stream failed although {counts[worker_id]} ran on the killed node: {results}"
    assert len(failed) == counts[worker_id], (f"worker {worker_id[:8]}", counts, [  # exactly the dead replica's
        (r["chunks"], r["finish"], repr(r.get("error"))[:60]) for r in results])
    for r in failed:  # the ingress's error event, which the openai client raises as an APIError
        assert isinstance(r["error"], openai.APIError) and r["error"].code == "replica_died", r
        assert r["ended"] - killed_at < STREAM_END_BOUND_S, r
    for r in completed:  # the head replica's streams never noticed
        assert r["finish"] == "length" and r["chunks"] > 1, r

    # New requests: the head's replica serves them (the replacement for node_b's replica cannot be placed:
    # one replica per node, and node_b is gone), with the same greedy text as before the kill.
    recovered_at = None

    def served() -> bool:
        nonlocal recovered_at
        if greedy(cluster, timeout=20) == expected:
            recovered_at = time.monotonic()
            return True
        return False

    wait_for(served, RECOVERY_BOUND_S, 1.0, what="a completion served after the worker node died")
    # The GCS declares the node dead on its own schedule (missed health checks), possibly after the above, and
    # only then marks the actors that lived there dead: until it does, node_b's replica is still listed alive.
    wait_for(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == worker_id), 60,
             what="the GCS to mark the worker node dead")
    dead_at = time.monotonic()
    wait_for(lambda: [a["Address"]["NodeID"] for a in cluster.alive_actors(ENGINE_DEPLOYMENT)] == [head_id], 30,
             what="the only live engine replica to be the head's")
    for _ in range(3):
        assert greedy(cluster) == expected
    print(f"streams per node {counts}; {len(failed)} failed, the last {max(r['ended'] for r in failed) - killed_at:.1f}"
          f" s after the kill; served again after {recovered_at - killed_at:.1f} s; node dead after "
          f"{dead_at - killed_at:.1f} s")


def test_a_new_worker_node_gets_the_missing_replica(cluster):
    """While node_b is gone, Serve's replacement replica waits (no node with room for it); a new worker node
    offering node_b gets it, and its replica serves the same greedy text as the head's."""
    head_id = cluster.node_id("node_a")

    def states() -> dict[str, int]:
        status = serve.status().applications[cluster.app_name].deployments[ENGINE_DEPLOYMENT]
        return {str(getattr(k, "value", k)): n for k, n in status.replica_states.items() if n}

    pending = wait_for(lambda: (s := states()).get("RUNNING") == 1 and sum(s.values()) == 2 and s, 30,
                       what="Serve's replacement replica, waiting for a node")
    assert len(cluster.alive_actors(ENGINE_DEPLOYMENT)) == 1, pending
    started_at = time.monotonic()
    start_worker(cluster, "worker2")
    new_id = wait_for(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2 and cluster.node_id("node_b"), 30,
                      what="the new worker node to join")
    wait_for(lambda: states() == {"RUNNING": 2}, RECOVERY_BOUND_S, what="two running engine replicas")
    replicas = cluster.replica_handles()
    assert set(replicas) == {head_id, new_id}

    # Streams are added one every 0.5 s (at least 4, at most 12) until both replicas have some in flight. With
    # a batch of 4 sent at once, the wait for both replicas timed out once in ~4 full runs, most likely all 4
    # on the head's replica: the router's queue-length view is cached, and it may learn of the new replica
    # after the controller does. Where requests land is not what this test is about; that the new node's
    # replica serves, and serves the same text, is.
    results, threads = [], []

    def spread() -> dict[str, int] | None:
        counts = in_flight_on_all(replicas, results)
        if counts and len(results) >= 4:
            return counts
        if len(results) < 12:
            more, started = start_streams(cluster, [PROMPT])
            results.extend(more)
            threads.extend(started)
        return None

    counts = wait_for(spread, 60, 0.5, what="streams on both replicas")
    join(threads, time.monotonic() + 120)
    assert all("error" not in r and r["finish"] == "length" for r in results), results
    assert len({r["text"] for r in results}) == 1, [r["text"][:80] for r in results]  # same text on both nodes
    print(f"replacement replica pending ({pending}); new node serving after {time.monotonic() - started_at:.1f}"
          f" s; streams per node {counts}")


# Pipeline parallelism across nodes (issue 19): a second app on the same cluster, one engine replica whose 2
# stage actors (cluster/pipeline.py) take bundles 1 and 2 of the replica's placement group (bundle 0 is the
# replica itself). Why SPREAD puts the two stages on different nodes every time, not just best-effort: Ray's
# bundle scheduler (BundleSpreadSchedulingPolicy, src/ray/raylet/scheduling/policy/bundle_scheduling_policy.cc)
# first sorts the bundles, GPU then custom resources then memory then CPU, biggest first, and then gives each
# bundle in turn the best node not yet used, reusing a used node only when none is left. With the stage bundles
# bigger than the replica's (0.5 > 0.25 CPU here; on cuda each stage bundle has a GPU), the two stages are
# placed first, on two distinct nodes whenever two nodes have room; the replica then joins either. Equal
# bundles would make it a coin toss (std::sort is not stable): the test checks the inequality it relies on.
PP_ROUTE = "/pp"
PP_APP = {"num_replicas": 1, "pipeline_parallel_size": 2, "pp_placement_strategy": "SPREAD",
          "replica_num_cpus": 0.25, "pp_stage_num_cpus": 0.5, "ingress_resources": {"node_a": 0.01},
          "router": "pow2", "health_check_period_s": 1.0, "health_check_timeout_s": 10.0,
          "graceful_shutdown_timeout_s": 5.0}
PP_PROMPTS = [PROMPT, "Once upon a time in a small village"]


def live_worker(cluster: Cluster) -> Node | None:
    """The worker node started by this module that still has its raylet (tests above kill and add workers)."""
    live = [n for name, n in cluster.nodes.items()
            if name != "head" and any(p.name() == "raylet" for p in n.tree() if p.is_running())]
    assert len(live) <= 1, live
    return live[0] if live else None


def stage_nodes() -> list[str]:
    """Node ids of the live pipeline stage actors (cluster/pipeline.py names them tandem-pp-<group>-stage<i>)."""
    return sorted(a["Address"]["NodeID"] for a in alive_named("tandem-pp-"))


@pytest.fixture(scope="module")
def pp_app(cluster) -> str:
    """The PP app's name, deployed beside the module's app once both nodes are up (a fresh worker if the
    tests above left none); the module's cluster teardown removes it."""
    if live_worker(cluster) is None:
        start_worker(cluster, f"worker{len(cluster.nodes)}")
    wait_for(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2 and cluster.node_id("node_b"), 60,
             what="two live nodes")
    name = cluster.app_name + "pp"
    serve.run(build_app(PP_APP), name=name, route_prefix=PP_ROUTE)
    return name


def test_spread_puts_the_pipeline_stages_of_one_replica_on_different_nodes(cluster, pp_app):
    engine = build_app(PP_APP)._bound_deployment.init_args[0]._bound_deployment
    bundles = engine._replica_config.placement_group_bundles
    assert engine._replica_config.placement_group_strategy == "SPREAD"
    assert len(bundles) == 3 and bundles[1] == bundles[2] and bundles[1]["CPU"] > bundles[0]["CPU"], bundles
    assert stage_nodes() == sorted([cluster.node_id("node_a"), cluster.node_id("node_b")])
    [replica] = cluster.alive_actors(ENGINE_DEPLOYMENT, pp_app)
    print(f"PP replica on {'head' if replica['Address']['NodeID'] == cluster.node_id('node_a') else 'worker'}")


def test_a_cross_node_pipeline_serves_the_single_engine_greedy_text(cluster, pp_app):
    """The same greedy text as the module's single-engine (non-PP) app of the same model: hidden states cross
    from one node's stage to the other's through the compiled graph, for a completion and a stream."""
    for prompt in PP_PROMPTS:
        want = greedy(cluster, prompt=prompt)
        assert want and greedy(cluster, route=PP_ROUTE, prompt=prompt) == want
    stream = client(cluster, route=PP_ROUTE).completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                                               temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == greedy(cluster)


TPPP_ROUTE = "/tppp"
TPPP_APP = {**PP_APP, "tensor_parallel_size": 2, "pp_stage_num_cpus": 0.25}  # stage bundles: 2 x 0.25 CPU


def test_tp_x_pp_stage_groups_span_the_nodes_and_serve_the_single_engine_text(cluster, pp_app):
    """TP=2 x PP=2 with SPREAD: each stage's bundle holds its whole TP group (0.5 CPU, bigger than the replica's
    0.25, so the two stage bundles go to different nodes first, as for PP alone), so a stage's two ranks share
    a node and talk over loopback while the two stages' groups sit on different nodes; the groups' rendezvous
    store listens on the replica's node address. Greedy text equals the module's single-engine app's."""
    name = cluster.app_name + "tppp"
    serve.run(build_app(TPPP_APP), name=name, route_prefix=TPPP_ROUTE)
    try:
        def tppp_ranks() -> dict[str, str] | None:
            groups: dict[str, dict[str, str]] = {}  # tandem-pp-<id> -> actor suffix -> node id
            for a in alive_named("tandem-pp-"):
                group, _, rank = a["Name"].rpartition("-stage")
                groups.setdefault(group, {})["stage" + rank] = a["Address"]["NodeID"]
            found = [g for g in groups.values() if "stage0-tp1" in g]  # the TP x PP app's group
            return found[0] if found and len(found[0]) == 4 else None

        # the GCS actor table can list a rank a moment after the app reports ready (one CI run saw three)
        ranks = wait_for(tppp_ranks, 60, what="the TP x PP app's four ranks alive in the actor table")
        assert sorted(ranks) == ["stage0", "stage0-tp1", "stage1", "stage1-tp1"], ranks
        assert ranks["stage0"] == ranks["stage0-tp1"] and ranks["stage1"] == ranks["stage1-tp1"], ranks
        assert ranks["stage0"] != ranks["stage1"], ranks
        for prompt in PP_PROMPTS:
            want = greedy(cluster, prompt=prompt)
            assert want and greedy(cluster, route=TPPP_ROUTE, prompt=prompt) == want
    finally:
        serve.delete(name)


def test_losing_a_stage_node_ends_the_pipeline_streams_and_a_new_group_on_the_head_serves(cluster, pp_app):
    """Killing the worker node (one stage, maybe the replica too) mid-stream: every stream of the PP replica
    ends with an error within the bound (each step needs both stages, so none can finish). Which error is set
    by where SPREAD put the replica (bundle 0, either node): on the worker, the replica dies with it; on the
    head, the replica lives on but its compiled graph breaks, the step fails, and the replica's health check
    then fails. Both reach the client as replica_died (retryable). Either way Serve replaces the replica, and
    SPREAD being best-effort, the
    replacement's placement group (replica and both stages) fits on the head alone, so new requests are
    served again, with the same greedy text, by a stage group entirely on the head."""
    head_id = cluster.node_id("node_a")
    expected = greedy(cluster, route=PP_ROUTE)
    [replica] = cluster.alive_actors(ENGINE_DEPLOYMENT, pp_app)
    replica_on_worker = replica["Address"]["NodeID"] != head_id
    handle = ray.get_actor(replica["Name"], namespace="serve")
    results, threads = start_streams(cluster, [f"Stream {i}: {PROMPT}" for i in range(2)], route=PP_ROUTE)
    wait_for(lambda: in_flight_on_all({"pp": handle}, results), 60, 0.05, what="PP streams in flight")
    assert all("ended" not in r for r in results), "a stream ended before the node was killed: make them longer"
    worker = live_worker(cluster)
    killed_at = time.monotonic()
    kill_tree(worker.tree())

    join(threads, killed_at + STREAM_END_BOUND_S + 10)
    for r in results:
        assert isinstance(r.get("error"), openai.APIError), f"a stream outlived half its pipeline: {r}"
        assert r["ended"] - killed_at < STREAM_END_BOUND_S, r
        assert r["error"].code == "replica_died", (replica, r)  # either way the replica can no longer serve
    ended_s = max(r["ended"] for r in results) - killed_at
    recovered_at = None

    def served() -> bool:
        nonlocal recovered_at
        if greedy(cluster, timeout=20, route=PP_ROUTE) == expected:
            recovered_at = time.monotonic()
            return True
        return False

    wait_for(served, RECOVERY_BOUND_S, 1.0, what="the PP app to serve again after the stage node died")
    # The GCS lists the dead replica alive until it has declared its node dead: wait for one live replica.
    [new] = wait_for(lambda: len(live := cluster.alive_actors(ENGINE_DEPLOYMENT, pp_app)) == 1 and live, 60,
                     what="one live PP replica")
    assert new["ActorID"] != replica["ActorID"] and new["Address"]["NodeID"] == head_id
    assert stage_nodes() == [head_id, head_id]
    print(f"PP replica was on the {'worker' if replica_on_worker else 'head'}; streams failed "
          f"({results[0]['error'].code}) within {ended_s:.1f} s of the kill; served again after "
          f"{recovered_at - killed_at:.1f} s on a stage group on the head")
