"""The test suite: unit, whole-path and distributed tests, and the differential harness."""
