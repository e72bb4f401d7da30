"""strata-nb chat: a conversation in the terminal, its state kept in the engine session between turns."""
from __future__ import annotations

import sys
from typing import TextIO

from strata_nb.errors import StrataError
from strata_nb.model.textstream import TextStream
from strata_nb.runtime.sampler import SamplerConfig
from strata_nb.serve.conversations import Runner, Turn
from strata_nb.serve.saved import load_conversation, save_conversation

HELP = "commands: /reset (a new conversation), /save FILE, /load FILE, /stats, /quit"


class TerminalChat:
    """Reads the user's lines, streams the answers to out; notices and errors go to err. Each turn renders the
    whole conversation with the file's template and computes only the tokens the session does not hold yet."""

    def __init__(self, engine, *, sampler: SamplerConfig, max_new: int, system: str | None = None,
                 out: TextIO | None = None, err: TextIO | None = None):
        self.engine = engine
        self.sampler = sampler
        self.max_new = max_new
        self.system = system
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.runner = Runner(engine, park_budget_bytes=0)  # one conversation: the live session is its state
        self.messages: list[dict] = []
        self.last: Turn | None = None
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.runner.reset()
        self.last = None

    def run(self, lines: TextIO) -> None:
        interactive = lines.isatty()
        self._note(f"chat with {self.engine.path.name}; {HELP}")
        while True:
            if interactive:
                self.err.write("> ")
                self.err.flush()
            line = lines.readline()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        break
                else:
                    self.turn(line)
            except StrataError as e:
                self._note(f"error: {e}")

    def command(self, line: str) -> bool:
        """Run a /command; False ends the chat."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return False
        if name == "/reset":
            self.reset()
            self._note("conversation reset")
        elif name == "/save" and arg:
            save_conversation(arg, self.engine.gguf, self.runner.session.snapshot(), self.messages)
            self._note(f"saved {len(self.messages)} messages, {self.runner.session.pos} tokens to {arg}")
        elif name == "/load" and arg:
            snap, messages = load_conversation(arg, self.engine.gguf)
            self.runner.session.restore(snap)  # refused, changing nothing, when it does not fit this session
            self.messages, self.last = messages, None
            self._note(f"loaded {len(messages)} messages, {snap.pos} tokens from {arg}")
        elif name == "/stats":
            self._note(self.stats_line())
        else:
            self._note(HELP)
        return True

    def turn(self, text: str) -> None:
        msgs = self.messages + [{"role": "user", "content": text}]
        prompt = self.engine.model.encode_chat(msgs)
        n = self.engine.n_ctx - len(prompt)
        if n < 1:
            raise StrataError(f"the conversation ({len(prompt)} tokens) fills the context (--ctx "
                              f"{self.engine.n_ctx}); /reset or /save it")
        stream = TextStream(self.engine.tokenizer)
        parts: list[str] = []

        def on_token(t: int) -> None:
            piece = stream.push(t)
            if piece:
                parts.append(piece)
                self.out.write(piece)
                self.out.flush()

        self.last = self.runner.run(prompt, min(self.max_new, n), self.sampler, on_token=on_token)
        parts.append(stream.flush())
        self.out.write(parts[-1] + "\n")
        self.out.flush()
        self.messages = msgs + [{"role": "assistant", "content": "".join(parts)}]

    def stats_line(self) -> str:
        s = self.runner.session
        line = f"{len(self.messages)} messages, {s.pos} of {s.n_ctx} context tokens held"
        t = self.last
        if t is not None:
            r = t.result
            line += (f"; last turn: prompt {t.prompt_tokens} tokens ({t.cached_tokens} kept, "
                     f"{t.prompt_tokens - t.cached_tokens} computed in {r.prompt_s * 1000:.0f} ms), "
                     f"{len(r.tokens)} generated at {r.decode_tps:.1f} tok/s")
        return line

    def _note(self, msg: str) -> None:
        self.err.write(msg + "\n")
        self.err.flush()
