"""The `paged-hf` command line: generate, serve, bench, eval-ppl."""
