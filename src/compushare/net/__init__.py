"""Everything libp2p.

  identity.py   the node's persistent Ed25519 key in its data dir
  host.py       the only caller of new_host (TCP + Noise + yamux), logging taming
  codec.py      pure: length-prefixed msgpack frames and raw tensors
  framing.py    async framed reads/writes on a libp2p stream, with deadlines
  records.py    pure: signed server records (wire format, validation, selection)
  dht.py        Kademlia DHT: strict validators, provider keys, record put/get
"""
