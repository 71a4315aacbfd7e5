"""The model repository on disk, pure (no FastAPI, Ray or TensorFlow): which model directories
and complete versions there are (``layout``), each model's ``config.toml`` and the settings a
version is served with (``model_config``), and which versions a model serves (``policy``).
The manager that loads and unloads them is ``serving.repository.manager``.

Nothing is re-exported here: importers name the module (``serving.repository.layout``), which
keeps the chain of module-level imports short (tests/layout)."""
