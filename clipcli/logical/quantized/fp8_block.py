"""Block-scaled FP8 (DeepSeek-V3/R1, Qwen3-FP8; quant_method "fp8").

`X.weight` F8_E4M3 [M, N] + `X.weight_scale_inv` [ceil(M/bh), ceil(N/bw)] (float32 in
practice); weight[i, j] = code[i, j] x scale[i // bh, j // bw] (multiplied, despite the
name). Edge blocks are partial. Without a weight_block_size in config.json, the block is
read from the shapes only where they leave one reading: along each dimension of n
elements with s scales, every block b with ceil(n / b) == s must place every element in
the same block (always so for s <= 1; for s >= 2 only when exactly one b fits). One scale
element covers the whole tensor. Anything else is refused (exit 3), never guessed: a
[300, 200] weight with a [3, 2] scale fits blocks of 100..149 x 100..199, 128 x 128 among
them, and each gives other values (issue 21).

Scales that are powers of two (F8_E8M0 bytes, or float32 under config.json's scale_fmt
"ue8m0", as DeepSeek-V3.1 ships: the kernels that serve them keep only the exponent) take a
clip's factor rounded down to a power of two 2**-k, as MXFP4's do: each E8M0 byte s becomes
s - k, each float scale is multiplied by 2**-k exactly, the codes stay byte for byte
(params["power_of_two"]; the view refuses a factor a scale cannot take: refused_factor).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clipcli.logical.quantized import rules
from clipcli.logical.quantized.scheme import ReadSmall, Recognised, row_for_row
from clipcli.logical.view import Part

if TYPE_CHECKING:
    import numpy as np

    from clipcli.formats.base import TensorInfo

NAMES: Sequence[str] = ("fp8-block",)
METHOD = "fp8"
SCALE_SUFFIX = "_scale_inv"
E8M0 = "float8_e8m0fnu"
POWER_OF_TWO_FORMAT = "ue8m0"  # quantization_config.scale_fmt


def recognise(
    stored: Mapping[str, TensorInfo],
    config: Mapping[str, Any] | None,
    read: ReadSmall | None = None,  # noqa: ARG001 - interface: every shape is in headers
) -> list[Recognised]:
    method = rules.method_of(config)
    if config is not None and method != METHOD:
        return []
    declared: tuple[int, ...] | None = None
    if config is not None:
        raw = config.get("weight_block_size")
        if raw is not None:
            declared = rules.block_sizes(raw, "config.json", "weight_block_size", 2)
    found = []
    for name, info in stored.items():
        if rules.dtype_name(info) not in rules.FP8_CODE_DTYPES:
            continue
        if rules.module_prefix(name, "weight") is None:  # "X.weight", or the root's "weight"
            continue
        scale = stored.get(name + SCALE_SUFFIX)
        if scale is None:
            if config is not None:
                raise rules.incomplete(
                    name,
                    f"fp8 codes without their {name + SCALE_SUFFIX} (config.json declares "
                    'quant_method "fp8"): its real values cannot be known',
                )
            continue
        power_of_two = _power_of_two_scales(config)
        found.append(_recognised(info, scale, declared, config is not None, power_of_two))
    return found


def _power_of_two_scales(config: Mapping[str, Any] | None) -> bool:
    """Whether config.json's scale_fmt says the scales are powers of two ("ue8m0", as the
    loaders compare it). A scale_fmt that is not a string, or a near miss of "ue8m0" (case,
    spaces: one loader may read it as ue8m0 and another not), is refused (exit 3): the clip
    it decides would differ."""
    if config is None or config.get("scale_fmt") is None:
        return False
    said = config["scale_fmt"]
    if said == POWER_OF_TWO_FORMAT:
        return True
    if not isinstance(said, str) or "e8m0" in said.strip().lower():
        import json

        text = json.dumps(said)  # control characters escaped: one line
        raise rules.refuse(
            "config.json",
            f"quantization_config.scale_fmt {text[:60]}{'...' if len(text) > 60 else ''} "
            "is neither absent nor "
            f'"{POWER_OF_TWO_FORMAT}": whether the scales are powers of two cannot be told',
        )
    return False


def _recognised(
    info: TensorInfo,
    scale: TensorInfo,
    declared: tuple[int, ...] | None,
    configured: bool,
    power_of_two: bool,
) -> Recognised:
    rules.check_not_empty(info.name, info, scale)
    if len(info.shape) != 2:
        raise rules.refuse(info.name, f"block-scaled fp8 weight of rank {len(info.shape)}, not 2")
    rules.check_scale_dtype(scale)
    rows, columns = info.shape
    e8m0 = rules.dtype_name(scale) == E8M0
    block = _block_from_shapes(info, scale, configured) if declared is None else declared
    expected = (rules.ceil_div(rows, block[0]), rules.ceil_div(columns, block[1]))
    if declared is not None or scale.numel != 1:  # one scale of any shape: the whole tensor
        rules.check_shape(scale, expected, info.name, f"scale for blocks of {list(block)}")
    return Recognised(
        name=info.name,
        scheme=NAMES[0],
        shape=tuple(info.shape),
        codes=info.name,
        parts=(Part(info.name, "codes"), Part(scale.name, "scale")),
        params={
            "block": block,
            "e8m0": e8m0,
            "power_of_two": power_of_two or e8m0,
        },
    )


def _block_from_shapes(info: TensorInfo, scale: TensorInfo, configured: bool) -> tuple[int, int]:
    rows, columns = info.shape
    if scale.numel == 1:  # one scale for the whole tensor (quant_method fp8 without blocks)
        return (max(1, rows), max(1, columns))
    if len(scale.shape) == 2:
        fits = [_only_block(n, s) for n, s in zip(info.shape, scale.shape, strict=True)]
        if fits[0] is not None and fits[1] is not None:
            return (fits[0], fits[1])
    said = "config.json gives no weight_block_size" if configured else "no config.json"
    raise rules.refuse(
        scale.name,
        f"{said}, and the scale's shape {rules.shown(scale.shape)} for weight "
        f"{rules.shown(info.shape)} fits {_fitting(info.shape, scale.shape)}: the block size "
        "cannot be told from the shapes; a config.json beside the file with "
        "quantization_config.weight_block_size says it",
    )


def consistent_blocks(extent: int, scales: int) -> tuple[int, int] | None:
    """The block sizes b (from 1 up) with ceil(extent / b) == scales, as the range [low,
    high] (high = extent for every b from extent up, which all read alike), or None."""
    if extent == 0:
        return (1, 1) if scales == 0 else None
    if not 1 <= scales <= extent:
        return None
    if scales == 1:
        return (extent, extent)
    low = rules.ceil_div(extent, scales)
    high = rules.ceil_div(extent, scales - 1) - 1
    return (low, high) if low <= high else None


def _only_block(extent: int, scales: int) -> int | None:
    """The block size when the shapes leave exactly one reading of this dimension."""
    fit = consistent_blocks(extent, scales)
    return fit[0] if fit is not None and fit[0] == fit[1] else None


def _fitting(shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
    if len(scale_shape) != 2:
        return "no block layout (a block scale has two dimensions)"
    fits = [consistent_blocks(n, s) for n, s in zip(shape, scale_shape, strict=True)]
    if fits[0] is None or fits[1] is None:
        return "no block size"
    return " x ".join(
        str(low) if low == high else f"{low}..{high}" for low, high in (fits[0], fits[1])
    )


code_rows = row_for_row  # one real row per stored row of codes


def decode_rows(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> np.ndarray:
    import numpy as np

    block_rows, block_columns = weight.params["block"]
    columns = weight.shape[1]
    flat = rules.widened(small[weight.parts[1].name]).reshape(-1)
    scale_columns = rules.ceil_div(columns, block_columns) if flat.size > 1 else 1
    scale = flat.reshape(-1, scale_columns)
    values = rules.code_values(codes.reshape(stop - start, columns))
    # One row of block scales spread over the columns per run of rows in one row block,
    # multiplied in place: no scale matrix the size of the chunk.
    first = start
    while first < stop:
        block = first // block_rows if scale.shape[0] > 1 else 0
        last = min(stop, (first // block_rows + 1) * block_rows)
        spread = (
            np.repeat(scale[block], block_columns)[:columns] if scale_columns > 1 else scale[block]
        )
        with np.errstate(invalid="ignore", over="ignore"):
            values[first - start : last - start] *= spread
        first = last
    return values


def code_tables(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> tuple[np.ndarray, np.ndarray] | None:
    """Real rows [start, stop) as how often each code occurs per block and a 256-entry
    table per block (every code x the block's scale, the products decode_rows makes):
    (counts, values) of equal shapes. None when the blocks are too small for tables to
    pay (the caller decodes)."""
    import numpy as np

    from clipcli.dtypes import float64_values
    from clipcli.numerics import coded

    columns = weight.shape[1]
    rows_per_block, columns_per_block, scale_columns = _block_layout(weight, small, stop)
    scale = rules.widened(small[weight.parts[1].name]).reshape(-1, scale_columns)
    first_block = start // rows_per_block
    last_block = (stop - 1) // rows_per_block
    blocks = (last_block - first_block + 1) * scale_columns
    if not coded.tables_pay(blocks, (stop - start) * columns):
        return None
    raw = codes.reshape(stop - start, columns).view(np.uint8)
    counts = coded.block_code_counts(raw, start, rows_per_block, columns_per_block)
    with np.errstate(invalid="ignore", over="ignore"):
        tables = scale[first_block : last_block + 1, :, None] * float64_values(codes.dtype)
    return counts, tables


# Every e4m3 value squared is a multiple of 2**-18 (the least subnormal is 2**-9) below
# 2**18 (448**2): code_energies sums them as integers in units of 2**-ENERGY_UNIT, exact
# in int64 for blocks of up to 2**26 codes (2**26 x 2**36 < 2**63).
ENERGY_UNIT = 18
ENERGY_BLOCK_LIMIT = 1 << 26
_E4M3_NAN = (0x7F, 0xFF)


def code_energies(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
) -> tuple[int, np.ndarray] | None:
    """The sum of the squares of the codes' values in each block of real rows [start,
    stop), as exact integers in units of 2**-ENERGY_UNIT: what every check of a factor
    needs of the codes (the view sums energy x scale**2), whatever the scales. Returns
    (the index of the run's first block in the flattened scales, the run's blocks'
    energies, flattened). None for e5m2 codes, NaN codes or blocks over
    ENERGY_BLOCK_LIMIT codes (the checks count codes under each factor's scales)."""
    import numpy as np

    from clipcli.dtypes import float64_values
    from clipcli.numerics import coded

    if codes.dtype.name != "float8_e4m3fn":
        return None
    rows_per_block, columns_per_block, _ = _block_layout(weight, small, stop)
    whole_block_rows = _block_layout(weight, small, weight.shape[0])[0]
    if whole_block_rows * columns_per_block > ENERGY_BLOCK_LIMIT:
        return None
    columns = weight.shape[1]
    raw = codes.reshape(stop - start, columns).view(np.uint8)
    values = float64_values(codes.dtype).copy()  # shared, read-only
    values[list(_E4M3_NAN)] = 0.0
    units = np.ldexp(values * values, ENERGY_UNIT).astype(np.int64)  # exact integers
    first_block = start // rows_per_block
    row_blocks = (stop - 1) // rows_per_block - first_block + 1
    scale_columns = rules.ceil_div(columns, columns_per_block)
    if coded.tables_pay(row_blocks * scale_columns, raw.size):
        counts = coded.block_code_counts(raw, start, rows_per_block, columns_per_block)
        if counts[..., _E4M3_NAN].any():
            return None
        energies = counts @ units  # [row blocks of the run, scale columns]
    else:  # small blocks: 256 counts a block would outnumber the codes; sum each one
        if np.isin(raw, _E4M3_NAN).any():
            return None
        squares = units[raw]  # int64, the run's own size
        row_starts = [
            0,
            *range(
                first_block * rows_per_block + rows_per_block - start, stop - start, rows_per_block
            ),
        ]
        by_rows = np.add.reduceat(squares, row_starts, axis=0)
        energies = np.add.reduceat(by_rows, list(range(0, columns, columns_per_block)), axis=1)
    return first_block * scale_columns, energies.reshape(-1)


def _block_layout(
    weight: Recognised, small: Mapping[str, np.ndarray], stop: int
) -> tuple[int, int, int]:
    """(rows per block, columns per block, scale columns) as decode_rows reads the scales:
    one row of scales covers every row, one column every column."""
    block_rows, block_columns = weight.params["block"]
    columns = weight.shape[1]
    flat_size = small[weight.parts[1].name].size
    scale_columns = rules.ceil_div(columns, block_columns) if flat_size > 1 else 1
    scale_rows = flat_size // scale_columns if scale_columns else 0
    rows_per_block = block_rows if scale_rows > 1 else max(1, stop)
    columns_per_block = block_columns if scale_columns > 1 else max(1, columns)
    return rows_per_block, columns_per_block, scale_columns


measure_rows = rules.measured_through(code_tables)


def cast_rows(
    weight: Recognised,
    codes: np.ndarray,
    start: int,
    stop: int,
    small: Mapping[str, np.ndarray],
    target: np.dtype[Any],
) -> np.ndarray | None:
    """Real rows [start, stop) in `target`, each value rounded once: what decode_rows then
    a cast gives, through one 256-entry table per block (every code x the block's scale,
    rounded), so each element costs one lookup. None when a table holds a value the cast
    overflows (the caller then decodes and casts, counting them)."""
    import numpy as np

    from clipcli.dtypes import float64_values
    from clipcli.numerics.rounding import narrow_round

    block_rows, block_columns = weight.params["block"]
    columns = weight.shape[1]
    flat = rules.widened(small[weight.parts[1].name]).reshape(-1)
    scale_columns = rules.ceil_div(columns, block_columns) if flat.size > 1 else 1
    scale = flat.reshape(-1, scale_columns)
    code_table = float64_values(codes.dtype)
    raw = codes.reshape(stop - start, columns).view(np.uint8)
    table_of_column = (np.arange(columns) // block_columns) * 256 if scale_columns > 1 else 0
    out = np.empty((stop - start, columns), dtype=target)
    first = start
    while first < stop:
        block = first // block_rows if scale.shape[0] > 1 else 0
        last = min(stop, (first // block_rows + 1) * block_rows)
        with np.errstate(invalid="ignore", over="ignore"):
            products = (scale[block][:, None] * code_table[None, :]).reshape(-1)
        tables = narrow_round(products, target)
        if np.any(np.isinf(tables.astype(np.float32)) & np.isfinite(products)):
            return None
        rows = raw[first - start : last - start]
        np.take(
            tables,
            rows + table_of_column if scale_columns > 1 else rows,
            out=out[first - start : last - start],
        )
        first = last
    return out


def scaled_parts(weight: Recognised) -> list[str]:
    return [weight.parts[1].name]


def stored_scaler(
    weight: Recognised, part: str
) -> Callable[[np.ndarray, float, int], np.ndarray] | None:
    """The optional scheme hook (scheme.Scheme): power-of-two scales take the factor
    rounded down to 2**-k, E8M0 bytes by their exponent, float ones exactly."""
    if part != weight.parts[1].name or not weight.params.get("power_of_two", False):
        return None
    if weight.params.get("e8m0", False):
        return rules.lower_e8m0_exponents
    return rules.halve_float_scales
