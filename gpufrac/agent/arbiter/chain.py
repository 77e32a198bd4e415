"""The resolver chain the node config names, built over the arbiter.

Here rather than in arbiter.resolvers: the swap resolver (arbiter.swap.resolver) is built
on the resolver interface, and the chain needs both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gpufrac.agent.arbiter.resolvers import (
    Chain,
    EvictResolver,
    Resolver,
    ResolverContext,
    ResolverMetrics,
    WaitResolver,
    guarantee_chain,
)
from gpufrac.agent.arbiter.swap.resolver import SwapHost, SwapMetrics, SwapResolver
from gpufrac.agent.arbiter.unbooked import UnbookedHost, UnbookedResolver


class ChainMetrics(ResolverMetrics, SwapMetrics, Protocol):
    """What the resolvers together count."""


class ChainHost(ResolverContext, SwapHost, UnbookedHost, Protocol):
    """What the resolvers together need of the arbiter (its resolution context, arbiter/context.py)."""

    @property
    def metrics(self) -> ChainMetrics: ...


def build_chain(names: Sequence[str], host: ChainHost) -> Chain:
    """The resolvers named in the config, in its order."""
    out: list[Resolver] = []
    for name in names:
        if name == WaitResolver.name:
            out.append(WaitResolver(host))
        elif name == EvictResolver.name:
            out.append(EvictResolver(host))
        elif name == SwapResolver.name:
            out.append(SwapResolver(host))
        else:
            raise ValueError(f"resolvers: unknown resolver {name!r}")
    return Chain(out)


def build_guarantee_chain(chain: Chain, host: ChainHost) -> Chain:
    """The chain a guarantee is reclaimed with: first the memory no allocation answers for on
    the GPU (gpufrac.agent.arbiter.unbooked), then `chain` with an evict step (resolvers.guarantee_chain)."""
    return Chain([UnbookedResolver(host), *guarantee_chain(chain, host).resolvers])
