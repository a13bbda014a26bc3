"""Getting a model: the default model shipped on PyPI, `load_model`, and the device and dtype to load it in."""
