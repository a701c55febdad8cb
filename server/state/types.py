"""Column types the state schema shares, with SQLAlchemy Core alone (no ORM import): the ORM
(``orm.py``) and the Core listing (``listing.py``) read ids the same way."""

from __future__ import annotations

from sqlalchemy import BigInteger
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

__all__ = ["UInt64", "unsigned"]


def unsigned(value: int | None) -> int | None:
    """A stored two's-complement BIGINT back as the unsigned 64-bit id it holds."""
    if value is None:
        return None
    return value + 2**64 if value < 0 else value


class UInt64(TypeDecorator[int]):
    """Flower's node and run ids are unsigned 64-bit; stored two's-complement in a BIGINT."""

    impl = BigInteger
    cache_ok = True

    def process_bind_param(self, value: int | None, dialect: Dialect) -> int | None:
        if value is None:
            return None
        if not 0 <= value < 2**64:
            raise ValueError(f"id {value} is outside the unsigned 64-bit range")
        return value - 2**64 if value >= 2**63 else value

    def process_result_value(self, value: int | None, dialect: Dialect) -> int | None:
        return unsigned(value)
