"""Test and measurement tools, kept apart from the product: fault injection (``faults``), the fault suite
(``fault_suite``) and the benchmark (``bench``). The product modules never import this package."""
