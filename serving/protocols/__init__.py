"""The wire protocols, one folder each (``tfserving``, ``v2``): a body to arrays checked against
the model's signature and back, on the one data plane every protocol and transport calls
(``dataplane``; over HTTP ``rest``), with a ragged request's rows (``ragged``) and the limits of
a request (``limits``). They do not import each other, nor the server above them: a model
reaches them as a ``serving.protocols.contract.ModelHandle``."""
