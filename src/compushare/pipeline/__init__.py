"""Inference sessions across a chain of peers.

  protocol.py   protocol id and message shapes of /compushare/infer/1.3.0 (pure)
  session.py    pure session table: admission (KV budget), step ordering, expiry
  server.py     the provider: serves a span over libp2p, compute in worker threads
  push.py       server-to-server pushes: the next hop starts before the consumer's copy
  announce.py   keeps this provider's DHT server record and provider records fresh
  discovery.py  the consumer's DHT look-ups: servers of a model, concurrently
  routing.py    pure: choose a chain of servers covering every block
  proofs.py     pure: signed step outputs, running input digests, failure reports
  spotcheck.py  pure: which steps are re-computed elsewhere; peers to avoid (backoff)
  client.py     the consumer's side: a chain of sessions that fails over and spot-checks
  sampling.py   greedy / temperature / top-p sampling with a seeded generator
  generate.py   the consumer's generation loop (embeddings and head stay local)
  detokenize.py streaming text from tokens, a line at a time
  consumer.py   a consumer: join, keep candidate servers fresh, route, generate
"""
