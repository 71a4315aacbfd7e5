"""Generating text (issue 39, the front end): the iteration-level scheduler over the back end's
``GenerationReplica`` objects (``shards.generation``), the tokenizer that reads a preset's
assets, and what a generate request asks. No TensorFlow, Keras or Ray here (an import contract
says so): the model runs in the back end's stage actors.
"""
