"""compushare.pipeline.client: the consumer's side of /compushare/infer.

  chain.py          InferenceChain, open_chain: the trio driver performing the core's actions
  chain_core.py     ChainCore: the chain's pure state machine (open, steps, failover); its summary
  chain_machine.py  the core's state and request/answer plumbing (pure)
  chain_rebuild.py  replacements for a failed span: plan, open, replay (pure)
  chain_checks.py   spot checks, third opinions, blame (pure)
  chain_events.py   the actions the core emits and the events it is fed (pure data)
  chain_plan.py     History, replay and catch-up plans, judge, failure reports (pure)
  hop.py            RemoteHop, open_hop: one session's stream, deadlines, retries, receipts
  routing.py        plan_route: the fastest chain of servers through the blocks (pure)
  spotcheck.py      which steps are checked; penalties for failing peers (pure)
  discovery.py      the DHT look-ups: the servers of a model
  measure.py        round trips to candidate servers
  consumer.py       Consumer: join the swarm, keep candidates fresh, route, generate
  generate.py       the generation loop (embeddings and LM head stay local)
  sampling.py       greedy / temperature / top-p sampling with a seeded generator
  detokenize.py     streaming text from tokens
  private_chain.py  private mode: every layer here, its products encrypted on the providers

Where later features plug into the core (each a new request, event or state):
- direct return (server → server → consumer, with a chain of step proofs): a second
  way through the hops in ChainCore._enter_hop, one request to the first hop and one
  answer (output and proofs) from the last; replays first fetch a boundary's history
  from the servers holding it (a new request); `--no-direct` keeps today's relay path.
- speculative decoding: a `rollback(position)` operation cutting the history (sizes,
  every boundary's inputs, verifiers' `fed`) and emitting a Truncate per live session.
- batching: one ChainCore per sequence; a driver groups their SendSteps per server.
- standby replicas: sessions kept caught up like verifiers (catch_up_plan); a failover
  takes a caught-up one before `_rebuild`, with no replay.
- relayed hops (NAT): in hop.py (how a session is reached) and private_chain.py alike.
"""
