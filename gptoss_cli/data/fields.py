"""Field checks shared by both conversation forms (harmony's JSON, data/conversation.py, and the Hugging
Face chat form, data/chat_form.py): strings, reasoning effort, roles. Each names where the bad value sits.
Torch-free."""

from __future__ import annotations

from typing import Any

from gptoss_cli.data.harmony import REASONING_EFFORTS, ROLES, ConversationError


def text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConversationError(f"{where} must be a string, not {type(value).__name__}")
    return value


def optional_text(raw: dict, key: str, where: str) -> str | None:
    value = raw.get(key)
    return None if value is None else text(value, f"{where} {key!r}")


def effort(value: Any, where: str) -> str:
    if not isinstance(value, str) or value.lower() not in REASONING_EFFORTS:
        raise ConversationError(f"{where} reasoning_effort {value!r} is not one of {', '.join(REASONING_EFFORTS)}")
    return value.lower()


def check_role(role: Any, where: str) -> str:
    if role not in ROLES:
        raise ConversationError(f"{where}: unknown role {role!r} (one of {', '.join(ROLES)})")
    return role
