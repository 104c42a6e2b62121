"""SFT: its config section and stage (the trainer is ``transformers.Trainer``)."""
