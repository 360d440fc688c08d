"""Optimizers for low-rank models: LORO (:mod:`boost_hf.optim.loro`) and its exact step under tensor parallelism
(:mod:`boost_hf.optim.low_rank_retraction`)."""
