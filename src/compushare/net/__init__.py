"""Everything libp2p.

  libp2p_patches.py  the changes to py-libp2p's own code (checks its version); dht.py and
                gossip.py patch their own classes where they use them
  host.py       the only caller of new_host (TCP + Noise + yamux), logging taming
  peer.py       the seam every process starts with: host + DHT + bootstrap
  dial.py       multiaddr strings to a PeerInfo, and one dial
  serve.py      stream handlers with per-peer (and total) stream caps
  identity.py   the node's persistent Ed25519 key in its data dir
  codec.py      pure: length-prefixed msgpack frames and raw tensors
  tensors.py    pure: tensors on the wire (dtype, shape, little-endian bytes)
  dtypes.py     pure: the wire's dtypes by name, torch-free
  framing.py    async framed reads/writes on a libp2p stream, with deadlines
  signed.py     pure: owner-signed envelopes, and their DHT validator
  records.py    pure: signed server records (wire format, validation, selection)
  dht.py        Kademlia DHT: strict validators, provider keys, record put/get
  store_bounds.py  pure: what the DHT stores for others (bytes, per publisher, TTL)
  limits.py     pure: per-peer token buckets
  ads.py, view.py, gossip.py  capability ads, the swarm view (evidence before
                newcomers), GossipSub (a topic per model)
  directory.py  the swarm beyond the models a node follows, pulled for its UI only
  ad_intake.py  pure: ad topics per model, the ad period stretched by a topic's size,
                early drops and the cache of checked ads
  scale_model.py  pure: membership cost per node at scale, from measured unit costs
  reachability.py  pure: whether this node can be dialled, and how peers reach it if not
  traversal.py  NAT traversal for one host: AutoNAT, relay reservations, hole punching
  relayed_dialers.py  which host dials NAT'd peers through whom (dial reads it, traversal registers)
  hole_punch.py  DCUtR hole punching that dials only the punched peer's own addresses
  punch_budget.py  pure: how many hole punches (per peer) and dials (in all) a node makes
  relay.py      circuit relay v2 with CompuShare's quotas
  relay_quota.py  pure: a relay's quotas (reservations, circuits, bytes, time)
"""
