"""Model families whose attention or states need code of their own in a step, one module per family (or per
mechanism shared by several); `registry.py` is what the model probe and the model runner ask."""
