"""The wire protocols, one folder each (``tfserving``, ``v2``): a body to arrays checked against
the model's signature and back, on ``serving.http``'s predict path. They do not import each
other, nor the server above them: a model reaches them as a ``serving.http.model.ModelHandle``."""
