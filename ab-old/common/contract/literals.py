"""The contract's closed sets of names, defined once: question kinds, prefix policies and the
scopes a reuse is reported with. Everything else (validation, the ABI's enum mappings, the
planner, the CLI's choices) imports them from here."""

from __future__ import annotations

from typing import Literal, TypeGuard, get_args

QuestionKind = Literal["choice", "score", "noul"]
QUESTION_KINDS: tuple[QuestionKind, ...] = get_args(QuestionKind)

PrefixPolicy = Literal["off", "default", "shared", "fixed", "auto"]
PREFIX_POLICIES: tuple[PrefixPolicy, ...] = get_args(PrefixPolicy)
# What a request actually ran with: `auto` resolves to one of these.
ExecutedPolicy = Literal["off", "default", "shared", "fixed"]

PrefixScope = Literal["none", "within_question", "across_questions"]
PREFIX_SCOPES: tuple[PrefixScope, ...] = get_args(PrefixScope)


def is_question_kind(name: object) -> TypeGuard[QuestionKind]:
    return name in QUESTION_KINDS


def is_prefix_policy(name: object) -> TypeGuard[PrefixPolicy]:
    return name in PREFIX_POLICIES
