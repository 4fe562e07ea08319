"""Helpers for testing a Composer deployment and code written against it.

Nothing in the engine, the ops analytics or the CLI imports this package. It holds what
tests, benchmarks and users' own test suites share: throwaway PostgreSQL servers
(:mod:`.servers`), real worker and coordinator processes (:mod:`.processes`), a worker
app whose behaviour comes from each task's input (:mod:`.app`), a wire-protocol proxy
that injects connection faults at exact points (:mod:`.faultproxy`), a deterministic
seeded database (:mod:`.fixtures`) and the check of a report's key figures against the
ones that seed must produce (:mod:`.checks`).
"""
