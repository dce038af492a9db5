"""Route classes: rules that send kinds of requests to groups of replicas.

A route table is an ordered list of rules; the first rule whose conditions all hold names
the request's route class and its replica group tiers (first rule wins; no rule matches:
class ``default``, every replica). Conditions, all optional: ``models`` (exact names),
``min_prompt_tokens`` / ``max_prompt_tokens`` (inclusive), ``min_max_tokens`` /
``max_max_tokens`` (on the request's ``max_tokens``; a request without one matches only
rules without these bounds), ``stream``. ``groups`` is a list of tiers, each a list of
replica group names: the scheduler uses the first tier that has an available replica, so
later tiers are fallbacks (an empty tier means every replica). Example, long prompts to
large-memory replicas, falling back to any::

    routes:
      - name: long-context
        min_prompt_tokens: 32000
        groups: [[h200], []]
      - name: batch
        stream: false
        min_max_tokens: 2048
        groups: [[l40s, a100]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from isocost.scheduling.contract import DEFAULT_CLASS, RequestView

__all__ = ["RouteClass", "RouteRule", "RouteTable"]


class RouteRule(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One rule of a route table (see the module docstring)."""

    name: str
    groups: list[list[str]] = msgspec.field(default_factory=lambda: [[]])
    models: list[str] | None = None
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    min_max_tokens: int | None = None
    max_max_tokens: int | None = None
    stream: bool | None = None

    def matches(self, request: RequestView) -> bool:
        if self.models is not None and request.model not in self.models:
            return False
        n = request.prompt_tokens
        if self.min_prompt_tokens is not None and n < self.min_prompt_tokens:
            return False
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            return False
        if self.min_max_tokens is not None or self.max_max_tokens is not None:
            m = request.max_tokens
            if m is None:
                return False
            if self.min_max_tokens is not None and m < self.min_max_tokens:
                return False
            if self.max_max_tokens is not None and m > self.max_max_tokens:
                return False
        return self.stream is None or request.stream == self.stream


@dataclass(frozen=True, slots=True)
class RouteClass:
    """A request's class and the replica group tiers to try, in order (empty = all)."""

    name: str
    tiers: tuple[frozenset[str], ...]


_DEFAULT = RouteClass(DEFAULT_CLASS, (frozenset(),))


@dataclass(frozen=True, slots=True)
class RouteTable:
    rules: tuple[RouteRule, ...] = ()

    @classmethod
    def of(cls, rules: Sequence[RouteRule]) -> RouteTable:
        return cls(tuple(rules))

    def classify(self, request: RequestView) -> RouteClass:
        """The class of ``request``; an explicit ``request.route_class`` naming a rule wins."""
        for rule in self.rules:
            if request.route_class == rule.name:
                return _to_class(rule)
        for rule in self.rules:
            if rule.matches(request):
                return _to_class(rule)
        return _DEFAULT


def _to_class(rule: RouteRule) -> RouteClass:
    tiers = tuple(frozenset(tier) for tier in rule.groups) or (frozenset(),)
    return RouteClass(rule.name, tiers)
