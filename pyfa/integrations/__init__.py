"""Glue between pyfa and other libraries. Each submodule imports its library
only when used, so ``import pyfa`` never needs them:

- :mod:`pyfa.integrations.transformers`: pyfa as a Hugging Face transformers
  attention implementation (``register()``, then ``attn_implementation="pyfa"``).
"""
