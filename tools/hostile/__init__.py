"""Hostile peers of the project's own, for the hostile-load tests and bench/hostile.py.

Each attacker is a libp2p host with a fresh Ed25519 identity that speaks a
CompuShare protocol correctly but greedily, at the limits a node grants one peer.
`infer.py`: a KV hog that keeps prefilling 1,024 tokens at a time.
`window.py`: writes past receive windows; parks answered and unnegotiated streams of unread data.
"""
