"""`compushare models ...`: the local model store, and fetching and seeding models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..config import NodeConfig, Span, resolve_data_dir
from ..errors import UsageError
from .cli_common import BOOTSTRAP, DATA_DIR, SWARM_HOME, bootstrap_for, command_app, err, run_or_exit, setup_logging
from .progress import Progress

models_app = command_app("The local model store.")


def _held(model) -> str:
    """What of a model this node holds, e.g. "all", "blocks 10-19", "head, blocks 0-4"."""
    held = model.held_files()
    if held == set(range(len(model.manifest.files))):
        return "all"
    blocks = model.held_blocks()
    runs, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            runs.append(f"{start}" if start == b else f"{start}-{b}")
            start = None
    parts = (["head"] if model.holds(head=True) else []) + ([f"blocks {', '.join(runs)}"] if runs else [])
    return ", ".join(parts) or "manifest only"


@models_app.command("list")
def models_list(data_dir: Path = DATA_DIR, as_json: bool = typer.Option(False, "--json")) -> None:
    """Models in the local store (and what of each this node holds), and the catalog."""
    from ..model.catalog import CATALOG
    from ..model.store import ModelStore

    stored = ModelStore(resolve_data_dir(data_dir)).list()
    if as_json:
        print(json.dumps([{"names": n, "id": m.model_id, "blocks": m.num_blocks, "dtype": m.dtype,
                           "format": m.format.label, "block_bytes": m.block_bytes,
                           "bytes": m.manifest.total_bytes, "held_blocks": m.held_blocks(),
                           "holds_head": m.holds(head=True)} for n, m in stored]))
        return
    table = Table("names", "id", "blocks", "format", "size", "held here")
    for names, m in stored:
        table.add_row(", ".join(names), m.model_id[:16], str(m.num_blocks), m.format.label,
                      f"{m.manifest.total_bytes / 1e6:.1f} MB", _held(m))
    Console().print(table)
    for entry in CATALOG.values():
        print(f"catalog: {entry.name:14} {entry.description}")
    print("any of them as NAME@FORMAT (int8, q4, q4/g32, bf16; @gguf: a GGUF's own tensors), e.g. "
          "smollm2-135m@q4")


@models_app.command("fetch")
def models_fetch(
    model: str = typer.Argument(..., help="Model id (64 hex digits): names are local only."),
    blocks: str = typer.Option(None, help="Fetch only these blocks, e.g. 10:20."),
    head: bool = typer.Option(False, "--head", help="Fetch only what a consumer needs (embeddings, LM head, "
                                                    "tokenizer); with --blocks, those too."),
    name: str = typer.Option(None, help="Alias for the model."),
    data_dir: Path = DATA_DIR,
    bootstrap: list[str] = BOOTSTRAP,
    swarm_home: Path = SWARM_HOME,
    upload_limit_kbps: float = typer.Option(None, "--upload-limit", help="Seeding limit while fetching, KB/s."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (no progress bar)."),
    log_level: str = typer.Option("warning"),
) -> None:
    """Fetch a model (or a span of it) from the swarm's seeders, verifying every piece."""
    import trio

    from ..model.store import is_model_id
    from .seed import fetch_from_swarm

    setup_logging(log_level)
    home = resolve_data_dir(data_dir)

    def do():
        if not is_model_id(model):
            raise UsageError(f"{model!r} is not a model id: peers know models by id only "
                             "(`compushare status` lists the swarm's)")
        span = Span.parse(blocks) if blocks else None
        boot = bootstrap_for(home, bootstrap, swarm_home)
        what = f"blocks {span} of" if span else "the head of" if head else ""
        with Progress(f"fetching {what} {model[:12]}".replace("  ", " "), enabled=not as_json) as shown:
            result = trio.run(lambda: fetch_from_swarm(
                home, boot, model, blocks=(span.start, span.end) if span else None, head=head,
                everything=span is None and not head, progress=shown.update, alias=name,
                upload_limit=upload_limit_kbps * 1000 if upload_limit_kbps else None))
        if as_json:
            print(json.dumps(dataclasses.asdict(result)))
            return
        err.print(f"fetched {result.pieces} pieces ({result.bytes / 1e6:.1f} MB) in {result.seconds:.1f}s, "
                  f"{result.rate_mbps:.1f} MB/s; {result.already_held} were already here")
        for peer, count in sorted(result.bytes_from.items(), key=lambda kv: -kv[1]):
            err.print(f"  {peer}: {count / 1e6:.1f} MB", highlight=False)
        for peer in result.banned:
            err.print(f"  [red]banned[/red] {escape(peer)}: sent corrupted pieces")

    run_or_exit(do)


@models_app.command("seed")
def models_seed(
    models: list[str] = typer.Argument(None, help="Models to seed (default: every model stored)."),
    data_dir: Path = DATA_DIR,
    listen: list[str] = typer.Option(None, help="Listen multiaddr (repeatable)."),
    bootstrap: list[str] = BOOTSTRAP,
    upload_limit_kbps: float = typer.Option(None, "--upload-limit", help="Upload limit over all peers, KB/s."),
    log_level: str = typer.Option("info"),
) -> None:
    """Seed models to the swarm without serving inference (runs in the foreground)."""
    import trio

    from .seed import seed_forever

    setup_logging(log_level)
    home = resolve_data_dir(data_dir)
    config = NodeConfig.build(home, listen=listen, bootstrap=bootstrap)
    run_or_exit(lambda: trio.run(lambda: seed_forever(
        home, listen=config.listen, bootstrap=config.bootstrap, models=models or None,
        upload_limit=upload_limit_kbps * 1000 if upload_limit_kbps else None)))


@models_app.command("import")
def models_import(path: Path, name: str = typer.Option(None, help="Alias for the model."),
                  fmt: str = typer.Option(None, "--format",
                                          help="Weight format: fp32, bf16, int8, q4 (4-bit, groups of 64), q4/g32, "
                                               "q4/g128; or gguf: keep a GGUF file's own tensors as they are. "
                                               "Default: the source's own (a GGUF's tensors kept, streamed; "
                                               "another format dequantizes it whole through transformers)."),
                  data_dir: Path = DATA_DIR,
                  as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (no progress bar).")
                  ) -> None:
    """Import a safetensors / Hugging Face directory or a GGUF file (prints its id).
    A model of a family no node serves is refused before anything is stored."""
    from ..model.catalog import import_path

    def do():
        with Progress(f"importing {path.name}", enabled=not as_json) as shown:
            model = import_path(path, resolve_data_dir(data_dir), alias=name, progress=shown.update,
                                on_stage=lambda stage: shown.stage(f"{stage} {path.name}"), fmt=fmt)
        if as_json:
            print(json.dumps({"model_id": model.model_id, "name": name, "num_blocks": model.num_blocks,
                              "format": model.format.label,
                              "bytes": sum(f.size for f in model.manifest.files)}))
        else:
            print(model.model_id)

    run_or_exit(do)
