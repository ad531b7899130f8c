"""`python -m zoo matrix --ray-address`: the matrix runs on a cluster it is given, started here with
`ray start --head` as a user would start one, and sizes its cells by that cluster's nodes."""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import run_cli
from zoo.entries import read_results
from tests.test_matrix import _entry_file

HEAD_MEMORY = 3 * 1024**3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def ray_head():
    """(address, the environment a driver needs): a one-node cluster with 2 CPUs and 3 GiB for tasks, with
    Ray's token authentication on, as `ray start --head` sets it up, and a token of its own. Its own temp dir
    keeps its address file out of /tmp/ray, where a plain `ray.init()` elsewhere would find it and join it."""
    pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="rayh", dir="/tmp")  # short: Ray's socket paths live under it
    port = _free_port()
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port", str(port), "--num-cpus", "2",
         "--memory", str(HEAD_MEMORY), "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp_dir,
         "--block"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env={**os.environ, **auth})
    deadline = time.time() + 120
    while time.time() < deadline and not _accepts(port):
        assert head.poll() is None, "ray start --head exited"
        time.sleep(1)
    yield f"127.0.0.1:{port}", auth
    os.killpg(head.pid, signal.SIGTERM)
    try:  # Ray's own shutdown can take half a minute; its processes hold nothing the suite needs after this
        head.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_matrix_runs_on_the_cluster_given_by_ray_address_and_sizes_cells_by_its_nodes(ray_head, tmp_path):
    address, auth = ray_head
    small = _entry_file(tmp_path, "tiny-a", 1)
    wide = json.loads(open(small).read())
    wide["repo_id"] = "test/wide"
    wide["config"].update(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096)
    big = tmp_path / "wide.json"
    big.write_text(json.dumps(wide))
    out = tmp_path / "out"
    result = run_cli("matrix", "--models", small, str(big), "--recipes", "xnnpack-fp32", "--out", str(out),
                     "--export-only", "--max-seq-len", "32", "--weights", "random", "--ray-address", address, env=auth)
    assert result.returncode == 0, result.stderr[-3000:]
    cells = {c.model: c for c in read_results(out / "results.json")}
    assert cells["test/tiny-a"].status == "ok" and cells["test/tiny-a"].measured.pte_mb > 0
    # Only the given cluster offers 3 GiB to a task: a local one would offer this machine's memory.
    refused = cells["test/wide"]
    assert refused.status == "refused" and refused.stage == "memory-estimate"
    assert f"offers {HEAD_MEMORY / 1024**3:.1f} GiB" in refused.reason and "--ray-address" in refused.reason


def test_matrix_without_the_clusters_token_says_how_to_give_it(ray_head, tmp_path):
    address, _auth = ray_head
    result = run_cli("matrix", "--models", _entry_file(tmp_path, "tiny-a", 1), "--recipes", "xnnpack-fp32",
                     "--out", str(tmp_path / "out"), "--export-only", "--weights", "random", "--ray-address", address,
                     env={"RAY_AUTH_MODE": "disabled"})
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the Ray cluster at {address} asks for its token") and "RAY_AUTH_MODE=token" in last
    assert not (tmp_path / "out" / "results.json").exists()
