"""The Decoupling-BEiT-3 dual encoder: the Flax model, official checkpoint conversion, tokenizer, encoders."""
