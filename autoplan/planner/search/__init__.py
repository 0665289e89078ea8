"""The Alpa-style search: DTensor strategies per op (:mod:`.strategies`, :mod:`.kinds`), the
intra-op ILP (:mod:`.intra_op`) inside the inter-op stage DP (:mod:`.inter_op`), driven by
:mod:`.search`; :mod:`.to_plan` writes its plan."""
