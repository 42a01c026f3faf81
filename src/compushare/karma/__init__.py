"""Karma: a contribution ledger kept in the DHT (a later issue).

Will hold signed per-session receipts (consumer-signed, server-countersigned),
owner-signed ledger records that commit to their receipts, and the pure scoring
rules (karma = 1 + log(1 + compute ms), x0.95 per verified failure report).
Karma never gates access: no module may refuse service for low karma.
"""
