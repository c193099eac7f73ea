"""The benchmark report and gradient self-check: ``python -m transformer_kernels.bench``.

Measures every op (and the nn modules) against the seeds' naive reference and the peers present
(torch's SDPA backends, FlexAttention, jagged and varlen attention, nn.MultiheadAttention,
nn.Conv1d + F.glu, flash-attn), checks correctness, and writes ``report.md``, ``results.json`` and
plots; ``--check`` compares every output and gradient with a float64 reference instead.  See
``python -m transformer_kernels.bench --help``.

- :mod:`.suites`: the cases and targets, one module per op (shared with ``benchmarks/``);
- :mod:`.timing`: interleaved timing and ratio statistics;
- :mod:`.run`: measuring a suite's groups; :mod:`.environment`: what a run records about the machine;
- :mod:`.report`: targets, report.md, results.json, ``--compare``, ``--readme``; :mod:`.plots`;
- :mod:`.check`: the gradient self-check; :mod:`.cli`: the command.

matplotlib (plots) and tqdm (progress bar) come with the ``bench`` extra; without them the command
skips the plots (saying so) and prints plain progress lines.
"""
