"""One request path: uvicorn's protocol (``protocol``), the fast routes and their raw request
(``fast``), the answer helpers both paths use (``replies``) and admission from the headers
(``admission``). Imports nothing of the protocols or the server above it: the predict path they
share is the data plane (``serving.protocols.dataplane``, over HTTP ``serving.protocols.rest``),
and what a route needs of a served model is its contract (``serving.protocols.contract``)."""
