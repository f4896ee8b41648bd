"""The HF engine's rows: a decode batch over one KV cache that rows join and leave as their turns end.

A row decodes its turn with the others in the batch; when the turn ends (EOS or max_new_tokens) the
row leaves the batch, its keys and values kept aside (from its first token on). When the
environment's answer is in, the row joins again: its inserted tokens (after its last sampled token,
which no forward has seen yet) are prefilled on top of its kept cache, and it decodes its next turn
with whichever rows are decoding then. No row waits for another's turn or tool call.

The cache may hold slots of no token (left padding to a common width, right padding of inserted
tokens of unequal length): the attention mask hides them, and each row's position ids count only its
real tokens, so every sampled token's log-prob is the one a forward pass over prompt + trajectory
gives (the trainer's).

A row's samples do not depend on the rows it shares a decode step with: its first turn draws from
its group's generator (one draw of G rows per step, as the single-turn engine always has: the
group's rows decode that turn together from the prefill on), each later turn from a generator of its
own, seeded by (group seed, row in group, turn).

Partial rollouts (rollout.partial) change the weights between decode steps: the rows still sampling
stop where they are (`decode`'s `interrupt`), and once the engine holds the new weights, `reload`
computes the cache of every row still in play again under them, from its prompt and its tokens so far
(a fresh prefill; a row between turns keeps its place, and its environment is not asked again), and
the stopped rows decode on in the same turn. Each sampled token is stamped with the version that
sampled it (`Turn.versions`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tidal.buckets import length_buckets
from tidal.rollout.decode_step import DecodeStep
from tidal.rollout.kv_slots import fill_holes, set_rows, stack_rows, with_spare_slots
from tidal.rollout.trajectory import Turn

INTERRUPTED = "interrupted"  # a turn stopped between tokens for new weights (rollout.partial)
JOIN_BUCKET_BITS = 5  # joining rows whose inserted tokens number up to 2**5 share one prefill


def turn_seed(group: int, row: int, turn: int) -> int:
    """Deterministic mode: the seed of row `row`'s turn `turn` in the group seeded `group` (vLLM: a
    request's seed; HF: the generator of the row's turns after its first)."""
    return ((group * 1_000_003 + row) * 1_000_003 + turn) % (2**63)


def gumbel_sample(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """argmax(logp + Gumbel noise) samples from softmax(logp) given uniform noise."""
    gumbel = -torch.log(-torch.log(uniform.clamp_(1e-20, 1.0 - 1e-7)))
    return torch.argmax(logprobs + gumbel, dim=-1)


def returned_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zeros before it along `dim`, to `width`."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def prefill_with_images(model, requests, ids: torch.Tensor, mask: torch.Tensor):
    """The prompts' prefill with their images (each request's once) at M-RoPE positions, computed by the model
    for each prompt alone and left-padded; returns the output and [rows, W] positions whose last column + 1
    is where each row's generated text goes (one past its prompt's largest position, in all three rows)."""
    from tidal.model.vision import image_token_id, prompt_positions, rope_owner  # the trainer's rule too

    owner, image_token = rope_owner(model), image_token_id(model)
    width = ids.shape[1]
    rope = torch.zeros(3, len(requests), width, dtype=torch.long, device=ids.device)
    for i, r in enumerate(requests):
        rope[:, i, width - len(r.prompt_ids) :] = prompt_positions(owner, ids[i, width - len(r.prompt_ids) :], r.images, image_token)
    with_images = [r.images for r in requests if r.images is not None]
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=rope,
        pixel_values=torch.cat([torch.tensor(i.pixel_values) for i in with_images]).to(ids.device),
        image_grid_thw=torch.cat([torch.tensor(i.image_grid_thw) for i in with_images]).to(ids.device),
        use_cache=True,
    )
    return out, rope.max(dim=0).values


@dataclass
class Slab:
    """Rows that run forward passes together: their cache (batch-major), attention mask over its
    slots, next position, and the logits of their next token."""

    cache: object
    mask: torch.Tensor  # [B, W] 1 = a real token
    next_pos: torch.Tensor  # [B, 1]
    logits: torch.Tensor  # [B, V]
    rows: list[int]

    def select(self, keep: list[int]) -> list[int]:
        """Only the rows at positions `keep` (ascending) stay: each row that left before the last staying one
        is filled by a staying row from after it, so only those rows' caches move. Returns where each
        staying row was (the new order)."""
        count, kept = len(keep), set(keep)
        holes = [i for i in range(count) if i not in kept]
        fillers = [i for i in keep if i >= count]  # as many as there are holes
        order = list(range(count))
        for hole, filler in zip(holes, fillers, strict=True):
            order[hole] = filler
        device = self.mask.device
        index = torch.tensor(order, dtype=torch.long, device=device)
        self.mask, self.next_pos, self.logits = self.mask[index], self.next_pos[index], self.logits[index]
        self.rows = [self.rows[i] for i in order]
        real = self.mask.any(0).nonzero()
        first = int(real[0]) if len(real) else self.mask.shape[1]  # slots before it: no row has a token there
        holes_at, fillers_at = (torch.tensor(x, dtype=torch.long, device=device) for x in (holes, fillers))
        for layer in self.cache.layers:
            fill_holes(layer, holes_at, fillers_at, count, first)
        self.mask = self.mask[:, first:]
        return order

    def merge(self, other: Slab) -> None:
        """`other`'s rows join this slab (both left-padded to the wider cache)."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            stack_rows(mine, theirs, width)
        self.mask = torch.cat([left_pad(self.mask, width, 1), left_pad(other.mask, width, 1)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows += other.rows


@dataclass
class Kept:
    """A row between turns: its keys and values per layer ([heads, slots, dim], from its first token on),
    which of those slots hold a token (a turn's inserted tokens shorter than another row's leave slots of
    none), and its last sampled token, which no forward has seen yet."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor  # [slots]
    next_pos: torch.Tensor  # [1]
    pending: int


@dataclass
class RowState:
    group: int  # the request's index
    index: int  # the row's index in its group
    turn: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None  # turns after the first
    history: list[int] = field(default_factory=list)  # the trajectory before this turn: earlier turns and inserted tokens
    stamped: list[int] = field(default_factory=list)  # rollout.partial: versions of this turn's tokens sampled before the last reload


class HFRows:
    """The rows of one engine call (G per request, in request order) over one decode batch."""

    def __init__(self, engine, requests, max_turns: int):
        self.engine, self.max_turns = engine, max_turns
        self.device = next(engine.model.parameters()).device  # the trainer's, when the model is shared with it
        self.requests: list = []
        self.state: list[RowState] = []
        self.kept: dict[int, Kept] = {}
        self.version: int | None = None  # rollout.partial: the weights' version, stamped on each sampled token
        self.stopped: list[int] = []  # rows stopped mid-turn for newer weights: they go on after `reload`
        self.slab: Slab | None = None
        self.step = DecodeStep.of(engine.model)  # None: decode steps take the transformers forward
        self.add(requests)

    @torch.no_grad()
    def add(self, requests) -> list[int]:
        """More requests' rows (G each, numbered after the rows already here): their prompts prefilled
        (each once, its cache copied to its G rows), and the rows join the decode batch. Returns them."""
        first_group, first_row = len(self.requests), len(self.state)
        self.requests += requests
        self.state += [RowState(first_group + g, j) for g, r in enumerate(requests) for j in range(r.n)]
        model, device = self.engine.model, self.device
        prompts = [r.prompt_ids for r in requests]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.engine.pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if any(r.images is not None for r in requests):
            out, positions = prefill_with_images(model, requests, ids, mask)
        else:
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        row_prompt = torch.repeat_interleave(torch.arange(len(requests), device=device), torch.tensor([r.n for r in requests], device=device))
        cache = with_spare_slots(returned_cache(out))
        cache.batch_select_indices(row_prompt)
        rows = list(range(first_row, len(self.state)))
        added = Slab(cache, mask[row_prompt], positions[row_prompt, -1:] + 1, out.logits[row_prompt, -1, :], rows)
        if self.slab is None or not self.slab.rows:
            self.slab = added
        else:
            self.slab.merge(added)
        return rows

    @property
    def rows(self) -> list[int]:
        return list(range(len(self.state)))

    @property
    def decoding(self) -> bool:
        return self.slab is not None and bool(self.slab.rows)

    def _noise(self, vocab: int) -> torch.Tensor:
        """Each decoding row's uniform noise for this step: see the module's docstring."""
        slab, parts, blocks = self.slab, [], {}
        for row in slab.rows:
            s = self.state[row]
            if s.turn == 0:
                if s.group not in blocks:
                    r = self.requests[s.group]
                    blocks[s.group] = torch.rand(r.n, vocab, generator=r.generator)
                parts.append(blocks[s.group][s.index])
            else:
                parts.append(torch.rand(vocab, generator=s.generator))
        return torch.stack(parts).to(self.device)

    def own_step(self) -> bool:
        """True: decode steps and joins take the engine's own forward (tidal.rollout.decode_step)."""
        return self.step is not None and not self.engine.model.training

    def _forward(self, slab: Slab, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        engine = self.engine
        out = engine.model(input_ids=input_ids, attention_mask=slab.mask, position_ids=positions, use_cache=True, **{engine.cache_kwarg: slab.cache})
        slab.cache = returned_cache(out)
        return out.logits

    @torch.no_grad()
    def decode(
        self, max_new_tokens: int, greedy: bool = False, wake: threading.Event | None = None, interrupt: Callable[[], bool] | None = None
    ) -> dict[int, Turn]:
        """Decodes the rows in the batch until at least one row's turn ends (or `wake` is set, or no
        row is left): row -> its ended turn. A row whose turn ended has left the batch. `interrupt`:
        asked after each step; True stops every row still sampling there: a single-turn call ends
        them (finish reason INTERRUPTED), a multi-turn one keeps them in `stopped`, their turns open,
        until `reload`."""
        engine, slab, ended = self.engine, self.slab, {}
        while slab is not None and slab.rows and not ended:
            lp = torch.log_softmax(slab.logits.float() / engine.temperature, dim=-1)
            nxt = lp.argmax(-1) if greedy else gumbel_sample(lp, self._noise(lp.shape[-1]))
            chosen = lp.gather(-1, nxt[:, None])[:, 0]
            step_tokens, step_logps = nxt.tolist(), chosen.tolist()  # one device sync per step, not per row
            keep, leave = [], []
            for i, row in enumerate(slab.rows):
                s = self.state[row]
                s.tokens.append(step_tokens[i])
                s.logprobs.append(step_logps[i])
                if step_tokens[i] == engine.eos or len(s.tokens) == max_new_tokens:
                    leave.append(i)
                    ended[row] = Turn(s.tokens, s.logprobs, "stop" if step_tokens[i] == engine.eos else "length", self._versions(s))
                    s.history += s.tokens
                    s.tokens, s.logprobs, s.stamped = [], [], []
                else:
                    keep.append(i)
            if leave:
                going_on = [i for i in leave if self.state[slab.rows[i]].turn + 1 < self.max_turns]
                if going_on:
                    self.kept.update(self._keep_aside(going_on, [step_tokens[i] for i in going_on]))
                nxt = nxt[torch.tensor(slab.select(keep), dtype=torch.long, device=self.device)]
            if not keep:
                break
            if interrupt is not None and interrupt():
                if self.max_turns == 1:
                    for row in slab.rows:  # the rows kept this step
                        s = self.state[row]
                        ended[row] = Turn(s.tokens, s.logprobs, INTERRUPTED)
                else:
                    self.stopped = list(slab.rows)
                slab.select([])
                break
            slab.mask = torch.cat([slab.mask, torch.ones_like(slab.mask[:, :1])], dim=1)
            if self.own_step():
                slab.logits = self.step.logits(nxt[:, None], slab.mask, slab.next_pos, slab.cache)
            else:
                slab.logits = self._forward(slab, nxt[:, None], slab.next_pos)[:, -1, :]
            slab.next_pos = slab.next_pos + 1
            if wake is not None and wake.is_set():
                break
        return ended

    def _versions(self, s: RowState) -> list[int] | None:
        """The versions of the turn `s` has sampled so far (None without rollout.partial)."""
        if self.version is None:
            return None
        return [*s.stamped, *[self.version] * (len(s.tokens) - len(s.stamped))]

    def _keep_aside(self, positions: list[int], pending: list[int], slab: Slab | None = None) -> dict[int, Kept]:
        """The rows at `positions` of `slab` (default: the decode batch), kept between turns: their caches
        gathered together, one copy per layer for all of them."""
        slab = slab or self.slab
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        masks = slab.mask[index]
        firsts = masks.ne(0).int().argmax(1).tolist()  # every row has a token (its prompt's at least)
        keys = [layer.keys.index_select(0, index) for layer in slab.cache.layers]
        values = [layer.values.index_select(0, index) for layer in slab.cache.layers]
        return {
            slab.rows[p]: Kept([k[j, :, f:] for k in keys], [v[j, :, f:] for v in values], masks[j, f:], slab.next_pos[p], token)
            for j, (p, f, token) in enumerate(zip(positions, firsts, pending, strict=True))
        }

    def drop(self, rows: list[int]) -> None:
        """Rows whose trajectories are over: their kept caches go."""
        for row in rows:
            self.kept.pop(row, None)

    @torch.no_grad()
    def reload(self, version: int) -> None:
        """The engine holds new weights, of `version` (rollout.partial; called between decode steps): every
        row still in play, between turns or stopped mid-turn, gets its cache computed again under them from
        its prompt and its tokens so far, and the stopped rows join the decode batch again, their turns
        going on. The tokens sampled so far keep the version that sampled them."""
        if any(r.images is not None for r in self.requests):
            raise ValueError("rollout.partial: a multi-turn row with images cannot be prefilled again under new weights yet")
        stopped, self.stopped = self.stopped, []
        for row in stopped:
            s = self.state[row]
            s.stamped = self._versions(s) or []
        self.version = version
        self.step = DecodeStep.of(self.engine.model)  # a new step: the old one's fused matrices copy the old weights
        rows = sorted([*self.kept, *stopped])
        if not rows:
            return
        contexts = [[*self.requests[self.state[row].group].prompt_ids, *self.state[row].history, *self.state[row].tokens] for row in rows]
        # each row's last token is one no forward has seen yet (a kept row's pending token, a stopped row's last sample)
        width = max(len(c) - 1 for c in contexts)
        ids = torch.tensor([[self.engine.pad] * (width - len(c) + 1) + c[:-1] for c in contexts], device=self.device)
        mask = torch.tensor([[0] * (width - len(c) + 1) + [1] * (len(c) - 1) for c in contexts], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.engine.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        prefilled = Slab(returned_cache(out), mask, positions[:, -1:] + 1, None, rows)
        self.kept.update(self._keep_aside(list(range(len(rows))), [c[-1] for c in contexts], prefilled))
        if stopped:
            self.join({row: [] for row in stopped}, next_turn=False)

    @torch.no_grad()
    def join(self, inserted: dict[int, list[int]], next_turn: bool = True) -> None:
        """Rows between turns take their next turn: `inserted[row]` (the environment's and the
        template's tokens) is prefilled after the row's last sampled token on its kept cache, and the
        rows join the decode batch. `next_turn` False: rows stopped mid-turn (`reload`) go on with it.
        Rows whose inserted tokens differ in length a lot are prefilled in separate forwards (a tool's
        long output would pad every short one to its length)."""
        rows = sorted(inserted)
        for bucket in length_buckets([len(inserted[row]) + 1 for row in rows], JOIN_BUCKET_BITS):
            self._join({rows[i]: inserted[rows[i]] for i in bucket}, next_turn)

    def _join(self, inserted: dict[int, list[int]], next_turn: bool) -> None:
        rows = sorted(inserted)
        kept = [self.kept.pop(row) for row in rows]
        chunks = [[k.pending, *inserted[row]] for row, k in zip(rows, kept)]
        width = max(k.keys[0].shape[1] for k in kept)
        template = self.slab.cache if self.slab is not None else None
        cache = copy.copy(template)
        cache.layers = [copy.copy(layer) for layer in template.layers]
        for n, layer in enumerate(cache.layers):  # with spare slots: the prefill below writes into them
            set_rows(layer, [k.keys[n][None] for k in kept], [k.values[n][None] for k in kept], width)
        mask = torch.stack([left_pad(k.mask, width, 0) for k in kept])
        span = max(len(c) for c in chunks)
        ids = torch.tensor([c + [self.engine.pad] * (span - len(c)) for c in chunks], device=self.device)
        real = torch.tensor([[1] * len(c) + [0] * (span - len(c)) for c in chunks], device=self.device)
        start = torch.stack([k.next_pos for k in kept])
        joining = Slab(cache, torch.cat([mask, real], dim=1), start, None, rows)
        # a padded slot gets any position: nothing ever attends to it
        positions = start + torch.arange(span, device=self.device)[None, :]
        last = torch.tensor([len(c) - 1 for c in chunks], device=self.device)
        if self.own_step():
            joining.logits = self.step.join_logits(ids, joining.mask, positions, joining.cache, last)
        else:
            joining.logits = self._forward(joining, ids, positions)[torch.arange(len(rows), device=self.device), last]
        joining.next_pos = start + last[:, None] + 1
        for row in rows:
            s = self.state[row]
            s.history += inserted[row]
            if not next_turn:
                continue
            s.turn += 1
            r = self.requests[s.group]
            s.generator = torch.Generator().manual_seed(turn_seed(group_seed_of(r), s.index, s.turn))
        self.slab.merge(joining)


def group_seed_of(request) -> int:
    """The seed of a request's group: its own (vLLM's), else its generator's."""
    if request.seed is not None:
        return request.seed
    return request.generator.initial_seed() if request.generator is not None else torch.seed()
