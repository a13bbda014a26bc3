"""A hybrid model's recurrent layers: a state slot per request beside the paged K/V, and the mixers' own code
called per request group."""
