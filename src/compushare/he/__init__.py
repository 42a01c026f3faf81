"""CKKS private stages with TenSEAL (a later issue).

Will hold context and key management and encrypted linear projections, with the
consumer applying the nonlinear parts; see DESIGN.md §5 for the measured costs.
"""
