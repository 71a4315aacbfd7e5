"""What an operator sees of a request: its times (Server-Timing), its trace (OpenTelemetry),
its access-log line."""
