"""CompuShare: peer-to-peer LLM inference over libp2p.

Package map, top layer first (each imports only the layers below it; the contracts
in pyproject.toml's [tool.importlinter] are checked by `make test`):
  app/         the surfaces: cli, chat, tray, status, swarm, node, seed, api/
  pipeline/    inference sessions: server/ (provider) and client/ (consumer), which
               never import each other, over the shared protocol
  diloco/      training a model together: DiLoCo rounds averaged peer to peer
  torrent/     BitTorrent-style weight distribution
  karma/       contribution ledger, karma records and the karma protocol
  proofs/      signed evidence: step proofs, training's, private mode's and DiLoCo's
               signed statements, and the failure reports anyone can check
  spans/       what computes a span: the torch runtime (model/) or ggml's (GGUF files, as llama.cpp)
  net/         libp2p: patches, host, the swarm seam, dialling, serving, DHT, gossip
  model/       catalog of names, weight sources, the store and its manifests, the
               span runner and the consumer's head
  he/          CKKS homomorphic encryption for private mode
  runtime.py, gc_policy.py, malloc_policy.py, config.py, hardware.py, defences.py,
  errors.py    the base modules
  __main__.py  `python -m compushare`: the command line
  wire.py      pure: every name on the wire (protocol ids, the ad topic, DHT keys, error codes)
"""

__version__ = "0.1.0"
