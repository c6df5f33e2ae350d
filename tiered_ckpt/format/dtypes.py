"""The dtypes a shard holds, by their safetensors codes (``"F32"``, ``"BF16"``...), both ways.

bf16 and fp8 are ml_dtypes' types, and ml_dtypes takes most of a second to import: it is
imported when one of them is first looked up (an array of them has it imported already).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cache

import numpy as np

__all__ = ["DTYPES", "DTYPE_CODES", "NUMPY_CODES", "code_of"]

_PLAIN: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}  # code -> ml_dtypes' name
_ORDER = (
    "F64",
    "F32",
    "F16",
    "BF16",
    "F8_E4M3",
    "F8_E5M2",
    "I64",
    "I32",
    "I16",
    "I8",
    "U64",
    "U32",
    "U16",
    "U8",
    "BOOL",
)
NUMPY_CODES: Mapping[np.dtype, str] = {dtype: code for code, dtype in _PLAIN.items()}
"""The code of each dtype of numpy's own a shard holds: every one but bf16 and fp8."""


@cache
def _ml_dtype(code: str) -> np.dtype:
    # ml_dtypes takes most of a second to import: only a shard of bf16 or fp8 arrays needs it
    import ml_dtypes

    found: np.dtype = np.dtype(getattr(ml_dtypes, _ML_DTYPES[code]))
    return found


def code_of(dtype: np.dtype) -> str | None:
    """The code of ``dtype`` (little-endian), None if a shard cannot hold it. An array of bf16 or
    fp8 has a dtype of ml_dtypes, imported already; its name says which."""
    code = NUMPY_CODES.get(dtype)
    if code is None:
        code = next((c for c, name in _ML_DTYPES.items() if name == dtype.name), None)
        if code is not None and _ml_dtype(code) != dtype:
            return None
    return code


class _Dtypes(Mapping[str, np.dtype]):
    """:data:`DTYPES`: bf16 and fp8 from ml_dtypes, imported when one of them is first looked up."""

    def __getitem__(self, code: str) -> np.dtype:
        return _ml_dtype(code) if code in _ML_DTYPES else _PLAIN[code]

    def __contains__(self, code: object) -> bool:
        return code in _PLAIN or code in _ML_DTYPES

    def __iter__(self) -> Iterator[str]:
        return iter(_ORDER)

    def __len__(self) -> int:
        return len(_ORDER)


class _Codes(Mapping[np.dtype, str]):
    """:data:`DTYPE_CODES`, without importing ml_dtypes for the dtypes of numpy."""

    def __getitem__(self, dtype: np.dtype) -> str:
        code = code_of(np.dtype(dtype))
        if code is None:
            raise KeyError(dtype)
        return code

    def __iter__(self) -> Iterator[np.dtype]:
        return (DTYPES[code] for code in _ORDER)

    def __len__(self) -> int:
        return len(_ORDER)


DTYPES: Mapping[str, np.dtype] = _Dtypes()
"""The dtype of each safetensors code a shard holds."""
DTYPE_CODES: Mapping[np.dtype, str] = _Codes()
"""The safetensors code of each dtype a shard holds (the inverse of :data:`DTYPES`)."""
