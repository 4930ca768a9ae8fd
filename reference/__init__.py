"""Test oracles outside the package: slow, plain definitions that tests and benchmarks compare the
package against. Nothing in ``cotrain`` imports them (tests/test_import_graph.py).

- ``draft_path``: the drafter's earlier training path (dense bucketed attention, zero main queries,
  full-tensor losses): the tests' reference and ``bench/drafters.py --train-paths``' "before" arm.
"""
