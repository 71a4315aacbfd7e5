"""The OpenAI-compatible API of the generating models (issue 40): ``POST /v1/completions``,
``POST /v1/chat/completions`` (plain and ``"stream": true``), ``GET /v1/models``. Each request
goes through the one data plane (``serving.protocols.dataplane.generate``, by
``serving.protocols.rest.serve_openai``); only the body's shape and the errors' are OpenAI's.
"""
