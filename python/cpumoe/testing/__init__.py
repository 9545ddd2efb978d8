"""Test fixtures that are part of the package because the benchmarks use them too: tiny model
checkpoints written the way their quantizers write them (:mod:`cpumoe.testing.models`). Not a
runtime dependency of the ops or the integrations."""
