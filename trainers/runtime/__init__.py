"""What a training process runs with: Trainer callbacks, resumable checkpoints, the divergence
error, launched processes and their fast exit, metric windows, work split over processes and
sharded parameters."""
