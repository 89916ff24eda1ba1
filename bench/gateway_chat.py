"""A multi-turn chat workload for `python -m bench.gateway`: conversations that come back.

The Mooncake sample has little reuse: a perfect router reaches only 1.39x round robin's hit
ratio on it. Chat is where prefix-aware routing pays: each turn's prompt is the whole
conversation so far, so the engine that served a conversation's previous turn already holds
all of its prompt but the newest exchange.

`conversations` conversations of `turns` turns each. Turn t (1-based) of conversation c sends
as `prompt` (token ids, `/v1/completions`):

    system prompt + user(c, 1) + reply(c, 1) + ... + user(c, t-1) + reply(c, t-1) + user(c, t)

* the system prompt (`system_tokens`) is the same for every conversation;
* each user message (`user_tokens`) is fixed pseudo-random token ids of (c, t);
* the assistant's reply to turn t is a fixed synthetic reply (`reply_tokens` ids of (c, t)), not
  the text the engine returned: the stand-in's text is filler, and taking the real answer would
  make the prompts, hence the hit ratios, depend on the run. The engine generates `reply_tokens`
  tokens (`max_tokens`), so its decode work matches the reply's length. The cost: the blocks the
  engine cached for its own answer never match the next prompt, for any router (a real engine's
  answer would be cached and hit); every policy, and the ideal, loses the same.

All ids come from SHAKE-128 of a label (the same on every machine and Python version), in
[0, 4000) like the Mooncake workload's.

Timing: the turns go out on a steady clock, one every 1 / `rate` s. Which conversation speaks
in each slot is drawn (seeded) among those whose last turn was at least `min_gap` slots ago,
fewest turns first: the conversations interleave in a shuffled order, so no router (Envoy's
round robin included) lines a conversation up with one engine by counting. A turn is sent only
after its conversation's previous answer has ended (a user reads the answer, then writes); if
that answer is still streaming at the slot's time, the turn goes when it ends, and the delay is
recorded as lateness.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from .gateway_load import Client, Outcome, Planned
from .gateway_stack import MODEL
from .gateway_trace import VOCABULARY


@dataclass(frozen=True)
class ChatShape:
    conversations: int = 24
    turns: int = 6
    system_tokens: int = 200
    user_tokens: int = 96
    reply_tokens: int = 64
    rate: float = 9.0  # turns per second, all conversations together
    min_gap: int = 12  # slots between two turns of one conversation, at least (where possible)
    seed: int = 0


@dataclass(frozen=True)
class ChatTurn:
    planned: Planned  # at: the slot's time
    conversation: int
    turn: int  # 1-based
    previous: int | None  # index (in the plan) of this conversation's previous turn


def _tokens(label: str, count: int) -> list[int]:
    digest = hashlib.shake_128(label.encode()).digest(2 * count)
    return [int.from_bytes(digest[i:i + 2], "little") % VOCABULARY for i in range(0, 2 * count, 2)]


def system_prompt(shape: ChatShape) -> list[int]:
    return _tokens("chat-system", shape.system_tokens)


def prompt(shape: ChatShape, conversation: int, turn: int) -> list[int]:
    """The prompt of one turn: the conversation so far, ending with the new user message."""
    tokens = system_prompt(shape)
    for earlier in range(1, turn):
        tokens += _tokens(f"chat-user:{conversation}:{earlier}", shape.user_tokens)
        tokens += _tokens(f"chat-reply:{conversation}:{earlier}", shape.reply_tokens)
    return tokens + _tokens(f"chat-user:{conversation}:{turn}", shape.user_tokens)


def speaking_order(shape: ChatShape) -> list[int]:
    """Which conversation speaks in each slot (see the module's docstring)."""
    rng = random.Random(shape.seed)
    done = [0] * shape.conversations
    last = [-shape.min_gap] * shape.conversations
    order: list[int] = []
    for slot in range(shape.conversations * shape.turns):
        left = [c for c in range(shape.conversations) if done[c] < shape.turns]
        eligible = [c for c in left if slot - last[c] >= shape.min_gap] or left
        fewest = min(done[c] for c in eligible)
        chosen = rng.choice([c for c in eligible if done[c] == fewest])
        order.append(chosen)
        done[chosen] += 1
        last[chosen] = slot
    return order


def build(shape: ChatShape, path: str = "/v1/completions") -> list[ChatTurn]:
    plan: list[ChatTurn] = []
    latest: dict[int, int] = {}
    turn_of = [0] * shape.conversations
    for slot, conversation in enumerate(speaking_order(shape)):
        turn_of[conversation] += 1
        turn = turn_of[conversation]
        body = orjson.dumps({"model": MODEL, "prompt": prompt(shape, conversation, turn),
                             "max_tokens": shape.reply_tokens, "stream": True,
                             "stream_options": {"include_usage": True}})
        plan.append(ChatTurn(Planned(slot / shape.rate, path, body), conversation, turn, latest.get(conversation)))
        latest[conversation] = slot
    return plan


async def conversation_loop(base_url: str, plan: Sequence[ChatTurn]) -> tuple[list[Outcome], float]:
    """Each turn at its slot's time, but not before its conversation's previous answer has
    ended; (outcomes in plan order, wall seconds). `Outcome.late`: how long after its slot a
    turn went out (its previous answer still streaming, or the generator behind)."""
    client = Client(base_url)
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks: list[asyncio.Task[Outcome]] = []

    async def send(item: ChatTurn, before: asyncio.Task[Outcome] | None) -> Outcome:
        if before is not None:
            await before
        delay = start + item.planned.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        return await client.post(item.planned.path, item.planned.body, late=max(0.0, -delay))

    for item in plan:
        delay = start + item.planned.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        before = tasks[item.previous] if item.previous is not None else None
        tasks.append(loop.create_task(send(item, before)))
    outcomes = list(await asyncio.gather(*tasks))
    wall = loop.time() - start
    await client.close()
    return outcomes, wall


def footprint_blocks(shape: ChatShape, block_size: int) -> int:
    """KV blocks all conversations' last prompts and answers fill (the shared system prompt once)."""
    last = len(prompt(shape, 0, shape.turns)) + shape.reply_tokens
    shared = shape.system_tokens // block_size
    return shape.conversations * (-(-last // block_size) - shared) + shared
