"""The prefix cache's index: which runs of tokens have their KV kept, decided on rank 0.

A prompt is cut into blocks of :data:`BLOCK` tokens. Block ``i`` is known by its
key ``(node of block i - 1, its tokens)``, so a key names the whole prefix up to it
(a hash chain, as vLLM's and llama.cpp's; here the dict compares the tokens too,
so two prefixes never share a block by a collision). Nodes are numbered once and
never reused; each holds a block id, which is where every rank keeps that block's
KV (:class:`~hpcmac.llm.model.cache.KVBlock`, each rank its own layers and heads).

Only rank 0 holds this index. What it decides travels as instructions in the
pipeline's control messages (``SAVE``/``LOAD``, :mod:`hpcmac.llm.model.cache`),
which every rank applies in the order rank 0 made them: so a block id reused for
new tokens after an eviction is never read for the old ones, and no extra
message is sent per token.

Bounded by blocks (the byte budget over the largest rank's block, see
:func:`capacity`); eviction takes the least recently used *leaf* (a block no
other cached block continues), so a chain is never cut in the middle.

A model with linear-attention layers (Qwen3-Next, Qwen3.5) cannot rebuild their
recurrent state from a prefix of the KV: a block is usable as the end of a reused
prefix only if it also holds the states after its last token (``state``), which
exist only at the moment the sequence has been fed exactly to that token. The
scheduler saves them where they exist (the end of each prefill chunk, which it cuts
at a block boundary, and the last block of each run of generated blocks), a lookup
stops at the last block of the match that holds them, and such a block costs
``state_cost`` blocks more of the budget (the states' bytes over a block's).
Pure: nothing here communicates.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from dataclasses import dataclass

from hpcmac.errors import UsageError

#: tokens per block; a prompt reuses whole blocks only, so a repeated prompt recomputes up
#: to BLOCK tokens besides its last (vLLM's 16 left 6 of a 38-token chat prompt to prefill,
#: 4 leaves 2: docs/serve.md, "TTFT at one client")
BLOCK = 4
#: blocks holding generated tokens are saved once they cover this many tokens (or their
#: sequence ends): one SAVE instruction, riding a control message, every few decode steps
SAVE_RUN = 16
#: --prefix-cache-gb when not given: this much, at most half what the weights leave
DEFAULT_GB = 1.0
GIB = 1 << 30
ROOT = 0  # the node before the first block


@dataclass
class _Node:
    bid: int
    key: tuple
    children: int = 0
    state: bool = False  # its block holds the recurrent states after its last token


class PrefixIndex:
    """Rank 0's index of cached blocks (see the module docstring).

    capacity : blocks at most (global: every rank holds the same block ids).
    block : tokens per block.
    block_bytes : bytes one block takes on the rank holding the most (stats only).
    needs_state : a reused prefix must end at a block holding the recurrent states (a
        model with linear-attention layers).
    state_cost : blocks of the budget those states take besides a block's KV.
    """

    def __init__(self, capacity: int, block: int = BLOCK, block_bytes: int = 0,
                 needs_state: bool = False, state_cost: int = 0):
        self.capacity, self.block, self.block_bytes = int(capacity), int(block), block_bytes
        self.needs_state = bool(needs_state)
        self.state_cost = int(state_cost) if self.needs_state else 0
        self.used = 0  # of the capacity: a block 1, its states state_cost more
        self._by_key: dict[tuple, int] = {}
        self._nodes: dict[int, _Node] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._kids: dict[int, set[int]] = {}  # node -> the cached blocks continuing it
        self._free = list(range(self.capacity))[::-1]
        self._next = ROOT + 1
        #: keys of blocks an admitted prompt is prefilling now -> that sequence
        self.pending: dict[tuple, int] = {}
        # counters (plain ints: read from any thread, e.g. a /metrics endpoint)
        self.lookups = 0  # prompts looked up
        self.hits = 0  # prompts that reused at least one block
        self.tokens_reused = 0  # prompt tokens not prefilled
        self.saved = 0  # blocks stored
        self.evictions = 0

    # -- reading ---------------------------------------------------------------------

    def key(self, parent: int, tokens) -> tuple:
        return (parent, tuple(int(t) for t in tokens))

    def match(self, tokens, limit: int) -> list[int]:
        """Nodes of the longest cached run of whole blocks starting ``tokens``, at most
        ``limit`` tokens (a prompt keeps its last token to prefill: its logits)."""
        out, parent, b = [], ROOT, self.block
        for i in range(max(0, limit) // b):
            node = self._by_key.get(self.key(parent, tokens[i * b:(i + 1) * b]))
            if node is None:
                break
            out.append(node)
            parent = node
        return out

    def usable(self, nodes: list[int]) -> list[int]:
        """The longest start of a matched chain that a sequence can resume from: all of
        it, or with recurrent states up to its last block that holds them."""
        if not self.needs_state:
            return nodes
        n = len(nodes)
        while n and not self._nodes[nodes[n - 1]].state:
            n -= 1
        return nodes[:n]

    def partial(self, parent: int, tokens) -> tuple[int, int] | None:
        """A cached block after ``parent`` whose first ``m`` tokens are the first of
        ``tokens`` (fewer than a block: what the prompt has left before its last token),
        the longest such, as (node, m); None when none starts with ``tokens[0]``. Its KV
        for those ``m`` tokens is the prompt's own (a token's keys and values depend on
        the tokens before it alone), so a prompt reuses them too, as llama.cpp reuses a
        slot token by token. Not with recurrent states: they exist at a block's end only."""
        if self.needs_state or not tokens:
            return None
        best, most = None, 0
        for node in self._kids.get(parent, ()):
            have = self._nodes[node].key[1]
            m = 0
            while m < min(len(tokens), len(have)) and have[m] == tokens[m]:
                m += 1
            if m > most:
                best, most = node, m
        return (best, most) if best is not None else None

    def touch(self, nodes) -> None:
        """Used now: the chain's end first, so that its start stays the more recent."""
        for n in reversed(nodes):
            if n in self._nodes:
                self._lru.move_to_end(n)

    def bid(self, node: int) -> int:
        return self._nodes[node].bid

    def alive(self, node: int) -> bool:
        return node == ROOT or node in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    # -- writing ---------------------------------------------------------------------

    def add(self, parent: int, tokens, state: bool = False) -> tuple[int, int | None] | None:
        """The node of block ``tokens`` after ``parent``: an existing one (block id None:
        nothing to store), or a new one with the block id to store it in (evicting the
        least recently used leaf when full, never ``parent``); None when there is no room.
        ``state``: the block can be stored with the recurrent states after it (a model that
        needs them): a new node keeps them, and an existing node without them gets them
        (its own block id returned: store the block again)."""
        key = self.key(parent, tokens)
        node = self._by_key.get(key)
        state = state and self.needs_state
        if node is not None:
            self._lru.move_to_end(node)
            nd = self._nodes[node]
            if state and not nd.state and self._room(self.state_cost, (parent, node)):
                nd.state = True
                self.used += self.state_cost
                return node, nd.bid
            return node, None
        if not self.alive(parent) or self.capacity <= 0:
            return None
        cost = 1 + (self.state_cost if state else 0)
        if not self._room(cost, (parent,)):
            if not state or not self._room(1, (parent,)):
                return None
            state, cost = False, 1  # the KV alone still continues the chain
        node, self._next = self._next, self._next + 1
        bid = self._free.pop()
        self._nodes[node] = _Node(bid, key, state=state)
        self._by_key[key] = node
        self._lru[node] = None
        self.used += cost
        self._kids.setdefault(parent, set()).add(node)
        if parent != ROOT:
            self._nodes[parent].children += 1
        self.saved += 1
        return node, bid

    def _room(self, cost: int, exclude: tuple) -> bool:
        """Evict until ``cost`` more fits (and a block id is free); False if it cannot."""
        while self.used + cost > self.capacity or not self._free:
            if not self._evict(exclude):
                return False
        return True

    def _evict(self, exclude: tuple) -> bool:
        for node in self._lru:
            nd = self._nodes[node]
            if nd.children == 0 and node not in exclude:
                break
        else:
            return False
        del self._lru[node], self._nodes[node], self._by_key[nd.key]
        parent = nd.key[0]
        self._kids[parent].discard(node)
        if not self._kids[parent]:
            del self._kids[parent]
        if parent != ROOT:
            self._nodes[parent].children -= 1
        self._free.append(nd.bid)
        self.used -= 1 + (self.state_cost if nd.state else 0)
        self.evictions += 1
        return True

    # -- stats -------------------------------------------------------------------------

    def stats(self) -> dict:
        """What the cache holds and has saved (rank 0; plain numbers, for logs and metrics)."""
        return {"blocks": len(self._nodes), "capacity_blocks": self.capacity,
                "block_tokens": self.block, "bytes_used": self.used * self.block_bytes,
                "capacity_bytes": self.capacity * self.block_bytes, "lookups": self.lookups,
                "hits": self.hits, "tokens_reused": self.tokens_reused, "saved": self.saved,
                "evictions": self.evictions}


# -- sizing ------------------------------------------------------------------------------


def block_bytes(cfg, placement, block: int = BLOCK) -> list[int]:
    """Bytes one block of ``block`` tokens takes on each world rank of ``placement``
    (its layers, its KV heads)."""
    return [block * placement.kv_token_bytes(cfg, r) for r in range(placement.size)]


def state_cost(cfg, placement, block: int = BLOCK) -> int:
    """Blocks of the budget that one block's recurrent states take besides its KV (pure,
    global): the most any rank's states take, in blocks of the rank holding the most
    (:func:`capacity`'s unit), rounded up; 0 for a model of attention layers alone."""
    states = max(placement.state_bytes(cfg, r) for r in range(placement.size))
    per = max(block_bytes(cfg, placement, block))
    return -(-states // per) if states and per else 0


def capacity(cfg, placement, gb: float | None, block: int = BLOCK) -> tuple[int, str]:
    """(blocks the prefix cache holds, a line saying so or why it is off) (pure, global).

    ``gb``: ``--prefix-cache-gb``, the most any one rank keeps (None: the default,
    :data:`DEFAULT_GB` at most half of what the weights and slots leave on the tightest
    rank; 0: off). A ``gb`` larger than what some rank has left after its weights and KV
    cache is a UsageError naming that rank. A family whose layers carry a recurrent state
    keeps it in some blocks too (:func:`state_cost` blocks more each; the line says so).
    """
    if gb is not None and gb == 0:
        return 0, "prefix cache: off (--prefix-cache-gb 0)"
    per = block_bytes(cfg, placement, block)
    left = [b - n for b, n in zip(placement.budgets, placement.need)]
    if gb is None:
        budget = min(DEFAULT_GB * GIB, max(0.0, min(left) / 2)) if any(placement.budgets) \
            else DEFAULT_GB * GIB
    else:
        budget = gb * GIB
    n = int(budget // max(per)) if max(per) > 0 else 0
    if gb is not None and any(placement.budgets):
        fits = min(max(0.0, room) / p for p, room in zip(per, left) if p > 0) * max(per) / GIB
        fits = math.floor(fits * 100) / 100  # as printed, and still fitting
        for r, (p, room) in enumerate(zip(per, left)):
            if n * p > room:
                where = f"rank {r} on {placement.hosts[r]}" if placement.size > 1 else \
                    f"{placement.hosts[r]}"
                raise UsageError(f"--prefix-cache-gb {gb:g}: {where} has "
                                 f"{max(0.0, room) / GIB:.2f} GiB left after the weights and "
                                 f"KV cache ({placement.need[r] / GIB:.2f} of its "
                                 f"{placement.budgets[r] / GIB:.2f} GiB); expected at most "
                                 f"{fits:.2f}")
    if n == 0:
        return 0, "prefix cache: off (no room for one block)"
    line = (f"prefix cache: {n} blocks of {block} tokens, {n * max(per) / GIB:.2f} GiB "
            "at most per rank")
    cost = state_cost(cfg, placement, block)
    if cost:
        line += (f"; a block that holds the linear-attention states takes {cost} more "
                 f"({n // (1 + cost)} such blocks at most)")
    return n, line


def note(line: str) -> None:
    """Rank 0's one line about the prefix cache."""
    print(line, file=sys.stderr, flush=True)
