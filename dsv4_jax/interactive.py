"""Interactive chat on a terminal: `python -m dsv4_jax.generate --chat` with no --prompt.

Each turn, the whole conversation is encoded again with the chat encoder (dsv4_jax.chat: earlier reasoning is
dropped as the official encoder drops it) and the reply streams as it is generated. In thinking mode the
reasoning is shown, and only the text after `</think>` goes into the history as the reply. Ctrl-D (or an
empty input at end of file) leaves; Ctrl-C stops the reply being written and keeps what was said so far.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from .chat import encode_message_ids
from .serving.chat_output import ChatOutput
from .text import TextStream

PROMPT = "> "


def wants_interactive(args) -> bool:
    """Chat mode, no prompt given, a terminal on both ends, and output meant for a person."""
    return (args.chat and args.prompt is None and args.prompt_file is None and not args.json
            and not args.no_stream and sys.stdin.isatty() and sys.stdout.isatty())


def chat_loop(model, args, read_line: Callable[[str], str] = input,
              write: Callable[[str], None] | None = None, note: Callable[[str], None] | None = None) -> int:
    """Run the conversation until end of input. `read_line(prompt)` raises EOFError at the end; `write` gets the
    reply text as it streams, `note` one-line notices (stderr by default)."""
    write = write or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    note = note or (lambda text: print(text, file=sys.stderr, flush=True))
    tokenizer = model.tokenizer
    mode = "thinking" if args.thinking else "chat"
    history = [{"role": "system", "content": args.system}] if args.system is not None else []
    note("chat with the model; Ctrl-D leaves, Ctrl-C stops a reply")
    while True:
        try:
            line = read_line(PROMPT)
        except EOFError:
            write("\n")
            return 0
        if not line.strip():
            continue
        turn = history + [{"role": "user", "content": line}]
        ids = encode_message_ids(tokenizer, turn, mode, args.reasoning_effort)
        room = model.max_seq_len - len(ids)
        if room < 1:
            note(f"the conversation fills --max-seq-len {model.max_seq_len} ({len(ids)} tokens); "
                 f"start again with a larger --max-seq-len")
            continue
        stream = TextStream(tokenizer, args.stop, [tokenizer.eos_id])
        output = ChatOutput(thinking=args.thinking, tools=False)
        shown = {"reasoning_content": "", "content": ""}

        def show(pieces):
            for field, text in pieces:
                if field == "content" and shown["reasoning_content"] and not shown["content"]:
                    write("\n\n")                   # the reasoning is over
                shown[field] += text
                write(text)

        def on_tokens(new_tokens):
            show(output.push(stream.push(new_tokens[0])))
            return [0] if stream.stopped else []
        try:
            model.generate([ids], max_new_tokens=min(args.max_new_tokens, room), temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed + len(history), stream=on_tokens)
        except KeyboardInterrupt:
            note("\n(reply stopped)")
        show(output.push(stream.flush()))
        show(output.finish()[0])
        write("\n")
        history = turn + [{"role": "assistant", "content": shown["content"],
                           **({"reasoning_content": shown["reasoning_content"]} if args.thinking else {})}]
