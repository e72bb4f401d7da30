"""The memory plan: what of a model lives where (RAM, SSD) before the first token, from what the machine has.

Dense weights are read every token: they stay in the page cache (the GGUF's memory map) and are counted in full.
The KV cache and the runtime (interpreter, compiled kernels, activations) come next. What is left of the budget
holds experts. When all of them fit, they are read in place from the map (the page cache holds them); when they
do not, the tiered store keeps the hottest in a resident arena and reads the rest from the SSD as whole blobs
into a small set of recent slots. A budget that cannot hold the fixed part, or one larger than what the machine
has, is refused with the numbers.

The GPU plan (hybrid engine) does the same for device memory: dense weights, the float16 KV cache, activation
buffers and the CUDA runtime first; what is left of the VRAM budget becomes expert slots, the same number in every
MoE layer (slots per layer, not a global pool: see experts.vram_cache).
"""
from __future__ import annotations

from dataclasses import dataclass

from strata_nb.errors import StrataError

GB = 1e9
RUNTIME_BYTES = 700 << 20  # interpreter, numba and its compiled kernels, tokenizer, activations (measured ~0.6 GB)
MIN_RESERVE = 1 << 30  # left to the operating system and other programs when the budget is automatic
RESERVE_FRACTION = 0.05


@dataclass(frozen=True)
class Machine:
    total_ram: int
    available_ram: int
    swap_free: int

    @classmethod
    def probe(cls) -> "Machine":
        """What this process may use: the machine (psutil), capped by its memory cgroup (containers)."""
        import psutil

        vm, sw = psutil.virtual_memory(), psutil.swap_memory()
        total, avail = int(vm.total), int(vm.available)
        cg = _cgroup_memory()
        if cg is not None:
            limit, free = cg
            total, avail = min(total, limit), min(avail, free)
        return cls(total, avail, int(sw.free))


def _cgroup_memory(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> tuple[int, int] | None:
    """(limit, available) of this process's memory cgroup (v2 or v1), or None when it sets no limit.

    Available is the limit minus what is charged, plus the inactive file cache (reclaimable), as the kernel
    estimates MemAvailable."""
    from pathlib import Path

    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if ctrls == "" and Path(root, path.lstrip("/"), "memory.max").exists():  # v2
            d = Path(root, path.lstrip("/"))
            raw = (d / "memory.max").read_text().strip()
            if raw == "max":
                return None
            limit, used = int(raw), int((d / "memory.current").read_text())
            stat = dict(l.split() for l in (d / "memory.stat").read_text().splitlines())
            return limit, max(0, limit - used + int(stat.get("inactive_file", 0)))
        if "memory" in ctrls.split(","):  # v1
            d = Path(root, "memory", path.lstrip("/"))
            if not (d / "memory.limit_in_bytes").exists():
                d = Path(root, "memory")
            limit = int((d / "memory.limit_in_bytes").read_text())
            if limit >= 1 << 60:  # "no limit" is a huge page-rounded number
                return None
            used = int((d / "memory.usage_in_bytes").read_text())
            stat = dict(l.split() for l in (d / "memory.stat").read_text().splitlines())
            return limit, max(0, limit - used + int(stat.get("total_inactive_file", stat.get("inactive_file", 0))))
    return None


@dataclass(frozen=True)
class MemoryPlan:
    machine: Machine
    budget: int  # RAM this run may use
    budget_from: str  # "automatic" or "--ram-budget"
    reserve: int  # left free for the system (automatic budget)
    dense: int
    kv: int
    runtime: int
    experts: int  # all routed-expert bytes
    mode: str  # "dense" (no experts), "mmap" (in place, page cache) or "tiered"
    arena: int  # tiered: experts resident in RAM
    recent: int  # tiered: slots receiving SSD reads
    slot_bytes: int  # tiered: one expert blob
    n_blobs: int  # experts (layer, expert) in the model

    @property
    def file_tier(self) -> int:
        """Expert bytes left on the SSD (tiered) or to the page cache's discretion (mmap beyond the budget)."""
        if self.mode == "tiered":
            return self.experts * (self.n_blobs - self.arena // self.slot_bytes) // self.n_blobs
        if self.mode == "mmap":
            return max(0, self.experts - max(0, self.budget - self.fixed))
        return 0

    @property
    def fixed(self) -> int:
        return self.dense + self.kv + self.runtime

    @property
    def used(self) -> int:
        if self.mode == "tiered":
            return self.fixed + self.arena + self.recent
        return self.fixed + min(self.experts, max(0, self.budget - self.fixed))

    def lines(self) -> list[str]:
        m = self.machine
        g = lambda n: f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1e6:.1f} MB"  # noqa: E731
        out = [f"RAM: {g(m.total_ram)} total, {g(m.available_ram)} available, swap {g(m.swap_free)} free; budget "
               f"{g(self.budget)} ({self.budget_from}" + (f", {g(self.reserve)} left to the system)"
                                                          if self.budget_from == "automatic" else ")"),
               f"  dense weights {g(self.dense)} (page cache, read every token), KV cache {g(self.kv)}, "
               f"runtime ~{g(self.runtime)}"]
        if self.mode == "dense":
            out.append("  no routed experts")
        elif self.mode == "mmap":
            fits = self.file_tier == 0
            out.append(f"  experts {g(self.experts)}: in place from the memory map"
                       + (" (all fit in RAM)" if fits else
                          f" (A/B arm: {g(self.file_tier)} beyond the budget, the page cache decides)"))
        else:
            n = self.arena // self.slot_bytes if self.slot_bytes else 0
            out.append(f"  experts {g(self.experts)}: {g(self.arena)} resident in RAM ({n} of {self.n_blobs} blobs, "
                       f"{100 * n / self.n_blobs:.0f}%), "
                       f"{g(self.file_tier)} read from the SSD into {g(self.recent)} of recent slots")
        out.append(f"plan uses {g(self.used)} of the {g(self.budget)} budget")
        return out


def make_plan(*, dense: int, kv: int, experts: int, n_blobs: int, slot_bytes: int, recent_slots: int,
              mode: str = "auto",
              ram_budget: float | None = None,
              machine: Machine | None = None, runtime: int = RUNTIME_BYTES) -> MemoryPlan:
    """Decide the RAM tiers. ram_budget in bytes (None: automatic). mode: auto, mmap or tiered."""
    m = machine or Machine.probe()
    if mode not in ("auto", "mmap", "tiered"):
        raise StrataError(f"unknown expert mode {mode!r} (auto, mmap or tiered)")
    reserve = max(MIN_RESERVE, int(RESERVE_FRACTION * m.total_ram))
    if ram_budget is not None:
        budget, source = int(ram_budget), "--ram-budget"
        if budget <= 0:
            raise StrataError(f"--ram-budget must be positive, got {ram_budget / GB:g} GB")
        if budget > m.total_ram:
            raise StrataError(f"--ram-budget {budget / GB:.2f} GB is more than this machine's RAM "
                              f"({m.total_ram / GB:.2f} GB)")
        if budget > m.available_ram:
            raise StrataError(f"--ram-budget {budget / GB:.2f} GB is more than the RAM available now "
                              f"({m.available_ram / GB:.2f} GB of {m.total_ram / GB:.2f} GB)")
    else:
        budget, source = m.available_ram - reserve, "automatic"
    fixed = dense + kv + runtime
    if fixed > budget:
        raise StrataError(f"the model needs {fixed / GB:.2f} GB before any expert (dense weights {dense / GB:.2f} + "
                          f"KV cache {kv / GB:.2f} + runtime {runtime / GB:.2f}), the RAM budget is "
                          f"{budget / GB:.2f} GB" + (" (try a smaller --ctx)" if kv > 0.1 * fixed else ""))
    if experts == 0:
        return MemoryPlan(m, budget, source, reserve, dense, kv, runtime, 0, "dense", 0, 0, 0, 0)
    if mode == "mmap" or (mode == "auto" and fixed + experts <= budget):
        return MemoryPlan(m, budget, source, reserve, dense, kv, runtime, experts, "mmap", 0, 0, slot_bytes,
                          n_blobs)
    recent = recent_slots * slot_bytes
    room = budget - fixed - recent
    if room < 0:
        raise StrataError(f"the RAM budget {budget / GB:.2f} GB leaves no room for the {recent_slots} expert read "
                          f"slots ({recent / GB:.2f} GB) after {fixed / GB:.2f} GB of dense weights, KV and runtime")
    arena = min(room // slot_bytes, n_blobs) * slot_bytes
    return MemoryPlan(m, budget, source, reserve, dense, kv, runtime, experts, "tiered", arena, recent, slot_bytes,
                      n_blobs)


GPU_RUNTIME_BYTES = 600 << 20  # CUDA context, numba's modules and the graphs (not in the free-memory reading)


@dataclass(frozen=True)
class GPUPlan:
    free: int
    total: int
    budget: int
    budget_from: str
    dense: int
    kv: int
    scratch: int
    runtime: int
    experts: int  # all routed-expert bytes
    slot_bytes: dict[int, int]  # per MoE layer: one expert's slot
    slots: dict[int, int]  # per MoE layer: expert slots in VRAM
    n_expert: int

    @property
    def fixed(self) -> int:
        return self.dense + self.kv + self.scratch + self.runtime

    @property
    def slot_total(self) -> int:
        return sum(self.slot_bytes[l] * n for l, n in self.slots.items())

    @property
    def share(self) -> float:
        """Fraction of the (layer, expert) pairs resident in VRAM."""
        return sum(self.slots.values()) / max(1, self.n_expert * len(self.slots))

    def lines(self) -> list[str]:
        g = lambda n: f"{n / GB:.2f} GB"  # noqa: E731
        n = sum(self.slots.values())
        per = sorted(set(self.slots.values()))
        return [f"VRAM: {g(self.free)} free of {g(self.total)}; budget {g(self.budget)} "
                f"({self.budget_from})",
                f"  dense weights {g(self.dense)}, KV cache {g(self.kv)} (float16), activations {g(self.scratch)}, "
                f"CUDA runtime ~{g(self.runtime)}",
                f"  expert slots {g(self.slot_total)}: {n} of {self.n_expert * len(self.slots)} experts "
                f"({100 * self.share:.0f}%), {'-'.join(str(p) for p in per) if per else 0} per layer; "
                f"the rest are computed by the CPU pool"]


def make_gpu_plan(*, free: int, total: int, dense: int, kv: int, scratch: int, experts: int,
                  slot_bytes: dict[int, int], n_expert: int, vram_budget: float | None = None,
                  runtime: int = GPU_RUNTIME_BYTES, layout: str = "slots") -> GPUPlan:
    """Expert slots per MoE layer from the VRAM budget (bytes; None: free memory minus a reserve). layout "slots":
    the same number in every MoE layer; "layers": every expert of as many layers as fit (the last ones first, as
    llama.cpp's -ncmoe keeps the first layers' experts on the CPU), none in the others (an experiment: a layer held
    whole needs no CPU pool call, a partly held one pays the pool's fixed cost however few choices miss)."""
    if layout not in ("slots", "layers"):
        raise StrataError(f"unknown VRAM layout {layout!r} (slots or layers)")
    reserve = max(MIN_RESERVE // 2, int(RESERVE_FRACTION * total))
    if vram_budget is not None:
        budget, source = int(vram_budget), "--vram-budget"
        if budget <= 0:
            raise StrataError(f"--vram-budget must be positive, got {vram_budget / GB:g} GB")
        if budget > free:
            raise StrataError(f"--vram-budget {budget / GB:.2f} GB is more than the GPU has free "
                              f"({free / GB:.2f} GB of {total / GB:.2f} GB)")
    else:
        budget, source = free - reserve, "automatic"
    fixed = dense + kv + scratch + runtime
    if fixed > budget:
        raise StrataError(f"the GPU needs {fixed / GB:.2f} GB before any expert slot (dense weights "
                          f"{dense / GB:.2f} + KV cache {kv / GB:.2f} + activations {scratch / GB:.2f} + runtime "
                          f"{runtime / GB:.2f}), the VRAM budget is {budget / GB:.2f} GB"
                          + (" (try a smaller --ctx)" if kv > 0.1 * fixed else ""))
    per_layer = sum(slot_bytes.values())
    if layout == "layers":
        slots, room = {l: 0 for l in slot_bytes}, budget - fixed
        for l in sorted(slot_bytes, reverse=True):
            if slot_bytes[l] * n_expert > room:
                break
            slots[l], room = n_expert, room - slot_bytes[l] * n_expert
    else:
        n = min(n_expert, (budget - fixed) // per_layer) if per_layer else 0
        slots = {l: int(n) for l in slot_bytes}
    return GPUPlan(free, total, budget, source, dense, kv, scratch, runtime, experts, dict(slot_bytes), slots,
                   n_expert)
