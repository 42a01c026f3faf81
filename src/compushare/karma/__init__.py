"""Karma: each peer's contribution, kept in the DHT, signed and checkable by anyone.
Karma never gates access: no module may refuse service for low karma.

  receipts.py  pure: a consumer's signed statement of what a server computed for it,
               countersigned by the server
  merkle.py    pure: a Merkle tree over a ledger's receipts (RFC 6962 hashing)
  record.py    pure: the karma DHT record (a commitment to the receipts) and its validators,
               handed to net.dht.open_dht at start-up
  rules.py     pure: which receipts count, how much, and the score
               (1 + log(1 + compute ms), x0.95 per verified failure report)
  ledger.py    the node's own evidence on disk: countersigned receipts, failure reports
  service.py   /compushare/karma/1.0.0, publishing the record, reading anyone's score
"""
