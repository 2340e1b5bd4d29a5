"""Training data: the trajectory store (store.py: atomic ArrayRecord shards), the grain pipeline from trajectories
to sharded training batches (pipeline.py), and the trainer's earlier step pipeline (steps.py)."""
