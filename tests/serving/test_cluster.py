"""Scale out: `flywheel serve` on a two-node Ray cluster, one replica per node, both swapping in place.

The cluster is real and on this machine: `ray start --head` and a second `ray start --address`,
each with its own temp folder, ports, a custom resource that names it and its own replica folder
(FLYWHEEL_SERVE__REPLICA_DIR in the environment of its `ray start`, as on separate machines each
node has its own disk). The weight store is on a real S3 server (SeaweedFS), the records go to
the session's Kafka broker, and Flywheel runs as a user runs it: `flywheel serve` joins the
cluster (`serve.ray_address`) with `serve.max_replicas_per_node = 1`, and `flywheel swap 1`
moves the pool to v1. Each replica reports its node, the folder it loaded and its payload cache
(`ModelReplica.swap_status`); the test checks that both exported v0 from S3 and fetched v1's
delta into their own node's folders, swapped in place, and answered completions at v1 with the
learner's v1 logprobs. Each node is stopped by ending its own `ray start --block` (never a
machine-wide `ray stop`, which would end other Ray clusters on the machine too).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from feedback import db
from learner import store as S
from learner.export import export_hf
from learner.model import ModelArgs, Transformer
from tests.helpers import REPO, free_port, scaled, served_logprob_tolerance
from tests.learner.test_delta import train_steps
from tests.learner.test_export import spread_routers
from tests.serving.test_hotswap import model_from
from tests.serving.test_serve_e2e import _records as completion_records

pytestmark = [pytest.mark.extended, pytest.mark.slow, pytest.mark.kafka]  # ~3.5 min on 2 loaded cores
TOKEN = "cluster-editor-token"
NODES = ("node_a", "node_b")  # the custom resource each node carries, one unit: how the test tells them apart


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    replica_dir: Path
    log: Path


def _ray_env(auth_token: str) -> dict[str, str]:
    """What every process of the cluster and its drivers share: token authentication with this
    test's own token (Ray's default for a head started where ~/.ray/auth_token exists)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": auth_token}


def _start_node(name: str, head_port: int, temp_root: Path, folder: Path, env: dict, *, head: bool) -> Node:
    """One `ray start --block` on ports of its own; ending that process ends the node."""
    from serving.app import _LOCAL_SERVE_ENV

    replica_dir = folder / name
    log = folder / f"{name}.log"
    options = {
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
        "--metrics-export-port": free_port(),
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
    }
    if head:
        options |= {"--port": head_port, "--ray-client-server-port": free_port(), "--dashboard-port": free_port()}
        options["--include-dashboard"] = "false"  # head-only options
    cmd = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        *(["--head"] if head else [f"--address=127.0.0.1:{head_port}"]),
        "--block",
        # room for two replicas (serve.engine.num_cpus = 1; the ingress, proxy and controller take none):
        # one replica per node is serve.max_replicas_per_node's doing, not a lack of CPUs
        "--num-cpus=2",
        f"--resources={json.dumps({name: 1})}",
        f"--temp-dir={temp_root / name}",
        "--object-store-memory=100000000",
        "--disable-usage-stats",
        *(f"{k}={v}" for k, v in options.items()),
    ]
    node_env = env | _LOCAL_SERVE_ENV | {"FLYWHEEL_SERVE__REPLICA_DIR": str(replica_dir)}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=node_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Node(name, proc, replica_dir, log)


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


def _processes_under(path: Path) -> list[str]:
    """Processes whose command line names `path` (every process of a Ray node names its temp folder)."""
    out = subprocess.run(["pgrep", "-af", str(path)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path} unreadable)"


# What the test asks the cluster, as one more Ray driver of its own (a process, so that this test
# process holds no Ray connection and no Ray state). `nodes`: the live nodes' custom resources by
# node id. `replicas N`: `swap_status` of every replica of the stable pool by replica id, asked
# through a handle until all N have answered: Ray Serve's router picks one replica per call, at
# random between idle ones, so 60 calls miss one of two replicas with probability 2^-59.
_ASK = """
import json, sys
import ray
what, address = sys.argv[1], sys.argv[2]
ray.init(address=address, log_to_driver=False)
if what == "nodes":
    out = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
else:
    from ray import serve
    handle = serve.get_deployment_handle("replica-stable", "flywheel")
    out = {}
    for _ in range(60):
        status = handle.swap_status.remote().result(timeout_s=float(sys.argv[4]))
        out[status["replica"]] = status
        if len(out) == int(sys.argv[3]):
            break
print("ANSWER " + json.dumps(out))
"""


def _ask(env: dict, address: str, *args: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", _ASK, *args[:1], address, *args[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(180),
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ANSWER ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"asking the cluster {args} failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
    return json.loads(lines[-1].removeprefix("ANSWER "))


def _replica_statuses(env: dict, address: str, n: int) -> dict[str, dict]:
    return _ask(env, address, "replicas", str(n), str(scaled(60)))


@pytest.fixture
def cluster(tmp_path):
    """A two-node Ray cluster on this machine: the head (resource node_a) and a worker (node_b)."""
    # Ray's unix sockets live under the temp folder and their paths must stay under ~107 bytes.
    temp_root = Path(tempfile.mkdtemp(prefix="fw-ray-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "FLYWHEEL_SERVE__"))}
    env |= _ray_env(secrets.token_hex(32))
    head_port = free_port()
    address = f"127.0.0.1:{head_port}"
    nodes: list[Node] = []

    def joined() -> set[str]:
        try:
            return {r for resources in _ask(env, address, "nodes").values() for r in resources} & set(NODES)
        except RuntimeError:
            return set()

    try:
        for name in NODES:
            nodes.append(_start_node(name, head_port, temp_root, tmp_path, env, head=not nodes))
            deadline = time.monotonic() + scaled(180)
            while name not in joined():
                assert nodes[-1].proc.poll() is None, f"{name} exited:\n{_tail(nodes[-1].log)}"
                assert time.monotonic() < deadline, f"{name} did not join:\n{_tail(nodes[-1].log)}"
                time.sleep(1)
        yield address, env, nodes
    finally:
        for node in reversed(nodes):  # the worker first, then the head (its GCS)
            _stop(node.proc, scaled(60))
        deadline = time.monotonic() + scaled(30)
        while (left := _processes_under(temp_root)) and time.monotonic() < deadline:
            time.sleep(1)
        for line in left:  # this cluster's own processes only: their command lines name its temp folder
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        shutil.rmtree(temp_root, ignore_errors=True)
        assert not left, f"processes of the cluster outlived its nodes: {left}"


def _publish(tok, s3_server, s3_uri, folder: Path) -> tuple[ModelArgs, dict, dict]:
    """The learner's side: model files, v0 and v1 (a delta) on S3; as test_hotswap's S3 test."""
    args = ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=256)
    torch.manual_seed(1)
    model = Transformer(args)
    model.init_weights(0.1)  # wide logits, clear greedy margins
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    spread_routers(model, 0.5)
    v0 = S.pack_checkpoint(model.state_dict())
    train_steps(model, 10, lr=3e-3, seed=5)  # big steps, so v1's logprobs differ clearly from v0's
    v1 = S.pack_checkpoint(model.state_dict())
    learner = S.open_store(s3_uri, storage_options=s3_server.storage_options())
    hf = export_hf(model_from(S.to_hf_tensors(v0), args), args, tok, folder)
    files = {p.name: p.read_bytes() for p in hf.iterdir() if p.name != "model.safetensors"}
    learner.write_model_files(files | {S.BASE_FILE: json.dumps({"kind": "test", "source": "s3"}).encode()})
    for v, c in enumerate((v0, v1)):
        learner.publish(c, parent=v - 1 if v else None)
    shutil.rmtree(folder)
    return args, v0, v1


def _config(path: Path, *, data: Path, address: str, port: int, kafka, s3_server, s3_uri: str) -> Path:
    path.write_text(
        f"""data_dir = "{data}"
cache_dir = "{data.parent / "cache"}"

[kafka]
port = {kafka.port}
controller_port = {kafka.controller_port}

[store]
uri = "{s3_uri}"
[store.s3]
endpoint_url = "{s3_server.endpoint}"
access_key_id = "{s3_server.access_key}"

[serve]
host = "127.0.0.1"
port = {port}
ray_address = "{address}"
replicas = 2
canary_replicas = 0
max_replicas_per_node = 1
pool_poll_s = 0.5
context_budget = 200
summary_chunk_tokens = 64

[serve.engine]
max_model_len = 256
max_num_seqs = 8
"""
    )
    return path


def _flywheel_env(cluster_env: dict, s3_server) -> dict:
    env = {k: v for k, v in cluster_env.items() if not k.startswith("FLYWHEEL_")}
    if "FLYWHEEL_CACHE_DIR" in os.environ:
        env["FLYWHEEL_CACHE_DIR"] = os.environ["FLYWHEEL_CACHE_DIR"]
    return env | {
        "FLYWHEEL_SERVE__AUTH_TOKENS": json.dumps([TOKEN]),
        "FLYWHEEL_STORE__S3__SECRET_ACCESS_KEY": s3_server.secret_key,
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


@contextlib.contextmanager
def _flywheel_serve(config: Path, env: dict, log: Path):
    """`flywheel serve --config config` until the API answers; ended with SIGTERM as a user would."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "serve", "--config", str(config)],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + scaled(420)
        while True:
            assert proc.poll() is None, f"flywheel serve exited with {proc.returncode}:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"flywheel serve did not start:\n{_tail(log)}"
            if "serving model v0 at" in log.read_text(errors="replace"):
                break
            time.sleep(1)
        yield proc
    finally:
        _stop(proc, scaled(120))


def test_two_nodes_each_fetch_from_s3_and_serve_v1_after_a_swap(
    tok, tmp_path, cluster, s3_server, s3_uri, kafka_settings
):
    from serving.app import engine_precision
    from serving.settings import ServingSettings
    from tests.helpers import flywheel

    t0 = time.monotonic()
    address, cluster_env, nodes = cluster
    node_of = {
        node: r for node, resources in _ask(cluster_env, address, "nodes").items() for r in resources if r in NODES
    }
    args, v0, v1 = _publish(tok, s3_server, s3_uri, tmp_path / "learner")
    store = S.open_store(s3_uri, storage_options=s3_server.storage_options())
    v0_full, v1_delta = store.manifest(0)["files"]["full"], store.manifest(1)["files"]["delta"]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "serve" / "data"
    config = _config(
        tmp_path / "flywheel.toml",
        data=data,
        address=address,
        port=port,
        kafka=kafka_settings.kafka,
        s3_server=s3_server,
        s3_uri=s3_uri,
    )
    env = _flywheel_env(cluster_env, s3_server)
    # without the cluster's token, joining is refused in one line (no traceback)
    refused = subprocess.run(
        [sys.executable, "-m", "ops.cli", "serve", "--config", str(config)],
        env={k: v for k, v in env.items() if not k.startswith("RAY_AUTH_")},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(180),
    )
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("flywheel: error:")]
    assert refused.returncode != 0 and "Traceback" not in refused.stdout + refused.stderr, refused.stderr[-3000:]
    assert len(errors) == 1 and f"cannot join the Ray cluster at serve.ray_address {address}" in errors[0], errors
    print(f"\nwithout the token: {errors[0]}")
    with (
        _flywheel_serve(config, env, tmp_path / "serve.log"),
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=scaled(120)) as client,
    ):
        started = time.monotonic() - t0
        # one replica on each node, each on v0 exported from S3 into its own node's folder
        before = _replica_statuses(cluster_env, address, 2)
        assert sorted(node_of[s["node_id"]] for s in before.values()) == sorted(NODES), before
        for s in before.values():
            mine = next(n for n in nodes if n.name == node_of[s["node_id"]])
            assert s["version"] == 0 and s["model_dir"] == str(mine.replica_dir / "served" / "v000000")
            assert s["store_cache_dir"] == str(mine.replica_dir / "store")
            assert (mine.replica_dir / "store" / v0_full["sha256"]).is_file()  # v0's snapshot, fetched from S3
            assert (mine.replica_dir / "served" / "v000000" / S.EXPORT_MARKER).read_text().startswith("0 ")

        # the operator moves the pool to v1; both replicas fetch its delta and swap in place
        swap = flywheel("swap", "1", "--config", str(config), env=env, timeout=120)
        assert swap.returncode == 0, swap.stdout + swap.stderr
        engine = db.make_engine(f"sqlite:///{data / 'flywheel.db'}")
        deadline = time.monotonic() + scaled(180)
        while True:
            with engine.connect() as conn:
                rows = list(conn.execute(db.swap_events.select()))
            if len({r.replica for r in rows if r.ok and r.to_version == 1}) == 2:
                break
            assert not [r for r in rows if not r.ok], [r.error for r in rows]
            assert time.monotonic() < deadline, f"both replicas did not swap to v1: {rows}"
            time.sleep(0.5)
        swapped_at = time.monotonic() - t0

        # completions through the API until both replicas have answered some at v1
        prompts = ["def parse(s):\n    ", "import json\n\nclass Encoder:\n", "for i in range(", "x = [1, 2"]

        def complete(i: int) -> dict:
            r = client.post(
                "/v1/completions",
                json={"prompt": prompts[i % len(prompts)], "max_tokens": 12, "temperature": 0, "user": f"u{i}"},
            )
            assert r.status_code == 200, r.text
            return r.json()

        answers: list[dict] = []
        deadline = time.monotonic() + scaled(180)
        with ThreadPoolExecutor(4) as pool:
            while True:
                answers += pool.map(complete, range(len(answers), len(answers) + 8))
                after = _replica_statuses(cluster_env, address, 2)
                if all(s["completions"].get("1", 0) > 0 for s in after.values()):
                    break
                assert time.monotonic() < deadline, f"a replica answered nothing at v1: {after}"
        assert {a["model"] for a in answers} == {"flywheel@v1"}

        for s in after.values():
            mine = next(n for n in nodes if n.name == node_of[s["node_id"]])
            assert s["version"] == 1 and s["swaps"] == 1 and s["last_swap"]["ok"]
            plan = s["last_swap"]["plan"]
            assert (plan["have"], plan["full"], plan["deltas"]) == (0, None, [1])  # a delta, not a snapshot
            assert (mine.replica_dir / "store" / v1_delta["sha256"]).is_file()  # fetched into its own cache
        print(
            "\nreplicas: "
            + "; ".join(
                f"{node_of[s['node_id']]}: v{s['version']}, completions by version {s['completions']}, "
                f"swap pause {s['last_swap']['pause_s'] * 1e3:.1f} ms"
                for s in after.values()
            )
        )

    # every answer was v1's weights: the records' logprobs against the learner's v1 (and not v0)
    records = completion_records(kafka_settings, {a["id"] for a in answers})
    assert len(records) == len(answers) and {r.model_version for r in records.values()} == {1}
    s = ServingSettings(serve={"context_budget": 200, "summary_chunk_tokens": 64, "engine": {"max_model_len": 256}})
    seqs = [(r.prompt_token_ids, r.choices[0].token_ids) for r in records.values()]

    def worst(hf: dict) -> float:
        m = model_from(hf, args)
        out = 0.0
        for r in records.values():
            seq = torch.tensor([r.prompt_token_ids + r.choices[0].token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(m(seq)[0].float(), -1)
            n = len(r.prompt_token_ids)
            ours = [logp[n - 1 + i, t].item() for i, t in enumerate(r.choices[0].token_ids)]
            out = max(out, max(abs(a - b) for a, b in zip(ours, r.choices[0].logprobs, strict=True)))
        return out

    tol = served_logprob_tolerance(model_from(S.to_hf_tensors(v1), args), seqs, engine_precision(s.serve).dtype)
    d_new, d_old = worst(S.to_hf_tensors(v1)), worst(S.to_hf_tensors(v0))
    print(
        f"cluster up to API ready {started:.0f} s, both swapped at {swapped_at:.0f} s; {len(records)} completions: "
        f"|logprob - learner v1| max {d_new:.4f} (tolerance {tol:.4f}), vs v0 {d_old:.3f}"
    )
    assert d_new < tol and d_old > 5 * tol
