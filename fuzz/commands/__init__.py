"""The ``kvspec`` commands: the CLI (``cli``) and what each subcommand runs
(``verify``, ``mutants``, ``e2e``, ``conformance``, ``bench``,
``mutation_report``). They sit on top of the harness and only drive it."""
