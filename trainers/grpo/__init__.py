"""The GRPO family: the trainer, its losses, rollouts, reward functions, data order, batch layout,
config section and stage."""
