"""Helpers for testing a Composer deployment and code written against it.

Nothing in the engine imports this package. It holds what tests, benchmarks and users'
own test suites share: throwaway PostgreSQL servers (:mod:`.servers`), real worker and
coordinator processes (:mod:`.processes`), a worker app whose behaviour comes from
each task's input (:mod:`.app`) and a wire-protocol proxy that injects connection
faults at exact points (:mod:`.faultproxy`).
"""
