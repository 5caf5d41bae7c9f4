"""Pure numerics: exact norm accumulation, the scale search, rounding tables. No I/O."""
