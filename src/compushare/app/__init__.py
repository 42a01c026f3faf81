"""The surfaces users meet; everything below (pipeline, torrent, karma, net, model)
knows nothing of them.

  cli.py, cli_swarm.py, cli_models.py, cli_finetune.py, cli_train.py, cli_doctor.py, cli_common.py
               the typer command line: run, chat, node, status, karma, id, swarm, models, finetune, train, doctor
  doctor.py    `compushare doctor`'s checks, pure: facts in, verdicts (ok, warn, FAIL) out
  chat.py      `compushare chat`: the interactive consumer REPL
  node.py      the daemon: one trio nursery owning every task of a node
               (provider, seeder, karma, gossip, the HTTP API), started in phases
  startup.py   the parts of a node's start-up that need no Node: the model asked
               for, its ad, the self-benchmark, the span's memory, the first span
  history.py   pure: the dashboard's charts' data: samples of a node's counters, kept 10 minutes
  debug.py     fault injection for tests (a slow, lying or forging node): the --debug-* flags
  seed.py      the torrent role on its own: `models fetch`, `models seed`
  progress.py  progress of long work (fetch, import, conversion): a rich bar on a
               terminal, a line per tenth otherwise
  status.py    `compushare status` and `compushare karma`
  swarm.py     a local swarm of node processes on 127.0.0.1
  tray.py      the system-tray icon
  api/         the daemon's local HTTP API: OpenAI-compatible chat completions,
               the control API and the dashboard
"""
