"""Training data: the trajectory store (store.py: atomic ArrayRecord shards) and the grain pipeline from
trajectories to sharded training batches (pipeline.py)."""
