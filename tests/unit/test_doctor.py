"""`compushare doctor`: its pure checks on made-up facts (every verdict of every check
reached), and the command on a fresh data dir (text and --json, exit codes)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from compushare.app.doctor import FAIL, OK, WARN, Facts, ModelNeeds, failed, run_checks

pytestmark = pytest.mark.unit

MB = 10**6
SMOL = ModelNeeds("smollm2-135m", 540 * MB, held_bytes=0, num_blocks=30, block_bytes=17 * MB)
NODE = {"pid": 1, "api": "http://127.0.0.1:8311", "net": {"reachability": "public", "relays": []}}
FINE = Facts(python=(3, 11, 7), python_required=">=3.11,<3.12", torch_version="2.13.0+cpu", torch_expected="2.13.0",
             cuda_device=None, ram_free_mb=16_000, gpu_free_mb=None, disk_free_mb=50_000, model=SMOL, model_problem="",
             data_dir="/home/u/.compushare", data_dir_exists=True, data_dir_writable=True, token_mode=0o600,
             key_mode=0o600, node=NODE, node_status={"net": NODE["net"]}, node_problem="", api_port=8311,
             port_taken=False)


def verdicts(facts: Facts, **changes) -> dict[str, tuple[str, str, str]]:
    checks = run_checks(dataclasses.replace(facts, **changes))
    assert len({c.name for c in checks}) == len(checks)
    return {c.name: (c.verdict, c.message, c.fix) for c in checks}


def test_a_healthy_machine_is_all_ok():
    checks = run_checks(FINE)
    assert [c.verdict for c in checks] == [OK] * len(checks) and not failed(checks)
    assert [c.name for c in checks] == ["python", "torch", "device", "memory", "disk", "reachability", "api",
                                        "data dir", "api token", "identity key"]
    assert all(c.fix == "" for c in checks)
    assert checks[0].line() == "ok    python: Python 3.11.7 (>=3.11,<3.12)"


def test_python_and_torch():
    assert verdicts(FINE, python=(3, 12, 1))["python"][0] == FAIL
    assert verdicts(FINE, python=(3, 10, 0))["python"][2].startswith("install a Python")
    assert verdicts(FINE, torch_version=None)["torch"][:1] == (FAIL,)
    assert "torch==2.13.0" in verdicts(FINE, torch_version=None)["torch"][2]
    wrong = verdicts(FINE, torch_version="2.12.1+cu128")["torch"]
    assert wrong[0] == WARN and "2.12.1+cu128" in wrong[1] and wrong[2] == "pip install torch==2.13.0"
    assert verdicts(FINE, torch_expected=None, torch_version="9.9")["torch"][0] == OK


def test_device_says_cuda_or_cpu():
    assert "CPU" in verdicts(FINE)["device"][1]
    gpu = verdicts(FINE, cuda_device="NVIDIA H100 80GB HBM3", gpu_free_mb=80_000)["device"]
    assert gpu == (OK, "CUDA: NVIDIA H100 80GB HBM3, 80000 MB free", "")


def test_memory_against_the_default_budget():
    assert verdicts(FINE)["memory"][0] == OK
    part = verdicts(FINE, ram_free_mb=400)["memory"]  # a node's budget: half of it, 200 MB: 11 blocks of 17 MB
    assert part[0] == WARN and "at most 11 of its 30 blocks" in part[1] and "NAME@q4" in part[2]
    none = verdicts(FINE, ram_free_mb=20)["memory"]
    assert none[0] == FAIL and "not one block fits" in none[1]
    on_gpu = verdicts(FINE, cuda_device="GPU", gpu_free_mb=100, ram_free_mb=100_000)["memory"]
    assert on_gpu[0] == WARN and "GPU memory free" in on_gpu[1]
    approximate = dataclasses.replace(SMOL, exact=False, num_blocks=0, block_bytes=0)
    assert verdicts(FINE, model=approximate, ram_free_mb=100)["memory"][0] == FAIL  # its blocks unknown yet
    assert "about 540 MB" in verdicts(FINE, model=approximate)["memory"][1]
    unknown = verdicts(FINE, model=None, model_problem="x is neither held here nor in the catalog")
    assert unknown["memory"][0] == WARN and "neither held" in unknown["memory"][1]
    assert unknown["disk"][0] == OK


def test_disk_wants_room_for_a_conversion():
    assert verdicts(FINE)["disk"][0] == OK
    assert verdicts(FINE, disk_free_mb=800)["disk"][0] == WARN  # 540 MB fit, not twice that
    tight = verdicts(FINE, disk_free_mb=100)["disk"]
    assert tight[0] == FAIL and "COMPUSHARE_HOME" in tight[2]
    held = verdicts(FINE, disk_free_mb=1, model=dataclasses.replace(SMOL, held_bytes=SMOL.weights_bytes))["disk"]
    assert held[0] == OK and "held here" in held[1]


def test_reachability_from_the_running_node():
    assert verdicts(FINE)["reachability"][0] == OK
    relayed = {"net": {"reachability": "private", "relays": ["/ip4/1.2.3.4/tcp/1/p2p/r"]}}
    assert verdicts(FINE, node_status=relayed)["reachability"][0] == OK
    natted = verdicts(FINE, node_status={"net": {"reachability": "private", "relays": []}})["reachability"]
    assert natted[0] == WARN and "forward a TCP port" in natted[2]
    unknown = verdicts(FINE, node_status={"net": {"reachability": "unknown"}})["reachability"]
    assert unknown[0] == WARN and "not known yet" in unknown[1]
    # the API silent: node.json's own net says it
    assert verdicts(FINE, node_status=None, node_problem="timed out")["reachability"][0] == OK
    absent = verdicts(FINE, node=None, node_status=None)["reachability"]
    assert absent[0] == WARN and "no node runs on /home/u/.compushare" in absent[1] and "node -d" in absent[2]


def test_api_of_the_node_or_the_port_for_one():
    assert "answers at http://127.0.0.1:8311" in verdicts(FINE)["api"][1]
    silent = verdicts(FINE, node_status=None, node_problem="Connection refused")["api"]
    assert silent[0] == FAIL and "Connection refused" in silent[1] and "node.log" in silent[2]
    assert "API off" in verdicts(FINE, node=dict(NODE, api=None))["api"][1]
    alone = dict(node=None, node_status=None)
    assert verdicts(FINE, **alone)["api"] == (OK, "port 8311 is free for a node's API", "")
    taken = verdicts(FINE, **alone, port_taken=True)["api"]
    assert taken[0] == WARN and "taken by another program" in taken[1] and "api_port" in taken[2]
    assert verdicts(FINE, **alone, api_port=-1)["api"][0] == OK
    assert verdicts(FINE, **alone, api_port=0)["api"][0] == OK


def test_data_dir_and_secrets_permissions():
    fresh = verdicts(FINE, data_dir_exists=False)
    assert fresh["data dir"][0] == OK and "api token" not in fresh
    assert verdicts(FINE, data_dir_writable=False)["data dir"][0] == FAIL
    token = verdicts(FINE, token_mode=0o644)["api token"]
    assert token == (FAIL, "api.token has mode 644: other users may read it",
                     "chmod 600 /home/u/.compushare/api.token")
    assert verdicts(FINE, key_mode=0o640)["identity key"][0] == FAIL
    assert verdicts(FINE, key_mode=0o400)["identity key"][0] == OK
    assert verdicts(FINE, token_mode=None, key_mode=None)["api token"][0] == OK
    assert failed(run_checks(dataclasses.replace(FINE, token_mode=0o666)))


def test_the_command_on_a_fresh_data_dir(tmp_path, monkeypatch):
    from compushare.app.cli import app

    home = tmp_path / "fresh"
    monkeypatch.setenv("COMPUSHARE_HOME", str(home))
    runner = CliRunner()
    shown = runner.invoke(app, ["doctor"])
    lines = shown.stdout.splitlines()
    assert shown.exit_code == 0, shown.stdout
    assert {line.split()[0] for line in lines} <= {OK, WARN}  # (the API's port may be taken on this machine)
    assert [line.split()[1] for line in lines] == ["python:", "torch:", "device:", "memory:", "disk:",
                                                   "reachability:", "api:", "data", "api", "identity"]
    assert any(line.startswith("warn  reachability: no node runs on") for line in lines)
    as_json = runner.invoke(app, ["doctor", "--json", "--model", "nonesuch"])
    result = json.loads(as_json.stdout)
    by_name = {c["name"]: c for c in result["checks"]}
    assert result["ok"] is True and by_name["memory"]["verdict"] == WARN and not home.joinpath("api.token").exists()
    home.mkdir(exist_ok=True)
    (home / "api.token").write_text("secret")
    (home / "api.token").chmod(0o644)
    failing = runner.invoke(app, ["doctor"])
    assert failing.exit_code == 1 and "FAIL  api token: api.token has mode 644" in failing.stdout
