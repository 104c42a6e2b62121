"""The DPO family: the trainer, its config section, the preference losses and the stage."""
