"""Runs the model on one step: step inputs, `PagedCache` and its books, the step's swaps, cache sizing, model
facts; the families, hybrid states, fast paths, KV tier and probes in folders of their own."""
