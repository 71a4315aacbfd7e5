"""The tiny generating models of tests/generation_models.py, shared with the front end's tests."""

from tests.generation_models import gpt2_greedy, gpt2_preset, llama_greedy, llama_preset

__all__ = ["gpt2_greedy", "gpt2_preset", "llama_greedy", "llama_preset"]
