"""The tiered expert store: a resident arena, recently read blobs, and SSD reads ahead of need.

Tiers, fastest first:
- arena: anonymous memory (huge pages where the kernel gives them) holding the experts the memory plan keeps in
  RAM. Filled hottest-first from a routing profile at load, or admitted on first use when there is none; adapted
  every few tokens by decayed routing counts (hot experts just read from the SSD are copied in, in place of the
  coldest residents: no extra I/O).
- recent: a small set of slots that receives SSD reads, least recently used first out. A layer's misses and the
  next layer's predicted experts are read here.
- the file: whole blobs read by reader threads with O_DIRECT (experts.reader).

All slot bookkeeping happens on the token thread under one condition variable; reader threads only fill a slot
and mark it ready (or record an error). A slot in use by the current layer is pinned; a slot being read is never
given to another expert. Every wait ends: a read that makes no progress for `read_timeout_s` is an error.
"""
from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from strata_nb.errors import StrataError
from strata_nb.experts.profile import RoutingProfile
from strata_nb.experts.reader import ALIGN, DEMAND, FILL, LOOKAHEAD, BlobReader
from strata_nb.experts.source import ExpertSource
from strata_nb.experts.store import KINDS, ExpertStore, Wave

EMPTY, READING, READY = 0, 1, 2


@dataclass
class LayerLayout:
    """How one layer's expert blobs are read and laid out in a slot."""

    slot_bytes: int  # a slot of this size holds any expert of the layer
    extents: list[tuple[tuple[int, int], ...]]  # per expert: aligned (file offset, length) reads, back to back
    pos: dict[str, np.ndarray]  # per kind: byte position of expert e's matrix inside its slot


def layer_layout(src: ExpertSource, layer: int) -> LayerLayout:
    """Aligned extents covering an expert's three matrices (one extent for a pack blob, three for a GGUF)."""
    mats = [src.matrix(layer, k) for k in KINDS]
    n_expert = mats[0].n_expert
    extents: list[tuple[tuple[int, int], ...]] = []
    pos = {k: np.zeros(n_expert, np.int64) for k in KINDS}
    slot_bytes = 0
    for e in range(n_expert):
        ext: list[list[int]] = []  # [file start, length, position in slot]
        for off, n, kind in sorted((int(m.offsets[e]), m.nbytes, k) for m, k in zip(mats, KINDS)):
            a, b = off // ALIGN * ALIGN, -(-(off + n) // ALIGN) * ALIGN
            if ext and a <= ext[-1][0] + ext[-1][1]:  # overlaps or touches the previous extent: extend it
                ext[-1][1] = max(ext[-1][0] + ext[-1][1], b) - ext[-1][0]
            else:
                ext.append([a, b - a, (ext[-1][2] + ext[-1][1]) if ext else 0])
            pos[kind][e] = ext[-1][2] + off - ext[-1][0]
        extents.append(tuple((s, ln) for s, ln, _ in ext))
        slot_bytes = max(slot_bytes, ext[-1][2] + ext[-1][1])
    return LayerLayout(slot_bytes, extents, pos)


class SlotPool:
    """n slots of slot_bytes in one anonymous mapping, 4 KiB aligned (O_DIRECT reads land in them directly)."""

    def __init__(self, slot_bytes: int, n: int, arena: bool):
        self.slot_bytes, self.n, self.arena = slot_bytes, n, arena
        self.mem = mmap.mmap(-1, max(1, n) * slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.mem.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # transparent huge pages off: ordinary pages work, a little slower to scan
        self.buf = np.frombuffer(self.mem, np.uint8)
        self.addr = self.buf.ctypes.data
        self.key = np.full(n, -1, np.int64)  # layer * n_expert + expert, or -1
        self.state = np.zeros(n, np.int8)
        self.pins = np.zeros(n, np.int32)
        self.last = np.zeros(n, np.int64)  # use tick, for least-recently-used eviction
        self.prefetched = np.zeros(n, np.bool_)  # read by lookahead and not used yet
        self.used = 0  # arena: slots handed out so far (admission on first use fills them in order)

    def view(self, s: int) -> memoryview:
        return memoryview(self.mem)[s * self.slot_bytes:(s + 1) * self.slot_bytes]

    def slot(self, s: int) -> np.ndarray:
        return self.buf[s * self.slot_bytes:(s + 1) * self.slot_bytes]


class TieredStore(ExpertStore):
    tiered = True
    lookahead_k = 0  # set by the engine: experts per token predicted for the next layer (0: no lookahead)

    def __init__(self, src: ExpertSource, n_expert: int, arena_bytes: int, recent_slots: int, *,
                 profile: RoutingProfile | None = None, reader_threads: int = 8, direct: bool = True,
                 read_timeout_s: float = 60.0, adapt_every: int = 4, adapt_swaps: int = 32, decay: float = 0.7,
                 layouts: dict[int, LayerLayout] | None = None,
                 progress: Callable[[int, int], None] | None = None):
        super().__init__(src, profile)
        self.n_expert = n_expert
        self.read_timeout_s = read_timeout_s
        self.adapt_every, self.adapt_swaps, self.decay = adapt_every, adapt_swaps, decay
        self.layouts = layouts or {l: layer_layout(src, l) for l in src.layers}
        n_layer = max(src.layers) + 1
        # One arena and one recent pool per slot size (layers of one quant mix share a size, so usually one).
        by_size: dict[int, list[int]] = {}
        for l, lay in self.layouts.items():
            by_size.setdefault(lay.slot_bytes, []).append(l)
        total = sum(sb * len(ls) * n_expert for sb, ls in by_size.items())
        self.pools: list[SlotPool] = []
        self._arena: dict[int, int] = {}
        self._recent: dict[int, int] = {}
        for sb, ls in sorted(by_size.items()):
            share = arena_bytes * (sb * len(ls) * n_expert) / total if total else 0
            n_arena = min(len(ls) * n_expert, int(share // sb))
            self._arena[sb] = len(self.pools)
            self.pools.append(SlotPool(sb, n_arena, arena=True))
            self._recent[sb] = len(self.pools)
            self.pools.append(SlotPool(sb, max(2, recent_slots), arena=False))
        self._pool_addr = np.array([pool.addr for pool in self.pools], np.int64)
        self.loc_pool = np.full((n_layer, n_expert), -1, np.int16)
        self.loc_slot = np.full((n_layer, n_expert), -1, np.int32)
        self.cond = threading.Condition()
        self._pending: dict[tuple[int, int], int] = {}  # (pool, slot) -> extents still being read
        self.error: str | None = None
        self.tick = 0
        self.tokens = 0
        self.window = np.zeros((n_layer, n_expert))  # routed since the last adaptation round
        self.decayed = np.zeros((n_layer, n_expert))
        if profile is not None and profile.tokens > 0:
            # Start the decayed counts at their steady state under the profile's routing rates.
            self.decayed = profile.counts / profile.tokens * adapt_every / (1.0 - decay)
        self._tmp = None
        self.reader = BlobReader(src.path, threads=reader_threads, direct=direct)
        self.direct = self.reader.direct
        if profile is not None and profile.counts.sum() > 0:
            self._fill(profile, progress)

    # -- sizes --------------------------------------------------------------------------------------------
    @property
    def arena_slots(self) -> int:
        return sum(self.pools[p].n for p in self._arena.values())

    def resident(self) -> np.ndarray:
        """bool[n_layer, n_expert]: experts held (and fully read) in the arena."""
        out = np.zeros(self.loc_pool.shape, np.bool_)
        for p in self._arena.values():
            pool = self.pools[p]
            ok = (pool.key >= 0) & (pool.state == READY)
            out.reshape(-1)[pool.key[ok]] = True
        return out

    # -- slots --------------------------------------------------------------------------------------------
    def _evict(self, p: int, s: int) -> None:
        pool = self.pools[p]
        k = int(pool.key[s])
        if k >= 0:
            l, e = divmod(k, self.n_expert)
            self.loc_pool[l, e] = -1
            self.loc_slot[l, e] = -1
            if pool.prefetched[s]:
                self.io.lookahead_wasted_bytes += self.expert_bytes[l]
        pool.key[s] = -1
        pool.state[s] = EMPTY
        pool.prefetched[s] = False

    def _free_slot(self, layer: int, admit: bool = True) -> tuple[int, int] | None:
        """A slot for a new read of one of layer's experts: a never-used arena slot (admission on first use; not
        for lookahead guesses), else the least recently used recent slot that is neither pinned nor being read."""
        sb = self.layouts[layer].slot_bytes
        a = self.pools[self._arena[sb]]
        if admit and a.used < a.n:
            a.used += 1
            return self._arena[sb], a.used - 1
        p = self._recent[sb]
        pool = self.pools[p]
        ok = (pool.pins == 0) & (pool.state != READING)
        if not ok.any():
            return None
        s = int(np.argmin(np.where(ok, pool.last, np.iinfo(np.int64).max)))
        self._evict(p, s)
        return p, s

    def _issue(self, layer: int, e: int, p: int, s: int, priority: int) -> None:
        """Queue the reads of expert e of layer into slot s of pool p: one job per extent, so the three matrices
        of a GGUF expert are read in parallel (the SSD needs requests in flight more than it needs big ones)."""
        pool = self.pools[p]
        pool.key[s] = layer * self.n_expert + e
        pool.state[s] = READING
        pool.last[s] = self.tick
        self.loc_pool[layer, e] = p
        self.loc_slot[layer, e] = s
        extents = self.layouts[layer].extents[e]
        self._pending[(p, s)] = len(extents)
        view = pool.view(s)
        pos = 0
        for ext in extents:
            self.reader.submit(priority, (ext,), view[pos:pos + ext[1]],
                               lambda job, err, p=p, s=s: self._landed(p, s, job, err))
            pos += ext[1]

    def _landed(self, p: int, s: int, job, err: str | None) -> None:  # on a reader thread
        with self.cond:
            if err is not None:
                self.error = self.error or f"expert read failed: {err}"
            else:
                self.io.ssd_read_bytes += job.nbytes
                self._pending[(p, s)] -= 1
                if self._pending[(p, s)] == 0:
                    del self._pending[(p, s)]
                    self.pools[p].state[s] = READY
            self.cond.notify_all()

    def _check(self) -> None:
        if self.error is not None:
            raise StrataError(self.error)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding self.cond) until ready(); a read error or no progress for read_timeout_s raises."""
        t0 = time.perf_counter()
        landed = self.io.ssd_read_bytes
        deadline = time.monotonic() + self.read_timeout_s
        while True:
            self._check()
            if ready():
                break
            if self.io.ssd_read_bytes != landed:  # reads are landing: the disk is slow, not stuck
                landed = self.io.ssd_read_bytes
                deadline = time.monotonic() + self.read_timeout_s
            left = deadline - time.monotonic()
            if left <= 0:
                raise StrataError(f"expert reads from {self.src.path.name} made no progress for "
                                  f"{self.read_timeout_s:g} s while waiting for {what} (disk stalled?)")
            self.cond.wait(min(left, 1.0))
        self.io.read_wait_s += time.perf_counter() - t0

    def _addresses(self, layer: int, experts: np.ndarray, groups: list[int]) -> Wave:
        lay = self.layouts[layer]
        g = np.asarray(groups, np.int64)
        e = experts[g]
        p = self.loc_pool[layer, e]
        s = self.loc_slot[layer, e]
        base = self._pool_addr[p] + s.astype(np.int64) * lay.slot_bytes
        return Wave(g, base + lay.pos["gate"][e], base + lay.pos["up"][e], base + lay.pos["down"][e])

    # -- the store interface ------------------------------------------------------------------------------
    def routed(self, layer: int, experts: np.ndarray, n_tokens: np.ndarray) -> None:
        super().routed(layer, experts, n_tokens)
        self.window[layer, experts] += n_tokens

    def waves(self, layer: int, experts: np.ndarray) -> Iterator[Wave]:
        nb = self.expert_bytes[layer]
        io = self.io
        pinned: list[tuple[int, int]] = []
        ready: list[int] = []
        waiting: list[int] = []
        queued: list[int] = []
        with self.cond:
            self._check()
            self.tick += 1
            for gi, e in enumerate(experts.tolist()):
                p = int(self.loc_pool[layer, e])
                if p >= 0:
                    s = int(self.loc_slot[layer, e])
                    pool = self.pools[p]
                    pool.pins[s] += 1
                    pool.last[s] = self.tick
                    pinned.append((p, s))
                    if pool.arena and not pool.prefetched[s]:
                        io.served["arena"] += nb
                    elif pool.prefetched[s]:
                        pool.prefetched[s] = False
                        io.lookahead_used += 1
                        io.served["ssd"] += nb
                    else:
                        io.served["recent"] += nb
                    (ready if pool.state[s] == READY else waiting).append(gi)
                else:
                    queued.append(gi)
                    io.demand_reads += 1
                    io.served["ssd"] += nb
            queued = self._issue_queued(layer, experts, queued, pinned, waiting)
            first = self._addresses(layer, experts, ready) if ready else None
        try:
            if first is not None:
                yield first
            while waiting or queued:
                with self.cond:
                    # Wait for a read of this layer to land, or (all slots busy) for a slot to come free.
                    self._wait(lambda: any(self._state(layer, experts[gi]) == READY for gi in waiting)
                               or (bool(queued) and self._has_free(layer)), f"layer {layer}'s experts")
                    queued = self._issue_queued(layer, experts, queued, pinned, waiting)
                    done = [gi for gi in waiting if self._state(layer, experts[gi]) == READY]
                    if not done:
                        continue
                    waiting = [gi for gi in waiting if gi not in done]
                    wave = self._addresses(layer, experts, done)
                yield wave
                with self.cond:  # the wave is computed: its recent slots may take the queued reads
                    for gi in done:
                        e = experts[gi]
                        p, s = int(self.loc_pool[layer, e]), int(self.loc_slot[layer, e])
                        self.pools[p].pins[s] -= 1
                        pinned.remove((p, s))
                    queued = self._issue_queued(layer, experts, queued, pinned, waiting)
        finally:
            with self.cond:
                for p, s in pinned:
                    self.pools[p].pins[s] -= 1

    def _has_free(self, layer: int) -> bool:
        sb = self.layouts[layer].slot_bytes
        a, r = self.pools[self._arena[sb]], self.pools[self._recent[sb]]
        return a.used < a.n or bool(((r.pins == 0) & (r.state != READING)).any())

    def _state(self, layer: int, e: int) -> int:
        return int(self.pools[int(self.loc_pool[layer, e])].state[int(self.loc_slot[layer, e])])

    def _issue_queued(self, layer, experts, queued, pinned, waiting) -> list[int]:
        rest = []
        for gi in queued:
            slot = self._free_slot(layer)
            if slot is None:
                rest.append(gi)
                continue
            p, s = slot
            self._issue(layer, int(experts[gi]), p, s, DEMAND)
            self.pools[p].pins[s] += 1
            pinned.append((p, s))
            waiting.append(gi)
        return rest

    def prefetch(self, layer: int, experts: np.ndarray) -> None:
        if layer not in self.layouts:
            return
        # Lookahead may take at most half of the recent slots: the other half stays for demand reads.
        cap = self.pools[self._recent[self.layouts[layer].slot_bytes]].n // 2
        with self.cond:
            self._check()
            for e in experts.tolist():
                if cap <= 0:
                    return
                if self.loc_pool[layer, e] >= 0:
                    continue
                slot = self._free_slot(layer, admit=False)
                if slot is None:
                    return
                p, s = slot
                self._issue(layer, e, p, s, LOOKAHEAD)
                self.pools[p].prefetched[s] = True
                cap -= 1

    def end_forward(self, n_tokens: int) -> None:
        super().end_forward(n_tokens)
        before = self.tokens
        self.tokens += n_tokens
        if self.adapt_every > 0 and self.tokens // self.adapt_every != before // self.adapt_every:
            self.decayed = self.decayed * self.decay + self.window
            self.window[:] = 0
            self._adapt()
        self.io.ssd_busy_s = self.reader.busy_s

    # -- adaptive placement -------------------------------------------------------------------------------
    def _adapt(self) -> None:
        """Promote the hottest experts of the recent set into the arena in place of the coldest residents.

        Only blobs already in RAM are promoted (a copy, no I/O): an expert that is hot was just used, so it is in
        the recent set. The demoted expert takes the promoted one's recent slot, so nothing is dropped."""
        with self.cond:
            for sb, ap in self._arena.items():
                arena, recent = self.pools[ap], self.pools[self._recent[sb]]
                if arena.n == 0:
                    continue
                cand = np.flatnonzero((recent.key >= 0) & (recent.state == READY) & (recent.pins == 0))
                res = np.flatnonzero((arena.key >= 0) & (arena.state == READY) & (arena.pins == 0))
                if not cand.size or not res.size:
                    continue
                flat = self.decayed.reshape(-1)
                cand = cand[np.argsort(-flat[recent.key[cand]], kind="stable")]
                res = res[np.argsort(flat[arena.key[res]], kind="stable")]
                if self._tmp is None or self._tmp.shape[0] < sb:
                    self._tmp = np.empty(sb, np.uint8)
                tmp = self._tmp[:sb]
                for rs, as_ in zip(cand[:self.adapt_swaps], res[:self.adapt_swaps]):
                    hot, cold = int(recent.key[rs]), int(arena.key[as_])
                    if flat[hot] <= flat[cold] + 1.0:  # hysteresis: a tie is not worth a copy
                        break
                    tmp[:] = arena.slot(as_)
                    arena.slot(as_)[:] = recent.slot(rs)
                    recent.slot(rs)[:] = tmp
                    arena.key[as_], recent.key[rs] = hot, cold
                    recent.prefetched[rs] = False
                    for k, p, s in ((hot, ap, as_), (cold, self._recent[sb], rs)):
                        l, e = divmod(k, self.n_expert)
                        self.loc_pool[l, e], self.loc_slot[l, e] = p, s
                    self.io.swaps += 1

    # -- profile fill -------------------------------------------------------------------------------------
    def _fill(self, profile: RoutingProfile, progress: Callable[[int, int], None] | None) -> None:
        """Read the hottest experts of the profile into the arena until it is full."""
        todo: list[tuple[int, int, int, int]] = []  # layer, expert, pool, slot
        for l, e in profile.ranked().tolist():
            if l not in self.layouts:
                continue
            ap = self._arena[self.layouts[l].slot_bytes]
            a = self.pools[ap]
            if a.used < a.n:
                todo.append((l, e, ap, a.used))
                a.used += 1
            elif all(self.pools[p].used >= self.pools[p].n for p in self._arena.values()):
                break
        total = sum(self.expert_bytes[l] for l, _, _, _ in todo)
        done = 0
        with self.cond:
            for l, e, ap, s in todo:
                self._issue(l, e, ap, s, FILL)
            for l, e, ap, s in todo:
                self._wait(lambda: self.pools[ap].state[s] == READY, "the arena fill")
                done += self.expert_bytes[l]
                if progress is not None:
                    progress(done, total)
        self.io.read_wait_s = 0.0  # the fill is load time, not token time
        self.io.ssd_read_bytes = 0
        self.reader.busy_s = 0.0

    def close(self) -> None:
        self.reader.close()
