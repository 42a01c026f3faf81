"""Inference sessions across a chain of peers.

  protocol.py   protocol id and message shapes of /compushare/infer/1.0.0 (pure)
  session.py    pure session table: admission (KV budget), step ordering, expiry
  server.py     the provider: serves a span over libp2p, compute in worker threads
  announce.py   keeps this provider's DHT server record and provider records fresh
  discovery.py  the consumer's DHT look-ups: servers of a model, concurrently
  routing.py    pure: choose a chain of servers covering every block
  client.py     the consumer's side of the protocol: one stream per hop
  sampling.py   greedy / temperature / top-p sampling with a seeded generator
  generate.py   the consumer's generation loop (embeddings and head stay local)
  detokenize.py streaming text from tokens, a line at a time
  consumer.py   a short-lived consumer: join, discover, route, generate
"""
