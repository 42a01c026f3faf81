"""compushare.pipeline.client: the consumer's side of /compushare/infer.

  chain.py          InferenceChain, open_chain: the trio driver performing the core's actions
  chain_core.py     ChainCore: the chain's pure state machine, its (phase, event kind) table; its summary
  chain_state.py    the chain's state and what every transition does with it (pure)
  chain_steps.py    a step hop by hop: links, each hop's request and answer, receipts (pure)
  chain_direct.py   direct steps: every hop at once, answers taken while proofs link (pure)
  chain_rebuild.py  opening a route; failover: a standby takes over, or plan, open, replay (pure)
  chain_checks.py   spot checks, third opinions, blame (pure)
  chain_standby.py  standby replicas: a second session per span, fed every step (pure)
  chain_events.py   the actions the core emits, the events it is fed, its phases (pure data)
  chain_plan.py     History, replay and catch-up plans, judge, failure reports (pure)
  hop.py            RemoteHop, open_hop: one session's stream, deadlines, retries, receipts
  deadlines.py      a step's deadline from the hop's pace; whether a late step is waited for (pure)
  adapters.py       a LoRA adapter as the hops need it: each span's slice on the wire, its digest
  routing.py        plan_route: the fastest chain of servers through the blocks (pure)
  planner.py        SwarmPlanner: candidate servers kept fresh (DHT, ads, pings), planned into routes
  spotcheck.py      which steps are checked; penalties for failing peers (pure)
  names.py          which model ids the swarm serves under a name, and which to use (pure)
  discovery.py      the look-ups: the servers of a model (DHT), the model served under a name
  measure.py        round trips to candidate servers
  consumer.py       Consumer: join the swarm for a model (head, tokenizer), generate; run_prompt
  generate.py       the generation loop (embeddings and LM head stay local)
  speculative.py    lossless speculative decoding: drafts, their verification, draft length (pure)
  sampling.py       greedy / temperature / top-p sampling with a seeded generator
  grammar.py        constrained decoding: a grammar's mask over the vocabulary (llguidance), drafts it forbids
  detokenize.py     streaming text from tokens
  stops.py          stop sequences over streamed text, across token boundaries (pure)
  produced.py       what a generation hands out: tokens, their text, log-probabilities, why it ended
  private_chain.py  private mode: every layer here, its products encrypted on the providers
  private_session.py  one provider's private session: handshake, requests, the waits of 2.1.0
  private_reports.py  private mode's signed replies checked, a mismatch's failure report (pure)
  train_hop.py      one training session's stream to a server: forwards, backwards, signed answers, receipts
  swarm_trainer.py  SwarmTrainer: a step's microbatches pipelined through the spans, failover, spot checks
  finetune.py       `compushare finetune`'s loop: data, evaluation, checkpoints, resume

What the core does besides stepping through the hops, each feature a request, an
event or a state of its own: direct return (one request to the first hop, the output
and the chained step proofs from the last; `--no-direct` relays each step through the
consumer); speculative decoding (`rewind` cuts the history and rolls each session
back); spot checks (a verifier per sampled step, an arbiter on a disagreement, a
failure report); standby replicas (fed like verifiers, taking over a failed span with
no replay). Batching is the servers' (many sessions' decode steps in one forward);
relayed hops (NAT) are hop.py's and private_chain.py's (how a session is reached).
"""
