"""On-policy distillation: the trainer, its config section and the stage."""
