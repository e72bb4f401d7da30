"""The public API: load(model, ...) -> Engine; Engine.logits(), Engine.generate()."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from strata_nb.errors import StrataError
from strata_nb.model.gguf_file import GGUFFile
from strata_nb.model.spec import ModelSpec, check_architecture, spec_from_gguf
from strata_nb.model.weights import ModelWeights, bind_weights, check_quant_types
from strata_nb.plan import GPUPlan, Machine, MemoryPlan, make_gpu_plan, make_plan
from strata_nb.runtime.generate import GenerationResult, generate
from strata_nb.runtime.sampler import Sampler, SamplerConfig
from strata_nb.runtime.session import Session, state_bytes


@dataclass(frozen=True)
class MemoryNeeds:
    dense_bytes: int
    expert_bytes: int
    kv_bytes: int

    @property
    def total(self) -> int:
        return self.dense_bytes + self.expert_bytes + self.kv_bytes


def open_model(path: str | os.PathLike) -> tuple[GGUFFile, ModelSpec]:
    """Open and validate a GGUF (architecture, quant types, metadata) without binding any weights."""
    g = GGUFFile(path)
    check_architecture(g)
    check_quant_types(g)
    return g, spec_from_gguf(g)


def check_ctx(n_ctx: int) -> int:
    """The context length, refused unless positive."""
    if n_ctx <= 0:
        raise StrataError(f"--ctx must be positive, got {n_ctx}")
    return int(n_ctx)


class Model:
    """A GGUF opened and validated, with its tokenizer: everything a run can check before a weight is bound,
    uploaded or read (the CLI checks its whole request against this, then loads an Engine from it)."""

    def __init__(self, path: str | os.PathLike):
        from strata_nb.model.tokenizer import Tokenizer

        t0 = time.perf_counter()
        self.path = Path(path)
        self.gguf, self.spec = open_model(path)
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.open_s = time.perf_counter() - t0

    def require_experts(self, what: str) -> None:
        """Refuse a request that needs routed experts on a dense model."""
        if not self.spec.is_moe:
            raise StrataError(f"{self.path.name} has no routed experts: {what}")

    def encode(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        """The prompt ids of `text`; with chat, of the file's chat template rendered with a user message (after a
        system message when one is given). Special tokens in the text are parsed, as llama.cpp's tools do."""
        if not text:
            raise StrataError("empty prompt: nothing to run")
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            return self.encode_chat(msgs)
        return self.tokenizer.encode(text, add_special=True, parse_special=True)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The ids of a conversation ({'role', 'content'} dicts) rendered with the file's chat template, followed
        by the assistant's turn opening (add_generation_prompt)."""
        from strata_nb.model.chat import render_chat

        template = self.gguf.get("tokenizer.chat_template")
        if not template:
            raise StrataError(f"{self.path.name} has no tokenizer.chat_template; drop --chat")
        tok = self.tokenizer
        bos = _token_text(tok, tok.bos_id)
        text = render_chat(template, messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                           eos_token=_token_text(tok, tok.eos_id))
        add_special = not (bos and text.startswith(bos))  # a template that writes BOS itself: no second one
        return tok.encode(text, add_special=add_special, parse_special=True)

    def check_tokens(self, tokens: Sequence[int], n_ctx: int, n_new: int = 0) -> list[int]:
        """The prompt ids as ints, refused when empty, outside the vocabulary, or when they and n_new generated
        tokens do not fit the context."""
        check_ctx(n_ctx)
        toks = [int(t) for t in tokens]
        if not toks:
            raise StrataError("empty prompt: nothing to run")
        bad = [t for t in toks if not 0 <= t < self.spec.n_vocab]
        if bad:
            raise StrataError(f"token id {bad[0]} out of range 0..{self.spec.n_vocab - 1}")
        if len(toks) + n_new > n_ctx:
            if n_new:
                raise StrataError(f"prompt ({len(toks)} tokens) + -n {n_new} exceed the context (--ctx {n_ctx})")
            raise StrataError(f"prompt of {len(toks)} tokens is longer than the context (--ctx {n_ctx})")
        return toks


def _token_text(tok, tid: int | None) -> str:
    return tok.token_text(tid) if tid is not None and tid >= 0 else ""


def memory_needs(g: GGUFFile, spec: ModelSpec, n_ctx: int) -> MemoryNeeds:
    expert = sum(t.nbytes for n, t in g.tensors.items() if "_exps." in n)
    dense = sum(t.nbytes for t in g.tensors.values()) - expert
    return MemoryNeeds(dense, expert, state_bytes(spec, n_ctx))


def recent_slots(spec: ModelSpec) -> int:
    """Slots receiving SSD reads: a layer's misses plus the next layer's lookahead, a few times over."""
    return 4 * max(spec.n_expert_used, 4)


def plan_memory(g: GGUFFile, spec: ModelSpec, src, n_ctx: int, *, experts: str = "auto",
                ram_budget: float | None = None, vram_budget: float | None = None,
                machine: Machine | None = None) -> tuple[MemoryPlan, dict]:
    """The memory plan for a run, and the expert blob layouts it was sized with (src: an ExpertSource or None)."""
    from strata_nb.experts.tiered import layer_layout

    needs = memory_needs(g, spec, n_ctx)
    layouts = {l: layer_layout(src, l) for l in src.layers} if src is not None else {}
    plan = make_plan(dense=needs.dense_bytes, kv=needs.kv_bytes, experts=needs.expert_bytes,
                     n_blobs=len(layouts) * spec.n_expert,
                     slot_bytes=max((lay.slot_bytes for lay in layouts.values()), default=0),
                     recent_slots=recent_slots(spec), mode=experts, ram_budget=ram_budget, machine=machine)
    return plan, layouts


GPU_PROMPT_TOKENS = 256  # tokens per prompt chunk on the GPU (activation buffers are sized for this)


# The layer kinds the hybrid engine has GPU blocks for (each has passed its tests on the H200: the simulator runs
# one-lane warps and cannot see every fault, so a new kind joins this list only after a real GPU's run).
GPU_MIXERS = ("attention", "gated_attention", "deltanet")


def pick_device(device: str, vram_budget: float | None = None, spec: ModelSpec | None = None) -> tuple[str, str]:
    """("cuda" or "cpu", a line saying which engine runs and why). auto: the hybrid engine when numba-cuda finds a
    GPU and the model's layer kinds (spec) have GPU blocks, else the CPU engine. A vram_budget
    is refused when the CPU engine runs."""
    if device not in ("auto", "cuda", "cpu"):
        raise StrataError(f"unknown device {device!r} (auto, cuda or cpu)")
    kinds = {ls.mixer for ls in spec.layers} if spec is not None else set()
    missing = sorted(kinds - set(GPU_MIXERS))
    if device == "cpu":
        picked = "cpu", "device: CPU engine (--device cpu)"
    elif missing:
        why = f"the hybrid engine has no GPU block for {', '.join(missing)} layers yet ({spec.arch})"
        if device == "cuda":
            raise StrataError(f"--device cuda: {why}; run it with --device cpu")
        picked = "cpu", f"device: CPU engine ({why})"
    else:
        from strata_nb.runtime.cuda_rt import SIM, cuda_status

        ok, why = cuda_status()
        if ok and SIM and device == "auto":  # the simulator runs the hybrid engine only when asked (tests)
            picked = "cpu", "device: CPU engine (only numba's CUDA simulator found; --device cuda runs on it)"
        elif ok:
            picked = "cuda", f"device: hybrid GPU engine on {why}"
        elif device == "cuda":
            raise StrataError(f"--device cuda: {why}")
        else:
            picked = "cpu", f"device: CPU engine ({why})"
    if picked[0] == "cpu" and vram_budget is not None:
        raise StrataError("--vram-budget needs the hybrid GPU engine; this run uses the CPU engine")
    return picked


def gpu_needs(g: GGUFFile, spec: ModelSpec, n_ctx: int, kv_type: str = "f16") -> tuple[int, int, int]:
    """(dense weights, KV cache, activation buffers) in bytes of device memory."""
    from strata_nb.runtime import gpu_backend

    needs = memory_needs(g, spec, n_ctx)
    return (needs.dense_bytes, gpu_backend.kv_bytes(spec, n_ctx, kv_type),
            gpu_backend.scratch_bytes(spec, min(GPU_PROMPT_TOKENS, n_ctx), n_ctx))


def gpu_fixed_bytes(path: str | os.PathLike, n_ctx: int, kv_type: str = "f16") -> int:
    """VRAM the hybrid engine needs before any expert slot (a --vram-budget below this is refused)."""
    from strata_nb.plan import GPU_RUNTIME_BYTES

    g, spec = open_model(path)
    return sum(gpu_needs(g, spec, n_ctx, kv_type)) + GPU_RUNTIME_BYTES


def plan_gpu(g: GGUFFile, spec: ModelSpec, src, n_ctx: int, vram_budget: float | None,
             kv_type: str = "f16") -> GPUPlan:
    """Expert slots per MoE layer from the device's free memory (or vram_budget) after the fixed part."""
    from strata_nb.experts.vram_cache import slot_layout
    from strata_nb.runtime.cuda_rt import device_memory

    free, total = device_memory()
    dense, kv, scratch = gpu_needs(g, spec, n_ctx, kv_type)
    slot_bytes = {l: slot_layout(src, l).slot_bytes for l in src.layers} if src is not None else {}
    return make_gpu_plan(free=free, total=total, dense=dense, kv=kv, scratch=scratch,
                         experts=memory_needs(g, spec, n_ctx).expert_bytes, slot_bytes=slot_bytes,
                         n_expert=spec.n_expert, vram_budget=vram_budget,
                         layout=os.environ.get("STRATA_NB_VRAM_LAYOUT", "slots"))  # an experiment's switch


def set_threads(threads: int | None) -> int:
    """Use `threads` numba workers (default: all cores numba sees); refuse more than that."""
    import numba

    avail = numba.config.NUMBA_NUM_THREADS
    if threads is None:
        threads = avail
    if not 1 <= threads <= avail:
        raise StrataError(f"--threads must be in 1..{avail} on this machine, got {threads}")
    numba.set_num_threads(threads)
    return threads


class Engine:
    """A loaded model on one backend, with its tokenizer and its memory plan. model: a GGUF path, or a Model
    already opened (and the request checked against it).

    device: "auto" (the hybrid GPU engine when numba.cuda finds a GPU, else the CPU engine), "cuda" or "cpu".
    vram_budget (bytes, hybrid engine): dense weights + KV + activations + expert slots; None: the device's free
    memory minus a reserve.

    experts: "auto" (in place when they fit the RAM budget, else tiered), "mmap" (always in place: the A/B arm)
    or "tiered" (resident arena + SSD reads, even when everything fits). ram_budget / vram_budget in bytes
    (None: automatic). kv_type: the hybrid engine's KV cache, "f16" (as llama.cpp) or "f32".
    expert_profile: a routing profile to fill the arena hottest-first. lookahead_k: experts per
    token predicted for the next layer and read ahead (0: off; default top-k + 2).
    """

    def __init__(self, model: str | os.PathLike | Model, *, device: str = "auto", pack: str | None = None,
                 n_ctx: int = 4096, threads: int | None = None, fast: bool = True, experts: str = "auto",
                 ram_budget: float | None = None, vram_budget: float | None = None,
                 expert_profile: str | os.PathLike | None = None, lookahead_k: int | None = None,
                 reader_threads: int = 8, read_timeout_s: float = 60.0, adapt_every: int = 4, machine: Machine | None = None,
                 gpu_timeout_s: float = 60.0, kv_type: str = "f16",
                 progress: Callable[[int, int], None] | None = None):
        t0 = time.perf_counter()
        from strata_nb.experts.profile import RoutingProfile
        from strata_nb.experts.source import open_experts
        from strata_nb.experts.store import MappedStore
        from strata_nb.experts.tiered import TieredStore
        from strata_nb.runtime.cpu_backend import CPUBackend

        self.model = model if isinstance(model, Model) else Model(model)
        self.path, self.gguf, self.spec, self.tokenizer = (self.model.path, self.model.gguf, self.model.spec,
                                                           self.model.tokenizer)
        # The options first: nothing below is bound, read or uploaded before every argument has been accepted.
        self.n_ctx = check_ctx(n_ctx)
        if lookahead_k is None:  # the router's own top-k and two more: most misses, few wasted reads
            lookahead_k = self.spec.n_expert_used + 2
        if lookahead_k < 0:
            raise StrataError(f"--lookahead must be >= 0, got {lookahead_k}")
        if reader_threads < 1 or read_timeout_s <= 0:
            raise StrataError("reader threads must be >= 1 and the read timeout positive")
        if kv_type not in ("f16", "f32"):
            raise StrataError(f"--kv-type must be f16 or f32, got {kv_type!r}")
        self.threads = set_threads(threads)
        self.device, self.device_line = pick_device(device, vram_budget, self.spec)
        self.weights: ModelWeights = bind_weights(self.gguf, self.spec)
        src = open_experts(self.gguf, pack) if self.spec.is_moe else None
        profile = None
        if src is not None:
            profile = (RoutingProfile.load(expert_profile, self.spec) if expert_profile is not None
                       else RoutingProfile.for_spec(self.spec))
        self.plan, layouts = plan_memory(self.gguf, self.spec, src, self.n_ctx, experts=experts,
                                         ram_budget=ram_budget, machine=machine)
        self.gpu_plan = (plan_gpu(self.gguf, self.spec, src, self.n_ctx, vram_budget, kv_type)
                         if self.device == "cuda" else None)
        # Loading proper: the resident experts are read (tiered) or uploaded (hybrid) from here on.
        self.store = None
        self.locked_bytes = 0
        if src is not None and self.plan.mode == "tiered":
            # RAM is full by design: keep the dense weights (embedding table included: a page fault on its row
            # would read ahead megabytes) out of the kernel's reclaim.
            self.locked_bytes = self.gguf.lock([t for n, t in self.gguf.tensors.items() if "_exps." not in n])
            self.store = TieredStore(src, self.spec.n_expert, self.plan.arena, recent_slots(self.spec), profile=profile,
                                     reader_threads=reader_threads, read_timeout_s=read_timeout_s,
                                     adapt_every=adapt_every, layouts=layouts, progress=progress)
            self.store.lookahead_k = lookahead_k
        elif src is not None:
            self.store = MappedStore(src, profile)
        if self.device == "cuda":
            from strata_nb.runtime.gpu_backend import GPUBackend

            self.backend = GPUBackend(self.spec, self.weights, self.store, n_ctx=self.n_ctx,
                                      vram_slots=self.gpu_plan.slots, fast=fast,
                                      ntok_max=GPU_PROMPT_TOKENS, timeout_s=gpu_timeout_s,
                                      adapt_every=adapt_every, kv_type=kv_type, progress=progress)
        else:
            self.backend = CPUBackend(self.spec, self.weights, self.store, fast=fast)
        self.load_s = self.model.open_s + time.perf_counter() - t0
        self.warm_s: float | None = None  # compile/warm-up time, once warm_up() has run

    def warm_up(self) -> float:
        """Compile every kernel the forward calls (or load it from numba's on-disk cache) outside anything timed:
        a throwaway forward that leaves sessions, expert stores, the routing profile and stats as they were.
        Runs once (generate calls it); returns its wall time."""
        if self.warm_s is None:
            t0 = time.perf_counter()
            self._warm_routed_in_helpers()
            self.backend.warm_up()
            self.warm_s = time.perf_counter() - t0
        return self.warm_s

    def _warm_routed_in_helpers(self) -> None:
        """On a first run (nothing in numba's cache) of the CPU engine with more than one core: helper processes
        compile the routed-expert drivers while this process compiles every other kernel (runtime/warm.py); the
        warm-up's forward then loads them from the cache. The demo's cold compile on a 2-core VM: 22.7 s, against
        30.2 in one process."""
        from strata_nb._numba_env import kernels_cached
        from strata_nb.runtime import warm
        from strata_nb.runtime.cpu_backend import CPUBackend

        # not where RAM is short (a tiered store): a helper's compile needs a few hundred MB of its own
        if not isinstance(self.backend, CPUBackend) or self.store is None or self.store.tiered or kernels_cached():
            return
        procs = warm.start(self.path, self.backend.fast, self.backend.routed_kernel_layers())
        if not procs:
            return
        try:
            self.backend.warm_up(routed=False)
        except BaseException:
            warm.join(procs, 0.0)  # stops them
            raise
        warm.join(procs)

    def save_profile(self, path: str | os.PathLike) -> None:
        """Write the routing profile (loaded counts plus this run's) for the next run's --expert-profile."""
        self.model.require_experts("no routing profile to save")
        self.store.profile.save(path)

    def close(self) -> None:
        if hasattr(self.backend, "close"):
            self.backend.close()
        if self.store is not None:
            self.store.close()

    # -- inputs -------------------------------------------------------------------------------------------
    def check_tokens(self, tokens: Sequence[int], n_new: int = 0) -> list[int]:
        return self.model.check_tokens(tokens, self.n_ctx, n_new)

    def new_session(self) -> Session:
        """A sequence at position 0 whose layer states are the engine's (on the GPU engine: its device state, which
        only one session at a time holds; an older one continues only from a restored snapshot)."""
        return self.backend.new_session(self.n_ctx)

    def forward(self, session: Session, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Run tokens at the session's position (ids checked against the vocabulary and the context left); the
        logits of the last position f32[1, vocab], or of every one [T, vocab]. With snapshot()/restore() and
        rewind() this is how a caller keeps conversations: only new tokens are computed."""
        toks = self.check_tokens(tokens)
        session.reserve(len(toks))
        return self.backend.forward(session, np.asarray(toks, np.int64), all_logits=all_logits)

    def rewind(self, session: Session, pos: int) -> None:
        """Return a session to position pos of its own sequence: a KV cache drops its tail; a recurrent model
        goes back to its newest checkpoint at or before pos (Session.checkpoint) and runs the tokens from there
        to pos again."""
        tokens = list(session.tokens[:pos])
        at = session.truncate(pos)
        if at < pos:
            self.forward(session, tokens[at:])

    # -- running ------------------------------------------------------------------------------------------
    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 [len(tokens), vocab]: the logits at every position of a fresh sequence."""
        toks = self.check_tokens(tokens)
        return self.backend.forward(self.new_session(), np.asarray(toks, np.int64), all_logits=True)

    def generate(self, prompt: Sequence[int], max_new: int = 128, sampler: SamplerConfig | None = None,
                 on_token: Callable[[int], bool | None] | None = None, keep_logits: bool = False,
                 session: Session | None = None) -> GenerationResult:
        """Generate from a fresh sequence, or continue `session` (prompt: only the tokens after what it holds).
        on_token sees every generated id; returning True stops generation (GenerationResult.stopped_by "caller")."""
        toks = self.check_tokens(prompt)
        s = Sampler(sampler or SamplerConfig(), self.spec.n_vocab)
        self.warm_up()  # before generate's clocks start: a first run's compile is not prompt time
        return generate(self.backend, self.new_session() if session is None else session, toks, max_new, s,
                        set(self.tokenizer.eog_ids), on_token=on_token, keep_logits=keep_logits)


def load(model: str | os.PathLike | Model, **kwargs) -> Engine:
    """Load a GGUF MoE (or dense) model for generation. See Engine for the options."""
    return Engine(model, **kwargs)
