"""Everything libp2p.

  libp2p_patches.py  every change to py-libp2p's own code (checks its version)
  host.py       the only caller of new_host (TCP + Noise + yamux), logging taming
  peer.py       the seam every process starts with: host + DHT + bootstrap
  dial.py       multiaddr strings to a PeerInfo, and one dial
  serve.py      stream handlers with per-peer (and total) stream caps
  identity.py   the node's persistent Ed25519 key in its data dir
  codec.py      pure: length-prefixed msgpack frames and raw tensors
  framing.py    async framed reads/writes on a libp2p stream, with deadlines
  signed.py     pure: owner-signed envelopes, and their DHT validator
  records.py    pure: signed server records (wire format, validation, selection)
  dht.py        Kademlia DHT: strict validators, provider keys, record put/get
  store_bounds.py  pure: what the DHT stores for others (bytes, per publisher, TTL)
  limits.py     pure: per-peer token buckets
  ads.py, view.py, gossip.py  capability ads, the swarm view (evidence before
                newcomers), GossipSub
"""
