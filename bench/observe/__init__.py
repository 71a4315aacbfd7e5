"""The server under test and the machine, seen from outside: counters scraped from ``/metrics``,
memory and TensorFlow from ``/proc``, where the CPU went, and whether the machine is quiet."""
