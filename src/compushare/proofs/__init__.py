"""Signed evidence: what peers sign about the work they do, and the failure reports
anyone can check that two such signed answers make when they conflict. Karma counts
the reports; the pipeline and DiLoCo sign and check the statements.

  reports.py    pure: every kind of failure report read from anyone (parse_report, Report)
  inference.py  pure: step proofs (digests, the input chain, the signed statement),
                the formats' tolerances, step failure reports
  training.py   pure: /compushare/train's signed forwards and backwards, their failure reports
  private.py    pure: private mode's signed products and failure reports
  diloco.py     pure: DiLoCo's signed contributions and recomputations, their failure reports
  fields.py     pure: what every kind shares: digest and signature sizes, signing,
                parsing a report's fields from anyone
"""
