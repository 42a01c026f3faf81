"""Training a model together: DiLoCo rounds averaged peer to peer. Each participant runs
H inner AdamW steps from the shared outer weights; the round's participants find each
other through the DHT, average their pseudo-gradients with an int8 butterfly all-reduce
over /compushare/diloco streams, and apply the same outer Nesterov SGD step.

  recipe.py     pure: the run's recipe (model shape, corpus digest, inner/outer settings) and its checked wire form
  corpus.py     pure: the byte-level corpus, its train/eval split, and the public-seed minibatch sampler
  run.py        pure: the run's signed record (/csrun/<run_id>, run_id = its hash) and its DHT validator
  group.py      pure: the round's DHT key, leader tickets, part owners, the round's checks
  messages.py   pure: the /compushare/diloco messages, checked field by field
  quant.py      pure: int8 parts with fp32 scales per 256 values, and their wire form
  parts.py      pure: cutting a vector into the all-reduce's parts
  aggregate.py  pure: mean and CenteredClip (robust to a minority of bad contributions)
  inner.py      the model, one participant's round of inner steps, the outer optimizer, eval, the one-process baseline
  weights.py    the outer state (weights, momentum) as stored models, seeded through the torrent layer
  allreduce.py  the butterfly all-reduce: owner slots, sending parts, retrying without failed owners
  rounds.py     group formation: announce in the DHT, the lowest ticket leads, join, close
  service.py    the /compushare/diloco handler (state, join, part, report)
  checks.py     re-running another's round; failure reports; judging a report by re-running it
  sync.py       a joiner's way to the current outer state (ask, vote, fetch, verify)
  participant.py  the loop of rounds, karma receipts, the participant's state file
  train_node.py   a participant's process: one host, one nursery
"""
