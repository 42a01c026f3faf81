"""BitTorrent-style model distribution (a later issue).

Will hold the manifest (piece hashes, which tensors each piece holds; its hash is
the model id of model/store.py), the pure piece picker (random first, rarest
first, endgame), the verified on-disk piece store and the piece exchange protocol.
"""
