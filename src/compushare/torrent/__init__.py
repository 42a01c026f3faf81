"""BitTorrent-style model distribution over /compushare/pieces/1.0.0: a model's files
cut into pieces named by their hashes in the manifest (model/manifest.py), fetched
from many seeders at once, verified, and seeded on.

  picker.py    pure: which piece to ask which peer for (random first, rarest first, endgame)
  protocol.py  pure: the pieces protocol's messages, constructors and checks
  storage.py   a model's files on disk, filled piece by piece and verified
  seeder.py    the seeding side: serve the pieces this node holds, per-peer guarded
  fetch.py     the downloading side: pieces from many seeders at once
  service.py   a node's torrent role: seed every model it holds, find seeders, fetch
"""
