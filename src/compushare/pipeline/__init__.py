"""Inference sessions across a chain of peers, over /compushare/infer/1.5.0.

  protocol.py   the protocol id, session id size and error codes
  messages.py   every request and reply as a typed message; decoded once, at the edge (pure)
  message_parts.py  their parts: a hidden state on the wire, a downstream, a step proof (pure)
  adapter_wire.py  a LoRA adapter on the wire, decoded and checked; the per-peer adapter cache
  private_wire.py  /compushare/private/2.0.0: encrypted projections (private mode), its messages (pure)
  train_messages.py  /compushare/train/1.0.0: training forwards and backwards, its messages (pure)
  adapter_wire.py  a LoRA adapter on the wire (checked), and the adapters a server holds per peer
  client/       the consumer's side: a chain of sessions that fails over and spot-checks
  server/       the provider's side: a session core and the driver serving a span of blocks
"""
