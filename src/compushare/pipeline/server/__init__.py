"""The provider side: serving a span of a model's blocks over /compushare/infer.

  session.py      pure core: each session's state machine (one TRANSITIONS table), admission by KV budget
  kv_share.py     pure: max-min fair shares of the KV budget among peers
  scheduler.py    pure: who computes next: fair among peers, decode steps first
  receipts.py     pure: the audit a consumer's receipt passes before this server countersigns it
  inference.py    InferenceServer, the thin trio driver: limits, decoded requests to the core, replies
  streams.py      an infer stream: frames in order, one reply each, idle and oversized streams closed
  adapters.py     sessions' LoRA adapters: decoded at open, kept with the session, bounded in memory
  compute.py      where a step's forward runs (worker thread or event loop) and the load it measures
  pushed.py       trio glue of pushes: pushed steps computed in the background, outputs pushed on
  push.py         the outbound push streams to downstream servers (one per server, dialled lazily)
  provider.py     the node's provider: which span it serves, loading and moving between spans
  placement.py    pure: which span of blocks the swarm needs this server to hold
  announce.py     keeps this provider's DHT server record and provider records fresh
  private.py      /compushare/private: a peer's encrypted products, within fair shares
  private_worker.py  the HE worker process: CKKS parsing and its share of each product
  private_pool.py    the node's HE worker processes (one per compute thread) and how their shares join
  training.py     /compushare/train: stateless training forwards and backwards, within fair shares

How the features sit in the core (each a state, an event or a module of its own):
- Fair shares: admission by KV budget and per-peer shares in SessionTable.open
  (kv_share.py); the scheduler orders begun steps decode-first and fair among peers,
  slicing a prefill's chunks (`StepRequest.sizes`) the core still sees as one step.
- Direct return: a pushed step (COMPUTING_PUSH, then PUSH_COMPUTED) settled against
  the consumer's by CONFIRM or MISMATCH; a consumer's rollback for rejected drafts is
  TRUNCATE (READY only, after DISCARD).
- Relayed hops: a transport matter (push.py dials, streams.py serves); the core sees
  the same events whoever carried them.
- Weight formats: SpanRunner's business (model/); the driver only swaps runners
  (replace_runner, which CLOSEs every session by drop_all).
"""
