"""Images in a prompt: the vision families (which model, which placeholder token, how its vision tower and projector
run), a prompt with images turned into token ids and `core.multimodal.MultiModalItem`s (`prompts.py`), and a step's
input embeddings with the images' features over their placeholders (`embeddings.py`).

It sits between `sample/` and `worker/`: the model runner asks it for a step's embeddings, the engine for a prompt's
items; it knows the scheduler's requests (`core/`) and nothing above.
"""
