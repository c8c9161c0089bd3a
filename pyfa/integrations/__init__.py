"""Glue between pyfa and other libraries. Each submodule imports its library
only when used, so ``import pyfa`` never needs them:

- :mod:`pyfa.integrations.transformers`: pyfa as a Hugging Face transformers
  attention implementation (``register()``, then ``attn_implementation="pyfa"``).
- :mod:`pyfa.integrations.torch_ops`: pyfa's decode as a torch operator
  (``torch.ops.pyfa.decode_attention``) for code that ``torch.compile`` traces.
"""
