"""SFT: its config section, its trainer (``transformers.Trainer`` with packed epochs) and stage."""
