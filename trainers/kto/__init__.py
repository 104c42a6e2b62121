"""KTO: the trainer, its rows (with their KL completions and reference view), its config section and the stage."""
