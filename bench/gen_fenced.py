"""A generated text-protocol agent run whose results use wrappers no preset knows (issue #11).

Why: the recorded fenced runs all use formats the presets recognise, so they cannot show what happens in front of
an agent nobody wrote a rule for. This builds one, seeded and reproducible: a task, then rounds of an assistant's
thought with one fenced command and a user message carrying its output in one of four invented wrappers — the
output in tags, in a fenced block, between paragraphs, or between a header line and a trailer line (no blank line
anywhere). Outputs are mostly small, some tens of kilobytes, like a real run's.

    python bench/gen_fenced.py [--rounds 40] [--seed 11] [--out FILE]

``build(rounds, seed)`` returns the conversation (``{"messages", "model"}``, the shared trajectory format);
``tests/test_unknown_results.py`` and ``bench/rewrite.py`` replay it through the core.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

WORDS = ("module", "fixture", "config", "parser", "token", "request", "handler", "cache", "index", "schema",
         "worker", "socket", "buffer", "record", "failed", "passed", "skipped", "warning", "value", "offset")
COMMANDS = ("pytest -x tests/", "grep -rn parse src/", "cat src/app/parser.py", "git log --oneline -20",
            "python -m build", "find . -name '*.py'", "make check", "ls -la src/app")


def _line(rng: random.Random, k: int) -> str:
    return f"{k:5d}  " + " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(rng.randint(4, 12)))


def _output(rng: random.Random) -> str:
    size = int(rng.choice((300, 800, 1500, 3000, 6000)) if rng.random() < 0.85 else rng.randint(10_000, 40_000))
    lines, total = [], 0
    while total < size:
        lines.append(_line(rng, len(lines)))
        total += len(lines[-1]) + 1
    return "\n".join(lines)


def _wrapped(rng: random.Random, command: str, output: str, style: int) -> str:
    code = rng.choice((0, 0, 0, 1, 2))
    if style == 0:
        return f"$ {command}\n<stdout>\n{output}\n</stdout>\nexit status {code}"
    if style == 1:
        return f"Ran `{command}` (exit {code}):\n```\n{output}\n```\nWhat next?"
    if style == 2:
        return f"== {command} ==\n\n{output}\n\n== exit {code} =="
    return f">>> {command}\n{output}\n<<< exit {code}"


def _thought(rng: random.Random, n: int, command: str) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
    return f"THOUGHT: step {n}: {words}.\n\n```bash\n{command}\n```"


def build(rounds: int = 40, seed: int = 11) -> dict[str, Any]:
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a software agent. Answer with a THOUGHT and one ```bash block."},
        {"role": "user", "content": "The parser fails on empty records. Find why, fix it, run the tests, submit.\n"
                                    + " ".join(rng.choice(WORDS) for _ in range(60))},
    ]
    for n in range(1, rounds + 1):
        command = rng.choice(COMMANDS)
        messages.append({"role": "assistant", "content": _thought(rng, n, command)})
        messages.append({"role": "user", "content": _wrapped(rng, command, _output(rng), n % 4)})
    return {"model": "generated-unknown-wrapper", "messages": messages}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = json.dumps(build(args.rounds, args.seed), indent=1)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
