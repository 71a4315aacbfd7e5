"""TLS on the client-facing ports: ``--tls-cert-file`` and ``--tls-key-file`` serve HTTPS and
gRPC over TLS, ``--tls-ca-file`` asks every client for a certificate that CA signed (mutual TLS);
``--allow-plaintext-admin`` lets the admin token travel in clear text from other machines. A base
of ``serving.settings.config.Settings`` (same flags, env vars and TOML keys as every other
setting).

The files are checked when the settings are read (a key that does not match its certificate is
an error at start, naming both files), and read by each server as it starts: uvicorn's
``ssl_*`` options (``uvicorn_tls``), gRPC's ``ssl_server_credentials``
(``serving.protocols.grpc_port``).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

__all__ = ["TlsSettings", "uvicorn_tls"]


class TlsSettings(BaseModel):
    tls_cert_file: Path | None = Field(
        None,
        description="PEM certificate (chain) of the server: HTTPS and gRPC over TLS, with "
        "tls_key_file; unset = clear text.",
    )
    tls_key_file: Path | None = Field(
        None, description="PEM private key of tls_cert_file (keep it mode 600)."
    )
    tls_ca_file: Path | None = Field(
        None,
        description="PEM CA certificate(s): every client must present a certificate they "
        "signed (mutual TLS), on HTTP and gRPC; needs tls_cert_file.",
    )
    allow_plaintext_admin: bool = Field(
        False,
        description="Take the admin token over plain HTTP (and gRPC) from other machines, as "
        "behind a proxy that ends TLS; otherwise, without TLS, only from the loopback address.",
    )

    @property
    def tls(self) -> bool:
        """Whether the ports serve TLS."""
        return self.tls_cert_file is not None

    @model_validator(mode="after")
    def _tls_files(self) -> TlsSettings:
        cert, key, ca = self.tls_cert_file, self.tls_key_file, self.tls_ca_file
        if (cert is None) != (key is None):
            raise ValueError(
                "give both tls_cert_file and tls_key_file (the server's certificate and its "
                "key), or neither"
            )
        if ca is not None and cert is None:
            raise ValueError(
                "tls_ca_file asks clients for certificates over TLS: give tls_cert_file and "
                "tls_key_file too"
            )
        if cert is None or key is None:
            return self
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(cert, key)
        except OSError as exc:
            raise ValueError(
                f"tls_cert_file {str(cert)!r} and tls_key_file {str(key)!r}: {_reason(exc)}; "
                "give a PEM certificate and the PEM private key that matches it"
            ) from None
        if ca is not None:
            try:
                context.load_verify_locations(cafile=ca)
            except OSError as exc:
                raise ValueError(
                    f"tls_ca_file {str(ca)!r}: {_reason(exc)}; give PEM CA certificate(s)"
                ) from None
        return self


def _reason(exc: OSError) -> str:
    """The words of ``exc`` (an ``ssl.SSLError`` is an ``OSError`` too), without its errno."""
    if isinstance(exc, ssl.SSLError):
        return str(exc)
    return exc.strerror or str(exc)


def uvicorn_tls(settings: TlsSettings) -> dict[str, Any]:
    """uvicorn's ``Config`` options for the settings' TLS (none without it)."""
    if settings.tls_cert_file is None:
        return {}
    return {
        "ssl_certfile": str(settings.tls_cert_file),
        "ssl_keyfile": str(settings.tls_key_file),
        "ssl_ca_certs": None if settings.tls_ca_file is None else str(settings.tls_ca_file),
        "ssl_cert_reqs": ssl.CERT_NONE if settings.tls_ca_file is None else ssl.CERT_REQUIRED,
    }
