"""kvspec's executable specification of KV-cache semantics.

Pure Python, standard library only. Every rule of the project's reference
semantics has one function here named for it; proofs, the MLX implementation
and the fuzzer refer to those names. Nothing in this package imports MLX or
any other part of kvspec.
"""

# the folder is the package kvspec.spec (pyproject.toml maps it): imported as `spec` it would be a
# second copy of it, beside the one the rest of kvspec uses
if __name__ != "kvspec.spec" and "crosshair" not in __import__("sys").modules:
    raise ImportError(f"{__name__}: this folder is the package kvspec.spec; import kvspec.spec")
