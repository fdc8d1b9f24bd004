"""Example models that users and tests compile: a nanoGPT-style GPT, an MLP and a small CNN."""
