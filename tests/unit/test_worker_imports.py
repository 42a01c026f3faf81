"""The HE worker process (pipeline/server/private_worker.py) loads a span without
transformers: its config comes from config.json (he/groups.ShapeConfig), which gives
every family's group shapes exactly as transformers' config classes do."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

import compushare
from compushare.he.groups import ShapeConfig, group_shapes, required_steps
from compushare.model.arch import load_config
from compushare.model.families import read_config
from tiny_families import FAMILY_NAMES, tiny_config

pytestmark = pytest.mark.unit

LENGTH = struct.Struct(">I")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_shape_config_reads_config_json_as_transformers_does(family, tmp_path):
    tiny_config(family).save_pretrained(str(tmp_path))
    shapes = ShapeConfig.of(read_config(tmp_path))
    assert group_shapes(shapes) == group_shapes(load_config(tmp_path))
    assert required_steps(shapes, 4096) == required_steps(load_config(tmp_path), 4096)


def test_shape_config_defaults():
    """No head_dim: hidden / heads; no num_key_value_heads: as many as the query's."""
    shapes = ShapeConfig.of({"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128})
    assert (shapes.head_dim, shapes.num_key_value_heads) == (16, 4)
    assert group_shapes(shapes) == {"qkv": (192, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}


def test_the_worker_process_loads_a_span_without_importing_transformers(tiny_model):
    """The worker as the node starts it (`-m`), one load request over its stdin, and
    `-X importtime`'s list of every module the process imported."""
    env = dict(os.environ, PYTHONPATH=str(Path(compushare.__file__).parents[1]))
    request = msgpack.packb({"op": "load", "model_dir": str(tiny_model), "start": 0, "end": 2,
                             "params": "ckks-8192-60-40-60", "preencode": False}, use_bin_type=True)
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "compushare.pipeline.server.private_worker"],
                          input=LENGTH.pack(len(request)) + request, capture_output=True, env=env, timeout=120)
    (size,) = LENGTH.unpack(done.stdout[:LENGTH.size])
    reply = msgpack.unpackb(done.stdout[LENGTH.size:LENGTH.size + size], raw=False)
    assert reply["ok"]["bytes"] > 0, reply
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.decode().splitlines()
                if line.startswith("import time:") and "|" in line]
    assert "compushare.model.weights" in imported  # the list is the load's, not just the module's
    assert not [name for name in imported if name.split(".")[0] == "transformers"]
