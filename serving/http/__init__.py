"""One request path: uvicorn's protocol (``protocol``), the fast routes and their raw request
(``fast``), the answer helpers both paths use (``replies``), admission from the headers
(``admission``), what a route needs of a served model (``model``) and the predict path the
protocols share (``predict``). Imports nothing of the protocols or the server above it."""
