"""What of OpenTelemetry's configuration reaches the Ray workers (``runtime_env``, readable by
whoever reaches Ray's GCS or dashboard): where and how to export, the sampler, the resource;
never the exporter's headers, which hold the collector's credentials."""

from __future__ import annotations

from shards.tracing import otel_env

ENV = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://collector:4318/v1/traces",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    "OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/ca.pem",
    "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer s3cret",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-api-key=s3cret",
    "OTEL_SERVICE_NAME": "shardserve",
    "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
    "OTEL_TRACES_SAMPLER_ARG": "0.01",
    "OTEL_BSP_MAX_QUEUE_SIZE": "4096",
    "OTEL_SOME_FUTURE_SECRET": "x",
    "PATH": "/usr/bin",
}


def test_the_workers_get_what_export_needs_and_no_credentials() -> None:
    got = otel_env(ENV)
    assert "s3cret" not in repr(got)
    assert got == {
        k: ENV[k]
        for k in (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            "OTEL_SERVICE_NAME",
            "OTEL_TRACES_SAMPLER",
            "OTEL_TRACES_SAMPLER_ARG",
            "OTEL_BSP_MAX_QUEUE_SIZE",
        )
    }
