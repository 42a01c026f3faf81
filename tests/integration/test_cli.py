"""The CLI's answers when there is no swarm, or nothing to serve."""

import json
import os
import signal
import socket
import subprocess
import sys


SOME_PEER = "12D3KooWPNeT5huwyjSsfqfLgne7ZU9RfyLNy9gBiLLvDpe9QvAs"


def _cli(*args, env_home):
    env = dict(os.environ, COMPUSHARE_HOME=str(env_home))
    return subprocess.run([sys.executable, "-m", "compushare", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_run_without_any_swarm_says_how_to_get_one(tmp_path):
    result = _cli("run", "hello", env_home=tmp_path / "home")
    assert result.returncode == 2
    assert "no swarm to join" in result.stderr
    assert "swarm up" in result.stderr


def test_run_with_unreachable_bootstrap_says_so(tmp_path):
    # A model with a tokenizer: the tiny one cannot encode text, which is reported first.
    addr = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{SOME_PEER}"
    result = _cli("run", "--model", "smollm2-135m", "--bootstrap", addr, "hello", env_home=tmp_path / "home")
    assert result.returncode == 2
    assert "bootstrap peers answered" in result.stderr


def test_unobtainable_model_gives_actionable_error(tmp_path):
    addr = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{SOME_PEER}"
    result = _cli("run", "--model", "tinyllama", "--bootstrap", addr, "hello", env_home=tmp_path / "home")
    assert result.returncode == 2
    assert "tinyllama" in result.stderr and "models import" in result.stderr


def test_node_with_unknown_model_fails_clearly(tmp_path):
    result = _cli("node", "--model", "no-such-model", "--blocks", "0:1", env_home=tmp_path / "home")
    assert result.returncode == 2
    assert "unknown model 'no-such-model'" in result.stderr


def test_models_import_and_list(tmp_path, tiny_model):
    home = tmp_path / "home"
    imported = _cli("models", "import", str(tiny_model), "--name", "tiny", env_home=home)
    assert imported.returncode == 0, imported.stderr
    model_id = imported.stdout.strip()
    assert len(model_id) == 64
    listed = _cli("models", "list", "--json", env_home=home)
    import json

    (entry,) = json.loads(listed.stdout)
    assert entry == {"names": ["tiny"], "id": model_id, "blocks": 4, "dtype": "float32", "format": "fp32",
                     "block_bytes": entry["block_bytes"], "bytes": entry["bytes"], "held_blocks": [0, 1, 2, 3],
                     "holds_head": True}
    from compushare.model.store import ModelStore

    assert entry["bytes"] == ModelStore(home).get(model_id).manifest.total_bytes
    table = _cli("models", "list", env_home=home)
    assert "tiny" in table.stdout and "all" in table.stdout
    # The same weights in 4 bits: another model (another id), ~1/6 of the bytes per block.
    quantized = _cli("models", "import", str(tiny_model), "--name", "tiny@q4", "--format", "q4", "--json",
                     env_home=home)
    assert quantized.returncode == 0, quantized.stderr
    q4 = json.loads(quantized.stdout)
    assert q4["format"] == "q4/g64" and q4["model_id"] != model_id
    listed = {e["format"]: e for e in json.loads(_cli("models", "list", "--json", env_home=home).stdout)}
    assert listed["q4/g64"]["names"] == ["tiny@q4"]
    assert listed["q4/g64"]["block_bytes"] < 0.25 * listed["fp32"]["block_bytes"]
    bad = _cli("models", "import", str(tiny_model), "--format", "q3", env_home=home)
    assert bad.returncode != 0 and "unknown weight format" in bad.stderr


def test_models_fetch_wants_an_id(tmp_path):
    result = _cli("models", "fetch", "smollm2-135m", "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/"
                  "12D3KooWJqpfTAuVzpBfnu4xyhH9yyHmqYhUq9a5WwcvRmp1wYQr", env_home=tmp_path / "home")
    assert result.returncode == 2
    assert "not a model id" in result.stderr


def test_node_detach_writes_pid_and_log_and_stop_ends_it(tmp_path, tiny_model):
    """`node --detach` returns once the node serves, leaving a pid file and a log in
    the data dir; `stop` ends it by that pid (SIGTERM) and the files go away."""
    from compushare.model.catalog import import_path
    from compushare.app.swarm import is_our_node

    home = tmp_path / "daemon"
    import_path(tiny_model, home, alias="tiny")
    cli = [sys.executable, "-m", "compushare"]
    pid = None
    try:
        started = subprocess.run(cli + ["node", "--detach", "--model", "tiny", "--blocks", "0:4", "--data-dir",
                                        str(home), "--api-port", "0"], capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr
        pid = int((home / "node.pid").read_text())
        assert is_our_node(pid) and f"pid {pid}" in started.stdout and "http://127.0.0.1:" in started.stdout
        assert "serving blocks" in (home / "node.log").read_text()
        status = subprocess.run(cli + ["status", "--json", "--data-dir", str(home)], capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0, status.stderr
        daemon = json.loads(status.stdout)["this_node"]["daemon"]  # through the control API, with the token
        assert daemon["pid"] == pid and daemon["karma"]["score"] == 1.0 and daemon["tokens_served"] == 0
        assert daemon["private"]["sessions"] == 0  # serves private sessions (the default), none yet
        again = subprocess.run(cli + ["node", "--detach", "--model", "tiny", "--data-dir", str(home)],
                               capture_output=True, text=True, timeout=60)
        assert again.returncode != 0 and "already runs" in again.stderr
        stopped = subprocess.run(cli + ["stop", "--data-dir", str(home)], capture_output=True, text=True, timeout=30)
        assert stopped.returncode == 0, stopped.stderr
        assert not is_our_node(pid) and not (home / "node.pid").exists() and not (home / "node.json").exists()
        gone = subprocess.run(cli + ["stop", "--data-dir", str(home)], capture_output=True, text=True, timeout=30)
        assert gone.returncode == 2 and "no node runs" in gone.stderr
    finally:
        if pid is not None and is_our_node(pid):
            os.kill(pid, signal.SIGKILL)


def test_models_import_shows_progress_and_answers_json(tmp_path, tiny_model):
    plain = _cli("models", "import", str(tiny_model), "--name", "t", "--data-dir", str(tmp_path / "a"),
                 env_home=tmp_path)
    assert plain.returncode == 0, plain.stderr
    model_id = plain.stdout.strip()
    assert len(model_id) == 64 and "writing model" in plain.stderr  # the progress bar goes to stderr
    scripted = _cli("models", "import", str(tiny_model), "--json", "--data-dir", str(tmp_path / "b"), env_home=tmp_path)
    assert scripted.returncode == 0, scripted.stderr
    result = json.loads(scripted.stdout)
    assert result["model_id"] == model_id and result["num_blocks"] == 4 and result["bytes"] > 0
    assert "writing" not in scripted.stderr
