"""The OpenAPI document (``document``): fixed bodies as the pydantic models the routes answer
through (``bodies``, ``v2_bodies``), the request bodies of the served model, built per signature
(``tfserving``, ``v2``)."""
