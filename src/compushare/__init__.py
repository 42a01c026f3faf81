"""CompuShare: peer-to-peer LLM inference over libp2p.

Package map:
  cli.py       typer commands: parse, then call into the packages below
  config.py    frozen configuration dataclasses, data-dir resolution, TOML
  errors.py    the CompushareError tree
  node.py      Node.run(): the one trio nursery wiring a node's roles
  swarm.py     a local swarm of node processes on 127.0.0.1 (demo, tests)
  net/         libp2p: identity, host, framed codec, DHT records and validators
  model/       catalog of names, weight sources and the store, span runner
  pipeline/    inference sessions: server (provider), client (consumer), routing
  torrent/     BitTorrent-style weight distribution (later issue)
  karma/       contribution ledger (later issue)
  he/          CKKS private stages (later issue)
"""

__version__ = "0.1.0"
