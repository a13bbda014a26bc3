"""Blocks and scheduling: block pool, KV-cache manager, scheduler, request. Bookkeeping only, no torch math."""
