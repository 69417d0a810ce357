"""Machine-checked proofs of the rules the fuzzer can only sample.

Each obligation encodes spec functions in Z3 under the spec's own names
(``proofs.dense_model.inplace_write_allowed`` is the encoding of
``spec.dense.inplace_write_allowed``), proves the rule twice, over unbounded
integers and over 32-bit two's-complement bit-vectors (to catch overflow in a
32-bit port), and runs at least one negative control: a named buggy variant of
the rule that Z3 must refute, with a reachable counterexample turned into a
kvtrace. Depends on ``spec`` and ``z3`` only (``spec <- proofs``).
"""
