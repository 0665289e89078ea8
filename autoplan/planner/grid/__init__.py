"""The uniform grid planner: every (pp, dp, tp, cp, ep) x ZeRO x recomputation x schedule
configuration priced by the Estimator (:mod:`.estimate`) and ranked (:mod:`.uniform`)."""
