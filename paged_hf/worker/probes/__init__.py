"""What a model is and whether the engine computes it exactly: its layers read off one forward, then the engine
checked against the model's own forward (exact or refused)."""
