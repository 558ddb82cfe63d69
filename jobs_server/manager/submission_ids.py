"""Submission ids in Ray's format, made by the server for a job submitted without one."""

from __future__ import annotations

import secrets
import string

SUBMISSION_ID_PREFIX = "raysubmit_"
_SUBMISSION_ID_ALPHABET = string.ascii_letters + string.digits


def new_submission_id() -> str:
    """A random id in Ray's format, e.g. raysubmit_4LamXRuQpYdSMg7J."""
    # One read of the system's randomness (not one per letter: 5% of a burst's event loop),
    # 112 bits read as 16 base-62 digits (95 bits): a bias of at most 62**16 / 2**112 (1e-5).
    number = int.from_bytes(secrets.token_bytes(14))
    letters = []
    for _ in range(16):
        number, digit = divmod(number, len(_SUBMISSION_ID_ALPHABET))
        letters.append(_SUBMISSION_ID_ALPHABET[digit])
    return SUBMISSION_ID_PREFIX + "".join(letters)
