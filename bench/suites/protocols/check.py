"""Before any load: one request per HTTP protocol, and their answers must agree.

A benchmark that measured fast 400s, or answers that differ between protocols, would compare
nothing; this reads each protocol's answer as its client would and compares the numbers.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import numpy as np
import orjson

from loadtest.bodies import request_path

# The numpy dtype of each V2 datatype a benchmark model answers with.
_DTYPES = {"FP32": "<f4", "FP64": "<f8", "FP16": "<f2", "INT32": "<i4", "INT64": "<i8"}


class AnswerMismatch(RuntimeError):
    """A protocol's answer failed, or differed from TF-Serving JSON's."""


def check_answers(base: str, model: str, bodies: dict[str, tuple[bytes, dict[str, str]]]) -> None:
    answers = {}
    for protocol, (body, headers) in bodies.items():
        request = urllib.request.Request(
            base + request_path(protocol, model), data=body, headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answers[protocol] = decode_answer(
                    protocol, response.read(), dict(response.headers.items())
                )
        except urllib.error.HTTPError as exc:
            raise AnswerMismatch(
                f"{protocol}: {exc.code} {exc.read()[:300]!r} to the benchmark body"
            ) from None
    reference = answers.get("tfserving")
    for protocol, values in answers.items():
        if reference is not None and not np.allclose(values, reference, rtol=1e-4, atol=1e-4):
            raise AnswerMismatch(
                f"{protocol} answered {values[:4]}... where TF-Serving JSON answered "
                f"{reference[:4]}..."
            )


def decode_answer(protocol: str, body: bytes, headers: dict[str, str]) -> np.ndarray:
    """The first (or only) output of one answer, flat, as float64."""
    if protocol == "tfserving":
        payload: Any = orjson.loads(body)
        outputs = payload.get("outputs", payload.get("predictions"))
        if isinstance(outputs, dict):
            outputs = next(iter(outputs.values()))
        return np.asarray(outputs, dtype=np.float64).ravel()
    length = {k.lower(): v for k, v in headers.items()}.get("inference-header-content-length")
    split = int(length) if length is not None else len(body)
    header = orjson.loads(body[:split])
    output = header["outputs"][0]
    if "data" in output:
        return np.asarray(output["data"], dtype=np.float64).ravel()
    size = output["parameters"]["binary_data_size"]
    raw = np.frombuffer(body[split : split + size], dtype=_DTYPES[output["datatype"]])
    return raw.astype(np.float64)
