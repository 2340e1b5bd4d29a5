"""Training data: trajectory stores and the grain pipeline from trajectories to batches."""
