"""Glue to the HF ecosystem: transformers (the attention function), peft (LoRA), accelerate (device maps)."""
