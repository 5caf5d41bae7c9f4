"""Pure numerics: no I/O, and nothing of clipcli's imported but clipcli.dtypes and errors.

- widening: any chunk as float64, exactly (the one way data is widened)
- norms: per-tensor statistics and the exact sum of squares (NormAccumulator), the one
  scaled sum (ScaledSum) and rescaling rule, global norms
- certain: sums of squares with a rigorous error bound, for "<= C" decisions
- rounding: scale and clamp chunks in their own dtype, each value rounded once
- difference: a − b for diff, exact for every dtype pair and rounded once
- search: the one bisection for the largest factor that fits
- scaling: the factor of a tensor, group or checkpoint (group_factor, given_norm_factor)
- slices: per-slice norms and factors for --axes (axes_scales, scale_slices)
- lookup, float16: fast exact paths for 8- and 16-bit floats (tables, bit tricks)
"""
