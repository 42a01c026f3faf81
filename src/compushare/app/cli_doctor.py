"""`compushare doctor`: gathers what doctor.py's checks need from this machine and
data dir (Python, torch, memory, disk, the node running there and its API), prints
one verdict per line or --json; exits 1 when a check fails."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from importlib import metadata
from pathlib import Path

import typer

from ..config import DEFAULT_API_PORT, load_toml, resolve_data_dir
from ..errors import CompushareError
from .cli_common import DATA_DIR, out, run_or_exit
from .doctor import Facts, ModelNeeds, failed, run_checks

PYTHON_REQUIRED = ">=3.11,<3.12"  # pyproject's, where the package's metadata is not installed
TORCH_PINNED = "2.13.0"


def _package_pins() -> tuple[str, str]:
    """(requires-python, torch's pinned version) from the installed package's metadata."""
    try:
        required = metadata.metadata("compushare")["Requires-Python"] or PYTHON_REQUIRED
        pins = [r.split("==", 1)[1].split(";")[0].strip() for r in metadata.requires("compushare") or ()
                if r.replace(" ", "").startswith("torch==")]
    except metadata.PackageNotFoundError:
        return PYTHON_REQUIRED, TORCH_PINNED
    return required, pins[0] if pins else TORCH_PINNED


def _torch() -> tuple[str | None, str | None, int | None]:
    """(torch's version, the CUDA device's name, its free MB); Nones where absent."""
    try:
        import torch
    except Exception:  # a broken install: reported, not raised
        return None, None, None
    if not torch.cuda.is_available():
        return torch.__version__, None, None
    free, _total = torch.cuda.mem_get_info()
    return torch.__version__, torch.cuda.get_device_name(), free // 2**20


def model_needs(home: Path, name: str) -> tuple[ModelNeeds | None, str]:
    """What serving `name` takes: the store's manifest, else the catalog's size."""
    from ..model.catalog import CATALOG, split_name
    from ..model.store import ModelStore
    from ..pipeline.server.provider import held_block_bytes
    from ..spans import runtime_for

    try:
        stored = ModelStore(home).get(name) if home.exists() else None
        base = split_name(name)[0]
    except CompushareError as exc:
        return None, str(exc)
    if stored is not None:
        files = stored.manifest.files
        held = sum(files[i].size for i in stored.held_files())
        block = held_block_bytes(stored, runtime_for(stored.path))  # as the runtime that serves it holds it
        return ModelNeeds(name, stored.manifest.total_bytes, held, stored.num_blocks, block), ""
    entry = CATALOG.get(base)
    if entry is None or not entry.approx_bytes:
        return None, f"{name} is neither held in {home} nor in the catalog"
    return ModelNeeds(name, entry.approx_bytes, exact=False), ""


def _mode(path: Path) -> int | None:
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        return None


def _port_taken(port: int) -> bool:
    if port <= 0:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the API binds it (api/server.py)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
        except OSError:
            return True
    return False


def _running_node(home: Path) -> tuple[dict | None, dict | None, str]:
    """(node.json of the node on `home`, its /control/status, why that is None)."""
    from .api.client import call
    from .status import local_node

    node = local_node(home)
    if node is None or not node.get("api"):
        return node, None, ""
    try:
        return node, call(home, node["api"], "/control/status"), ""
    except (OSError, ValueError) as exc:
        return node, None, str(exc)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def gather(home: Path, model: str) -> Facts:
    """The facts doctor.py checks, read from this machine and `home` (nothing written)."""
    import psutil

    from ..net.identity import KEY_FILE
    from .api.auth import TOKEN_FILE

    required, pinned = _package_pins()
    torch_version, cuda_device, gpu_free_mb = _torch()
    needs, problem = model_needs(home, model)
    node, node_status, node_problem = _running_node(home)
    try:
        api_port = int(load_toml(home).get("node", {}).get("api_port", DEFAULT_API_PORT))
    except (CompushareError, TypeError, ValueError):
        api_port = DEFAULT_API_PORT
    return Facts(
        python=tuple(sys.version_info[:3]), python_required=required, torch_version=torch_version,
        torch_expected=pinned, cuda_device=cuda_device, gpu_free_mb=gpu_free_mb,
        ram_free_mb=psutil.virtual_memory().available // 2**20,
        disk_free_mb=shutil.disk_usage(_existing(home)).free // 2**20, model=needs, model_problem=problem,
        data_dir=str(home), data_dir_exists=home.is_dir(), data_dir_writable=os.access(home, os.W_OK | os.X_OK),
        token_mode=_mode(home / TOKEN_FILE), key_mode=_mode(home / KEY_FILE), node=node, node_status=node_status,
        node_problem=node_problem, api_port=api_port, port_taken=node is None and _port_taken(api_port))


def doctor(
    model: str = typer.Option(None, help="The model to check memory and disk against (default smollm2-135m)."),
    data_dir: Path = DATA_DIR,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Check this machine and data dir: Python, torch, device, memory and disk for a
    model, the node's reachability and API, and the data dir's permissions. One
    verdict per line (ok, warn, FAIL) with what to do; exits 1 when one fails."""
    from ..model.catalog import DEFAULT_MODEL

    home = resolve_data_dir(data_dir)
    checks = []

    def check() -> None:
        checks.extend(run_checks(gather(home, model or DEFAULT_MODEL)))
        if as_json:
            print(json.dumps({"ok": not failed(checks), "checks": [c.__dict__ for c in checks]}, indent=2))
        else:
            for found in checks:
                out.print(found.line(), highlight=False, markup=False)

    run_or_exit(check)
    if failed(checks):
        raise typer.Exit(1)
