"""Integrations with training frameworks (Hugging Face, Lightning, PyTorch DCP).

Each module imports its framework lazily, inside the functions and classes that need it, so that
``import tierstate`` never pulls in a framework; the framework itself installs with an extra
(``pip install tierstate[hf]``, ``tierstate[lightning]``).
"""
