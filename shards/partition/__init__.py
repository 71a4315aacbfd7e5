"""Cutting a Keras model into stages: its layer graph (nested models flattened, masks carried
across a cut), the plan of where to cut (balanced or within memory budgets), the memory plan of
each stage, and the cut itself into a bundle; plus the demo models."""
