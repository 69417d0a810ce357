"""kvspec's executable specification of KV-cache semantics.

Pure Python, standard library only. Every rule of the project's reference
semantics has one function here named for it; proofs, the MLX implementation
and the fuzzer refer to those names. Nothing in this package imports MLX or
any other part of kvspec.
"""
