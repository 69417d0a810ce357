"""Machine-checked proofs of the rules the fuzzer can only sample.

Each obligation encodes spec functions in Z3 under the spec's own names
(``kvspec.proofs.dense_model.inplace_write_allowed`` is the encoding of
``kvspec.spec.dense.inplace_write_allowed``), proves the rule twice, over unbounded
integers and over 32-bit two's-complement bit-vectors (to catch overflow in a
32-bit port), and runs at least one negative control: a named buggy variant of
the rule that Z3 must refute, with a reachable counterexample turned into a
kvtrace. Depends on ``spec`` and ``z3`` only (``spec <- proofs``).
"""

# the folder is the package kvspec.proofs (pyproject.toml maps it): imported as `proofs` it would be a
# second copy of it, beside the one the rest of kvspec uses
if __name__ != "kvspec.proofs":
    raise ImportError(f"{__name__}: this folder is the package kvspec.proofs; import kvspec.proofs")
