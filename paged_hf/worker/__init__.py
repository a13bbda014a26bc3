"""Runs the model on one step: step inputs, `PagedCache`, packed linears, cache sizing, model facts."""
