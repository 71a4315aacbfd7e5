"""Running batches over the stage actors: one replica's actors chained through ObjectRefs (or a
compiled graph), R replicas routed and kept healthy, their placement, the watchdog, faults told
apart, and a failed replica's recovery."""
