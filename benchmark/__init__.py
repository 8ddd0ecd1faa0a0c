"""``dctms bench``: the paper's A/B protocol (§3.6) — baseline mlx-lm against the plan runner.

Modules:
- ``prompts``  the P1-P5 prompt file, tokenisation (or byte fallback), the N / M checks;
- ``systems``  the two systems behind one call interface, and one measured call (latency, TTFT,
  tokens, RSS sampled every 10 ms, MLX peak);
- ``protocol`` interleaved A/B schedule, warm-up, atomic ``calls.json`` after every call, Ctrl-C;
- ``stats``    mean, sample std, CV, percentiles (linear, type 7), seeded bootstrap ratio intervals;
- ``report``   ``summary.md`` (the paper's Tables 2/3 layout) and ``summary.json``;
- ``plot``     latency distributions and RSS over time (PNG + SVG; matplotlib imported lazily);
- ``progress`` a plain-text progress bar on stderr.
"""
